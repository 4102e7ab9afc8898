"""minillm.quant.formats (FP8 E4M3/E5M2, NF4, fake-quantized) against plain references, and
minillm.quant.gguf_types against the gguf package and the shipped SmolLM2 file."""
from __future__ import annotations

import pytest
import torch

from minillm import ModelConfig
from minillm.quant import formats, gguf_types


# --------------------------------------------------------------------------- the formats' values


def test_fp8_value_tables():
    e4m3, e5m2 = formats.fp8_values("e4m3"), formats.fp8_values("e5m2")
    assert e4m3.max() == 448 == formats.E4M3_MAX and e4m3.min() == -448
    assert e5m2.max() == 57344 == formats.E5M2_MAX
    # 256 codes: e4m3fn loses 2 NaN codes and shares ±0; e5m2 loses 2 × (inf + 3 NaN) and ±0
    assert len(e4m3) == 256 - 2 - 1 and len(e5m2) == 256 - 8 - 1
    assert e4m3[e4m3 > 0].min() == 2.0 ** -9 and e5m2[e5m2 > 0].min() == 2.0 ** -16
    # they agree with torch's own float8 dtypes, code for code
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        table = formats.fp8_values(fmt)
        assert torch.equal(table.float().to(dtype).float().double(), table)


def test_nf4_levels():
    levels = formats.NF4_LEVELS
    assert len(levels) == 16 and len(set(levels.tolist())) == 16
    assert levels[0] == -1 and levels[-1] == 1 and 0.0 in levels.tolist()
    assert torch.all(levels[1:] > levels[:-1])
    assert torch.allclose(formats.nf4_levels_from_normal(), levels, atol=2e-6, rtol=0)


# --------------------------------------------------------------------------- fast path vs reference


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nf4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fake_quantize_matches_the_reference(fmt, seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols = 24, 192
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 0, rows)[:, None]
    w[0, :7] *= 40.0                                   # an outlier row
    w[1] *= torch.rand(cols, generator=g) ** 4         # many tiny values: subnormals in FP8
    fast = formats.fake_quantize(w, fmt)
    ref = formats.reference_fake_quantize(w, fmt)
    assert fast.shape == w.shape and fast.dtype == w.dtype
    assert torch.equal(fast, ref)
    # the largest |w| of a row (FP8) or block (NF4) is kept up to its scale's precision
    blocks = w.reshape(rows, -1, 64) if fmt == "nf4" else w[:, None]
    fblocks = fast.reshape(blocks.shape)
    amax = blocks.abs().amax(-1)
    assert torch.allclose(fblocks.abs().amax(-1), amax, rtol=1e-3)


@pytest.mark.parametrize("fmt,value,expected", [
    ("e4m3", 1.0625, 1.0), ("e4m3", 1.1875, 1.25), ("e4m3", 1.03, 1.0), ("e4m3", 300.0, 288.0),
    ("e5m2", 1.125, 1.0), ("e5m2", 1.375, 1.5), ("e5m2", 3.1, 3.0),
])
def test_fp8_rounds_to_nearest_even(fmt, value, expected):
    top = formats.E4M3_MAX if fmt == "e4m3" else formats.E5M2_MAX
    w = torch.tensor([[value, top]])                  # scale 1: the row's absmax is the format's max
    assert formats.fake_quantize(w, fmt)[0, 0].item() == expected
    assert formats.reference_fake_quantize(w, fmt)[0, 0].item() == expected


def test_nf4_rounds_to_the_nearest_level_per_block():
    levels = formats.NF4_LEVELS.float()
    w = torch.cat([levels * 0.5, levels.flip(0) * 2.0]).reshape(2, 16)
    out = formats.fake_quantize(w, "nf4", 16)
    assert torch.allclose(out, w, atol=1e-6)          # levels times an exact fp16 scale survive
    assert torch.equal(formats.fake_quantize(torch.zeros(2, 64), "nf4"), torch.zeros(2, 64))


def test_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="choose one of"):
        formats.fake_quantize(torch.randn(2, 64), "int3")
    with pytest.raises(ValueError, match="divisor of 48"):
        formats.fake_quantize(torch.randn(2, 48), "nf4", 64)
    with pytest.raises(ValueError, match="group_size=None"):
        formats.fake_quantize(torch.randn(2, 64), "e4m3", 64)


def test_bits_and_bytes():
    assert formats.bits_per_weight("nf4", 576) == 4.25
    assert formats.bits_per_weight("e4m3", 576) == pytest.approx(8 + 32 / 576)
    from minillm import LlamaModel
    from minillm.quant import weight_bytes

    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0)
    full = weight_bytes(model)["per_token"]
    for fmt in ("e4m3", "nf4"):
        got = formats.weight_bytes(model, fmt)["per_token"]
        proj = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
        want = full - proj * 4 + sum(
            p.numel() * formats.bits_per_weight(fmt, p.shape[1]) / 8
            for n, p in model.named_parameters() if n.endswith("proj.weight"))
        assert got == pytest.approx(want, abs=1)


def test_fake_quantize_model_leaves_the_model_alone():
    from minillm import LlamaModel

    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=1)
    before = model.layers[0].mlp.down_proj.weight.clone()
    copy = formats.fake_quantize_model(model, "nf4", 32)
    assert torch.equal(model.layers[0].mlp.down_proj.weight, before)
    w = copy.layers[0].mlp.down_proj.weight
    assert not torch.equal(w, before)
    assert torch.equal(w, formats.fake_quantize(before, "nf4", 32))
    assert torch.equal(copy.lm_head.weight, model.lm_head.weight)


# --------------------------------------------------------------------------- GGUF types


def test_block_table_matches_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    for name, (n, nbytes) in gguf_types.BLOCKS.items():
        assert tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]) == (n, nbytes), name
    assert gguf_types.bits_per_weight("Q4_K") == 4.5
    assert gguf_types.bits_per_weight("Q4_1") == 5.0
    assert gguf_types.bits_per_weight("Q6_K") == 6.5625


def test_use_more_bits_picks_14_of_30_layers():
    picked = [i for i in range(30) if gguf_types.use_more_bits(i, 30)]
    assert picked == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


def test_q4_k_m_plan_for_smollm2_falls_back_where_rows_are_576():
    cfg = ModelConfig.smollm2_135m()
    layout = gguf_types.plan(cfg, "Q4_K_M")
    counts = gguf_types.type_counts(layout)
    # 576 is not a multiple of 256: q, k, o, gate, up fall back to Q5_0 (and v too), the tied
    # embedding takes Q8_0; only ffn_down (rows of 1536 = 6 × 256) keeps K-quants
    assert counts == {"F32": 61, "Q5_0": 5 * 30 + 16, "Q8_0": 14 + 1, "Q6_K": 14, "Q4_K": 16}
    assert layout["blk.5.ffn_down.weight"] == "Q6_K" and layout["blk.6.ffn_down.weight"] == "Q4_K"
    assert layout["blk.5.attn_v.weight"] == "Q8_0" and layout["blk.6.attn_v.weight"] == "Q5_0"
    size = gguf_types.plan_bytes(cfg, layout)
    assert size["params"] == cfg.num_params(include_embedding=True)
    # hand count: 78,077,952 × 5.5/8 + (1,548,288 + 28,311,552) × 8.5/8 + 12,386,304 × 6.5625/8
    #             + 14,155,776 × 4.5/8 + 35,136 × 4
    assert size["bytes"] == 53_678_592 + 31_726_080 + 10_160_640 + 7_962_624 + 140_544


def test_q4_k_m_plan_without_fallback_when_rows_fit():
    cfg = ModelConfig.tiny(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                           head_dim=64, num_layers=8)
    layout = gguf_types.plan(cfg, "Q4_K_M")
    assert layout["token_embd.weight"] == "Q6_K"
    assert {layout[f"blk.{i}.attn_q.weight"] for i in range(8)} == {"Q4_K"}
    bpw = gguf_types.plan_bytes(cfg, layout)["bits_per_weight"]
    assert 4.5 < bpw < 6.5625


def test_q4_1_plan_is_the_shipped_file_tensor_for_tensor():
    pytest.importorskip("gguf")
    try:
        tensors = gguf_types.file_tensors()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    import gguf

    from minillm.gguf_loader import config_from_gguf, find_model_path

    cfg = config_from_gguf(gguf.GGUFReader(find_model_path()))
    layout = gguf_types.plan(cfg, "Q4_1")
    assert {name: kind for name, kind, *_ in tensors} == layout
    shapes = gguf_types.tensor_shapes(cfg)
    assert all(shapes[name] == shape for name, _, shape, *_ in tensors)
    assert gguf_types.summary(tensors) == gguf_types.plan_bytes(cfg, layout)["by_type"]
    assert gguf_types.type_counts(layout) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_plan_rejects_other_file_types():
    with pytest.raises(ValueError, match="Q4_K_M"):
        gguf_types.plan(ModelConfig.smollm2_135m(), "Q2_K")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nf4"])
def test_fake_quantize_on_cuda_equals_the_cpu(fmt):
    """The float8 casts and the NF4 bucketize run on the GPU too (Lab 06 on a GPU), with the
    CPU's results bit for bit."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(5)) * 0.05
    assert torch.equal(formats.fake_quantize(w.cuda(), fmt).cpu(), formats.fake_quantize(w, fmt))
