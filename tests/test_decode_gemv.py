"""The decode GEMV (`minillm.kernels.decode_gemv`) against the unfused path it replaces.

Oracle: the plain glue of `minillm.layers.fused` (`rms_norm_ref`, `silu_mul_ref`, `x + delta`)
rounded to the dtype where it rounds, then the product in float64 with W as given (a float
W, or Ŵ = `dequantize_packed` in fp32: exact). The kernel reads the same rounded input and
sums in fp32, so the products agree to the fp32 sum's error, and to the output's rounding
in fp16 / bf16; a wrong column, group, zero point or norm is off by far more. The residual
sum s must equal `x + delta` bit for bit. On a CPU the kernel runs in Triton's interpreter
(fp32, fp16); with CUDA the same tests run compiled, in bf16 too. At model level, a tiny
model's decode steps through it give the unfused path's logits.

q|k|v's product with RoPE and the K/V store in its epilogue has an exact oracle: the same
product, then `glue.rope_kv` on it. Both round the sums to the dtype, then rotate with the
one helper (`glue.rope_pair`), so the output and the caches must agree bit for bit, and so
must a tiny model's logits and caches (DecodeGraph's static step, the engine's paged one)
with the epilogue on and off (`fused.FUSED_ROPE`).
"""
from __future__ import annotations

import zlib

import pytest
import torch
from compile_utils import assert_compiles

import minillm.kernels  # noqa: F401  (chooses the interpreter before triton is imported)
import triton
from minillm import LlamaModel, ModelConfig, decode_graph
from minillm.engine import LLMEngine, SamplingParams
from minillm.kernels import decode_gemv as dg
from minillm.kernels import glue, tuning
from minillm.layers import fused
from minillm.model import rope_cos_sin
from minillm.quant import quantize_model
from minillm.quant.packing import dequantize_packed, pack
from minillm.quant.weights import rtn

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32,
                                                                     torch.float16]
# (rtol, atol) of y against float64 products of the same rounded input: the fp32 sum's
# order (fp32), the output's rounding (half an ulp), and an input element one ulp off where
# the norm's rsqrt differs in its last bit (fp16 / bf16).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def weights(g, kind, n, k, dtype):
    """(what the kernel takes, the exact fp64 matrix it stands for)."""
    if kind == "dense":
        w = randn(g, n, k, dtype=dtype, scale=k ** -0.5)
        return w, w.double()
    group, sym = {"int4 g64 asym": (64, False), "int4 g32 sym": (32, True),
                  "int4 g192 asym": (192, False)}[kind]
    qw, scales, zeros = (t.to(DEVICE) for t in pack(rtn(torch.randn(n, k, generator=g),
                                                        bits=4, group_size=group, sym=sym)))
    exact = dequantize_packed(qw, scales, zeros, bits=4, dtype=torch.float32).double()
    return dg.Int4Weight(qw, scales, None if sym else zeros, group), exact


def check(y, h, exact, dtype, what):
    rtol, atol = TOL[dtype]
    expected = h.double() @ exact.T
    assert y.dtype == dtype and y.shape == expected.shape, what
    assert not y.isnan().any(), f"{what}: NaN (an unmasked load or an unwritten output)"
    scale = expected.abs().max().item()
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=atol * scale, msg=what)


KINDS = ["dense", "int4 g64 asym", "int4 g32 sym", "int4 g192 asym"]
SHAPES = [(1, 576, 960), (3, 576, 1000), (4, 1536, 576), (2, 192, 72)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_norm_linear_equals_add_norm_then_product(gen, dtype, kind, m, k, n):
    if kind == "int4 g192 asym" and k % 192:
        pytest.skip("192 does not divide K")
    x, delta = randn(gen, m, k, dtype=dtype), randn(gen, m, k, dtype=dtype)
    nw = 1 + randn(gen, k, scale=0.2, dtype=dtype)
    w, exact = weights(gen, kind, n, k, dtype)
    s, y = dg.norm_linear(x, delta, nw, 1e-5, w)
    assert torch.equal(s, x + delta), "the residual sum must round exactly as x + delta does"
    check(y, fused.rms_norm_ref(x + delta, nw, 1e-5), exact, dtype, f"{kind} add+norm")
    s, y = dg.norm_linear(x, None, nw, 1e-5, w)
    assert s.data_ptr() == x.data_ptr(), "without delta, s is x itself"
    check(y, fused.rms_norm_ref(x, nw, 1e-5), exact, dtype, f"{kind} norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS[:3])
@pytest.mark.parametrize("m, k, n", SHAPES[:3])
def test_silu_mul_linear_and_linear_equal_the_unfused_product(gen, dtype, kind, m, k, n):
    gate_up = randn(gen, m, 2 * k, dtype=dtype, scale=2.0)
    w, exact = weights(gen, kind, n, k, dtype)
    check(dg.silu_mul_linear(gate_up, w), fused.silu_mul_ref(gate_up), exact, dtype,
          f"{kind} silu_mul")
    x = randn(gen, m, k, dtype=dtype)
    check(dg.linear(x, w), x, exact, dtype, f"{kind} linear")


def test_leading_dims_strided_rows_and_a_transposed_weight(gen):
    """x [B, T, K] with rows further apart than K (a slice), W stored [in, out] (a CPU
    model's matvec layout): the same products."""
    big = randn(gen, 2, 1, 700)
    x = big[..., :576]
    nw = 1 + randn(gen, 576, scale=0.2)
    w = randn(gen, 576, 300).t()  # [300, 576], column stride 300
    s, y = dg.norm_linear(x, None, nw, 1e-6, w)
    assert y.shape == (2, 1, 300)
    check(y.reshape(2, 300), fused.rms_norm_ref(x, nw, 1e-6).reshape(2, 576), w.double(),
          torch.float32, "strided")


def test_a_rows_result_does_not_depend_on_the_other_rows(gen):
    """Batch invariance: row 0 alone and row 0 among three give the same bits."""
    x, d = randn(gen, 3, 576), randn(gen, 3, 576)
    nw = 1 + randn(gen, 576, scale=0.2)
    w, _ = weights(gen, "int4 g64 asym", 960, 576, torch.float32)
    _, alone = dg.norm_linear(x[:1], d[:1], nw, 1e-5, w)
    _, among = dg.norm_linear(x, d, nw, 1e-5, w)
    assert torch.equal(alone[0], among[0])


def test_bad_arguments_get_clear_errors(gen):
    x, w = randn(gen, 2, 64), randn(gen, 32, 64)
    nw = randn(gen, 64)
    with pytest.raises(ValueError, match="K = 48 columns"):
        dg.linear(randn(gen, 2, 48), w)
    with pytest.raises(ValueError, match="delta must match x"):
        dg.norm_linear(x, randn(gen, 2, 32), nw, 1e-5, w)
    with pytest.raises(ValueError, match="norm_weight must be a contiguous"):
        dg.norm_linear(x, None, randn(gen, 32), 1e-5, w)
    with pytest.raises(ValueError, match="must be even"):
        dg.silu_mul_linear(randn(gen, 2, 65), w)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        dg.linear(randn(gen, 64, 2).t(), w)
    with pytest.raises(ValueError, match="2-d float tensor"):
        dg.linear(x, randn(gen, 64))
    with pytest.raises(ValueError, match="same dtype"):
        dg.linear(x, w.half())
    qw, sc, z = pack(rtn(torch.randn(32, 64, generator=gen), bits=4, group_size=64, sym=False))
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        dg.linear(x, dg.Int4Weight(qw.to(DEVICE), sc.to(DEVICE), z.to(DEVICE), 48))
    with pytest.raises(ValueError, match="not one the decode GEMV reads"):
        qw24, sc24, z24 = pack(rtn(torch.randn(32, 72, generator=gen), bits=4, group_size=24,
                                   sym=False))
        dg.linear(randn(gen, 2, 72), dg.Int4Weight(qw24.to(DEVICE), sc24.to(DEVICE),
                                                   z24.to(DEVICE), 24))


# ------------------------------------------------------------ RoPE in q|k|v's epilogue

# (num_q, num_kv, D, K): SmolLM2's q|k|v (N 960: four tiles of 256 on the interpreter, the
# last one partial), and a small odd one (N 120, D / 2 = 12: pairs across a tile's edge)
ROPE_HEADS = [(9, 3, 64, 576), (3, 1, 24, 64)]


def rope_tables(g, m, dim, dtype):
    """cos, sin [m, dim] (`rope_cos_sin` rows at random positions, the last one included)
    in `dtype`."""
    cos, sin = rope_cos_sin(dim, 2048, 1e5)
    pos = torch.cat([torch.tensor([2047]), torch.randint(0, 2048, (m - 1,), generator=g)])
    return cos[pos].to(DEVICE, dtype), sin[pos].to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS[:3])
@pytest.mark.parametrize("num_q, num_kv, dim, k", ROPE_HEADS)
@pytest.mark.parametrize("store", [True, False], ids=["kv_write", "rotate_only"])
def test_the_rope_epilogue_gives_the_bits_of_rope_kv_after_the_product(gen, dtype, kind, num_q,
                                                                       num_kv, dim, k, store):
    """q|k|v's product with RoPE (and the K/V store) in its epilogue against the unfused
    path, `dg.norm_linear` then `glue.rope_kv` on its heads, bit for bit: the output (q and
    k rotated, v as the product gave it), the caches' rows at the slots, every other row
    untouched. M = 1..4, with and without delta, tables in fp32 and in the model's dtype."""
    heads = num_q + 2 * num_kv
    w, _ = weights(gen, kind, heads * dim, k, dtype)
    nw = 1 + randn(gen, k, scale=0.2, dtype=dtype)
    num_slots = 7
    for m, table, with_delta in ((1, torch.float32, True), (2, dtype, False),
                                 (3, torch.float32, False), (4, dtype, True)):
        what = f"{kind} M {m} tables {table} delta {with_delta}"
        x = randn(gen, m, k, dtype=dtype)
        delta = randn(gen, m, k, dtype=dtype) if with_delta else None
        cos, sin = rope_tables(gen, m, dim, table)
        caches = randn(gen, num_slots, num_kv, dim, dtype=dtype), randn(gen, num_slots, num_kv,
                                                                        dim, dtype=dtype)
        slots = torch.randperm(num_slots, generator=gen)[:m].to(DEVICE)
        kv = (caches[0].clone(), caches[1].clone(), slots) if store else None
        s, y = dg.norm_linear(x, delta, nw, 1e-5, w, dg.Rope(num_q, num_kv, dim, cos, sin, kv))

        want_s, want = dg.norm_linear(x, delta, nw, 1e-5, w)
        product = want.clone()
        want_kv = (caches[0].clone(), caches[1].clone(), slots) if store else None
        glue.rope_kv(want.view(m, heads, dim), num_q, num_kv, cos, sin, want_kv)
        assert torch.equal(s, want_s), what
        assert torch.equal(y, want), f"{what}: the epilogue's heads are not rope_kv's"
        q_k = (num_q + num_kv) * dim
        assert not torch.equal(y[:, :q_k], product[:, :q_k]), f"{what}: q|k not rotated"
        assert torch.equal(y[:, q_k:], product[:, q_k:]), f"{what}: v must stay"
        if store:
            for got, expected, name in ((kv[0], want_kv[0], "k"), (kv[1], want_kv[1], "v")):
                assert torch.equal(got, expected), f"{what}: the {name} cache differs"
            assert torch.equal(kv[0][slots], y.view(m, heads, dim)[:, num_q:num_q + num_kv])
            untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
            untouched[slots] = False
            assert torch.equal(kv[0][untouched], caches[0][untouched]), what
            assert torch.equal(kv[1][untouched], caches[1][untouched]), what


@pytest.fixture(params=["interpreter", "sm_90"])
def tiles_of(request, monkeypatch):
    """Which tiles a launch takes: the interpreter's own, or (still run in the interpreter)
    those a launch on an H100 resolves, pinned or measured (`DECODE_GEMV.run`)."""
    if request.param == "sm_90":
        monkeypatch.setattr(dg, "interpreter_enabled", lambda: False)
        monkeypatch.setattr(tuning, "interpreter_enabled", lambda: False)
        monkeypatch.setattr(tuning, "device_arch", lambda device=None: 90)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(tuning, "_ready", {})
    return request.param


@pytest.mark.parametrize("kind", ["dense", "int4 g64 asym"])
def test_other_tiles_compute_the_same_products(gen, kind, tiles_of):
    # `dg.tiles` (the gemv_tiles section of the GPU check times candidates with it) changes
    # which program computes which rows and how many chunks a step loads, not the result:
    # every candidate against the unfused oracle, the RoPE epilogue and SiLU·up included
    # (small shapes: the interpreter runs one program at a time, and BLOCK_N 2 makes many;
    # K 384 is 6 chunks of 64, so an unroll of 4 leaves a partial step, 24 a mostly empty one).
    # With sm_90's tiles a tile's unroll is its class's (9 at K 128: a mostly empty step).
    # SPLIT chunks side by side: 4 at K 128 (2 chunks) and 384 (6) leave chunks past K, and
    # 3 steps of 2 cover 384 in one loop.
    dtype = DTYPES[0]
    k, num_q, num_kv, dim = 128, 3, 1, 16
    n = (num_q + 2 * num_kv) * dim
    w, exact = weights(gen, kind, n, k, dtype)
    w_down, exact_down = weights(gen, kind, 24, 384, dtype)
    x, delta, nw = randn(gen, 1, k, dtype=dtype), randn(gen, 1, k, dtype=dtype), \
        1 + randn(gen, k, scale=0.2, dtype=dtype)
    gate_up = randn(gen, 1, 2 * 384, dtype=dtype, scale=2.0)
    cos, sin = rope_tables(gen, 1, dim, torch.float32)
    rope = dg.Rope(num_q, num_kv, dim, cos, sin)
    for tiles in ({"block_n": 2, "warps": 1, "unroll": 4}, {"block_n": 8, "warps": 2},
                  {"block_n": 16, "warps": 4, "unroll": 24},
                  {"block_n": 2, "warps": 2, "unroll": 1, "split": 4},
                  {"block_n": 4, "warps": 1, "unroll": 3, "split": 2}):
        what = f"{kind} {tiles}"
        own = dg.launch_tiles(n, k, w, dtype)  # what a launch gets here (GPU: the pinned)
        with dg.tiles(**tiles):
            got = dg.launch_tiles(n, k, w, dtype)
            s, y = dg.norm_linear(x, delta, nw, 1e-5, w)
            _, y_rope = dg.norm_linear(x, delta, nw, 1e-5, w, rope)
            y_down = dg.silu_mul_linear(gate_up, w_down)
        assert got[:2] == (tiles["block_n"], tiles["warps"])
        assert got[2] == (tiles.get("unroll", own[2]) if kind != "dense" else 1)
        assert got[3] == (tiles.get("split", own[3]) if kind != "dense" else 1)
        assert torch.equal(s, x + delta), what
        check(y, fused.rms_norm_ref(x + delta, nw, 1e-5), exact, dtype, what)
        want_rope = y.clone()  # the same tiles' product, then rope_kv: the epilogue's bits
        glue.rope_kv(want_rope.view(1, -1, dim), num_q, num_kv, cos, sin, None)
        assert torch.equal(y_rope, want_rope), what
        check(y_down, fused.silu_mul_ref(gate_up), exact_down, dtype, what)
    assert dg.launch_tiles(n, k, w, dtype) == own  # the override ends with the block


@pytest.mark.parametrize("kind", ["int4 g192 asym", "int4 g32 sym"])
def test_split_tiles_take_each_chunks_own_group(gen, kind):
    """SPLIT chunks side by side (`dg.tiles(split=...)`): each chunk of BLOCK_K columns reads
    its own group's scale (and zero) where a group spans three chunks (g192 at BLOCK_K 64)
    and where a chunk is a whole small group (g32), chunks past K included (576 is 9 chunks
    of 64: a step of 8 leaves 7 past K)."""
    dtype = DTYPES[0]
    w, exact = weights(gen, kind, 24, 576, dtype)
    x = randn(gen, 2, 576, dtype=dtype)
    for tiles in ({"block_n": 2, "warps": 4, "unroll": 3, "split": 8},
                  {"block_n": 4, "warps": 1, "unroll": 1, "split": 2}):
        with dg.tiles(**tiles):
            assert dg.launch_tiles(24, 576, w, dtype)[3] == tiles["split"]
            y = dg.linear(x, w)
        check(y, x, exact, dtype, f"{kind} {tiles}")


# SmolLM2's products, (name, N, K, prologue), and the tiles each ran with on the H100 of
# 2026-11-27 (1,535 tok/s in bf16): (BLOCK_N, warps, UNROLL) for a bf16 / fp32 weight, 4-bit
# g64, 4-bit g32.
SMOLLM2_TILES = {
    ("qkv", 960, 576, "norm"): ((4, 8, 1), (4, 8, 1), (4, 1, 9), (4, 1, 8)),
    ("o_proj", 576, 576, "none"): ((4, 8, 1), (4, 8, 1), (4, 1, 9), (4, 1, 8)),
    ("gate_up", 3072, 576, "norm"): ((8, 8, 1), (4, 8, 1), (4, 1, 9), (4, 1, 8)),
    ("down", 576, 1536, "silu"): ((4, 8, 1), (4, 8, 1), (4, 1, 8), (4, 1, 8)),
}


def test_the_rule_gives_smollm2_the_tiles_it_ran_with_and_the_pins_follow_the_rule(monkeypatch):
    """Until a GPU measures them (gpu_check's gemv_tiles), a class's pinned tiles are the
    rule's (`_analytic`), and for SmolLM2's products the rule gives the tiles of the H100
    run; every pinned entry of sm_80 and sm_90 that is not measured is the rule's, and a
    GPU older than every pinned file (sm_75) gets the rule too."""
    monkeypatch.setattr(tuning, "_measured", {})  # the files alone (not MINILLM_TUNED's)
    monkeypatch.setattr(tuning, "_fell_back", {})
    kinds = ((torch.empty(0), torch.bfloat16), (torch.empty(0), torch.float32),
             (dg.Int4Weight(None, None, None, 64), torch.bfloat16),
             (dg.Int4Weight(None, None, None, 32), torch.bfloat16))
    for (name, n, k, prologue), want in SMOLLM2_TILES.items():
        for (w, dtype), tiles in zip(kinds, want):
            int4 = isinstance(w, dg.Int4Weight)
            bucket = dg.bucket_of(n, k, w, dtype, prologue)
            tiles = (*tiles, 1)  # SPLIT: one chunk a step
            rule = dg._launch_tiles(n, k, int4, bucket, dg._analytic(bucket))
            assert rule == tiles, (name, w, dtype)
            assert dg.launch_tiles(n, k, w, dtype, prologue, 75) == tiles  # no file: the rule
            for arch in (80, 90):  # what a launch gets, where nothing measured it
                entry = tuning.pinned_table(arch)["decode_gemv"][tuning.bucket_key(bucket)]
                if not entry["source"].startswith("measured"):
                    assert dg.launch_tiles(n, k, w, dtype, prologue, arch) == tiles
    for arch in (80, 90):
        table = tuning.pinned_table(arch)["decode_gemv"]
        assert len(table) == len(dg.DECODE_GEMV.buckets())
        for key, entry in table.items():
            if not entry["source"].startswith("measured"):
                rule = dg._analytic(tuning.parse_bucket_key(key))
                assert tuning.config_from_dict(entry).__dict__ == rule.__dict__, key


def test_tiles_measured_in_the_process_are_what_a_launch_gets(monkeypatch):
    """`tuning.record_measured` (gpu_check's gemv_tiles keeps each product's fastest) changes
    what that class launches on that architecture, and only there."""
    monkeypatch.setattr(tuning, "_measured", {})
    monkeypatch.setattr(tuning, "_ready", {})
    monkeypatch.setattr(tuning, "_resolved", {})
    w = dg.Int4Weight(None, None, None, 64)
    bucket = dg.bucket_for(576, 1536, True, 64, dg.PROLOGUES["silu"], torch.bfloat16)
    cfg = triton.Config({"BLOCK_N": 2, "UNROLL": 24}, num_warps=2, num_stages=1)
    tuning.record_measured("decode_gemv", 90, bucket, cfg, 4.2)
    assert dg.launch_tiles(576, 1536, w, torch.bfloat16, "silu", 90) == (2, 2, 24, 1)
    assert dg.launch_tiles(576, 1536, w, torch.bfloat16, "silu", 80) == (4, 1, 8, 1)
    assert dg.launch_tiles(576, 1536, w, torch.float16, "silu", 90) == (2, 2, 24, 1)  # class
    assert dg.launch_tiles(576, 1536, w, torch.bfloat16, "norm", 90) == (4, 1, 8, 1)  # not
    with dg.tiles(unroll=4):  # a candidate's override still wins
        assert dg.launch_tiles(576, 1536, w, torch.bfloat16, "silu", 90) == (2, 2, 4, 1)
    split = dg._config(2, 4, 3, 8)  # a SPLIT tile measured: SPLIT comes with it
    tuning.record_measured("decode_gemv", 90, bucket, split, 3.9)
    assert dg.launch_tiles(576, 1536, w, torch.bfloat16, "silu", 90) == (2, 4, 3, 8)
    assert dg.launch_tiles(576, 1536, torch.empty(0), torch.bfloat16, "silu", 90)[3] == 1


def test_tiles_reject_what_the_kernel_cannot_run():
    for bad, words in (({"block_n": 3}, "power of two >= 2"), ({"block_n": 1}, "power of two"),
                       ({"warps": 3}, "warps must be 1, 2, 4 or 8"),
                       ({"unroll": 0}, "unroll must be an integer >= 1"),
                       ({"split": 3}, "split must be a power of two"),
                       ({"split": 0}, "split must be a power of two")):
        with pytest.raises(ValueError, match=words), dg.tiles(**bad):
            pass


def test_the_rope_epilogue_rejects_bad_shapes_clearly(gen):
    x, nw = randn(gen, 2, 64), randn(gen, 64)
    w = randn(gen, (9 + 2 * 3) * 16, 64)
    cos, sin = rope_tables(gen, 2, 16, torch.float32)
    cache = randn(gen, 5, 3, 16)

    def call(num_q=9, num_kv=3, dim=16, c=cos, kv=None, weight=w):
        return dg.norm_linear(x, None, nw, 1e-5, weight, dg.Rope(num_q, num_kv, dim, c, sin, kv))
    with pytest.raises(ValueError, match=r"cos must be \[2, 16\] float32"):
        call(c=cos[:1])
    with pytest.raises(ValueError, match=r"cos must be .* \(or heads' torch.float32"):
        call(c=cos.double())
    with pytest.raises(ValueError, match=r"N = \(num_q \+ 2 num_kv\) \* head_dim = .* = 160 "
                                         r"output columns, but the weight has N = 240"):
        call(num_q=4)
    with pytest.raises(ValueError, match="even head_dim"):
        call(num_q=1, num_kv=1, dim=15, weight=randn(gen, 45, 64), c=cos[:, :15])
    with pytest.raises(ValueError, match=r"k_cache must be \[num_slots, 3, 16\]"):
        call(kv=(cache[:, :2], cache, torch.zeros(2, dtype=torch.long, device=DEVICE)))
    with pytest.raises(ValueError, match=r"slot_mapping must be an integer \[2\]"):
        call(kv=(cache, cache, torch.zeros(2, device=DEVICE)))
    with pytest.raises(ValueError, match=r"slot_mapping must be an integer \[2\]"):
        call(kv=(cache, cache, torch.zeros(3, dtype=torch.long, device=DEVICE)))


# ------------------------------------------------------------------------ in the model


@pytest.fixture
def triton_glue(monkeypatch):
    monkeypatch.setattr(fused, "TRITON_ON_CPU", True)


def count_gemv_calls(monkeypatch):
    """The decode GEMV's calls by name: "norm_linear+rope" (with RoPE in q|k|v's epilogue)
    and "+kv" where it stores K/V too; the K/V stores of `glue.rope_kv` as "rope_kv+kv"."""
    calls = []
    for name in ("norm_linear", "silu_mul_linear", "linear"):
        real = getattr(dg, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            rope = args[5] if len(args) > 5 else kwargs.get("rope")
            calls.append(_name + ("" if rope is None else "+rope")
                         + ("+kv" if rope is not None and rope.kv is not None else ""))
            return _real(*args, **kwargs)
        monkeypatch.setattr(dg, name, counted)
    real_rope_kv = glue.rope_kv

    def rope_kv(heads, num_q, num_kv, cos, sin, kv=None):
        calls.append("rope_kv" + ("" if kv is None else "+kv"))
        return real_rope_kv(heads, num_q, num_kv, cos, sin, kv)
    monkeypatch.setattr(glue, "rope_kv", rope_kv)
    return calls


@pytest.mark.parametrize("quantized", [False, True])
def test_a_decode_step_through_the_gemv_gives_the_unfused_logits(triton_glue, monkeypatch,
                                                                 quantized):
    """A tiny model (float, then w4 g32) decodes through DecodeGraph's static step: with the
    GEMV all four products of each layer go through it (o_proj, with no glue before it,
    too), and the logits equal the unfused glue's."""
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=3).eval()
    if quantized:
        model = quantize_model(model, bits=4, group_size=32, method="rtn")
    model = model.to(DEVICE).set_attn_backend("triton")
    calls = count_gemv_calls(monkeypatch)
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(fused, "FUSED_GEMV", on)
        model.__dict__.pop("_decode_graphs", None)
        g = decode_graph.get(model, 1, 16)
        with torch.inference_mode():
            g.prefill(torch.tensor([[5, 6, 7]], device=DEVICE))  # 3 rows: the GEMV too
            calls.clear()
            logits[on] = g.decode(11, 3).clone()
        if on:
            assert fused.FUSED_GEMV, "the GEMV failed and switched itself off"
        # On CUDA the decode is a graph replay: no Python runs, so there is nothing to count
        # (the graph was captured, GEMV and all, when `get` built it).
        if on and not CUDA:
            num_layers = model.config.num_layers
            assert calls.count("norm_linear+rope+kv") == calls.count("norm_linear") == num_layers
            assert calls.count("silu_mul_linear") == calls.count("linear") == num_layers
        elif not CUDA:
            assert set(calls) == {"rope_kv+kv"}, "with FUSED_GEMV off the GEMV must not run"
    # On CUDA the GEMV's rsqrt and sum order and cuBLAS's differ, and two random layers (std
    # 0.2) amplify that to ~2e-4 (seen with the glue kernels on an H100)
    tol = 1e-3 if CUDA else 1e-4
    torch.testing.assert_close(logits[True], logits[False], rtol=tol, atol=tol)


@pytest.mark.skipif(CUDA, reason="builds its model on the CPU for Triton's interpreter "
                    "(TRITON_ON_CPU); with CUDA, Triton compiles and CPU tensors cannot be launched")
def test_a_gemv_that_fails_is_switched_off_with_a_warning(triton_glue, monkeypatch):
    """A kernel that does not compile on some stack must cost the step its fusion only: the
    unfused path's logits, a warning (one for q|k|v's RoPE epilogue, one for the GEMV), and
    the GEMV off for the rest of the process."""
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=6).eval()
    model.set_attn_backend("triton")
    monkeypatch.setattr(fused, "FUSED_GEMV", False)
    g = decode_graph.get(model, 1, 16)
    with torch.inference_mode():
        g.prefill(torch.tensor([[5, 6, 7]]))
        expected = g.decode(11, 3).clone()

    def broken(*args, **kwargs):
        raise RuntimeError("no such instruction on this GPU")
    monkeypatch.setattr(dg, "norm_linear", broken)
    monkeypatch.setattr(fused, "FUSED_GEMV", True)
    monkeypatch.setattr(fused, "FUSED_ROPE", True)  # (restored after the test: it fails too)
    model.__dict__.pop("_decode_graphs")
    g = decode_graph.get(model, 1, 16)
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="no such instruction"):
        g.prefill(torch.tensor([[5, 6, 7]]))
    assert fused.FUSED_GEMV is False
    with torch.inference_mode():
        torch.testing.assert_close(g.decode(11, 3), expected, rtol=0, atol=0)


@pytest.mark.skipif(CUDA, reason="builds its model on the CPU for Triton's interpreter "
                    "(TRITON_ON_CPU); with CUDA, Triton compiles and CPU tensors cannot be launched")
def test_a_rope_epilogue_that_fails_switches_off_only_itself(triton_glue, monkeypatch):
    """q|k|v's GEMV with RoPE in its epilogue failing leaves the plain GEMV on: RoPE and the
    K/V store run as their own kernel after it, with the bits of the epilogue switched off."""
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=6).eval()
    monkeypatch.setattr(fused, "FUSED_ROPE", False)
    g = decode_graph.get(model, 1, 16)
    with torch.inference_mode():
        g.prefill(torch.tensor([[5, 6, 7]]))
        expected = g.decode(11, 3).clone()
    real = dg.norm_linear

    def no_rope(*args, rope=None, **kwargs):
        if rope is not None:
            raise RuntimeError("no such split on this GPU")
        return real(*args, **kwargs)
    monkeypatch.setattr(dg, "norm_linear", no_rope)
    monkeypatch.setattr(fused, "FUSED_ROPE", True)
    model.__dict__.pop("_decode_graphs")
    g = decode_graph.get(model, 1, 16)
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="RoPE epilogue failed"):
        g.prefill(torch.tensor([[5, 6, 7]]))
    assert fused.FUSED_ROPE is False and fused.FUSED_GEMV is True
    with torch.inference_mode():
        assert torch.equal(g.decode(11, 3), expected)


def rope_on_and_off(monkeypatch, run):
    """run() with RoPE in q|k|v's GEMV, then without (`rope_kv` after it): {on: (result,
    the decode GEMV's and rope_kv's calls)}."""
    calls, out = count_gemv_calls(monkeypatch), {}
    for on in (True, False):
        monkeypatch.setattr(fused, "FUSED_ROPE", on)
        calls.clear()
        with torch.inference_mode():
            out[on] = run(), list(calls)
        assert fused.FUSED_ROPE == on and fused.FUSED_GEMV, "a kernel failed, switched off"
    return out


def static_cache_steps(model):
    """A 3-token prefill (the GEMV takes it: the epilogue rotates, the contiguous cache's
    context stores K/V) and two decode steps through a fresh DecodeGraph: (their logits,
    the cache); the calls of the decode steps alone are kept apart."""
    model.__dict__.pop("_decode_graphs", None)
    g = decode_graph.get(model, 1, 16)
    logits = [g.prefill(torch.tensor([[5, 6, 7]], device=DEVICE)).clone()]
    logits += [g.decode(11, 3).clone(), g.decode(12, 4).clone()]
    return torch.cat(logits), [t.clone() for t in g.cache.k + g.cache.v]


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "w4"])
def test_rope_in_the_qkv_gemv_gives_a_static_decode_step_the_same_bits(triton_glue,
                                                                       monkeypatch, quantized):
    """DecodeGraph's static step (batch 1; captured on CUDA), float and w4: with RoPE and
    the K/V store in q|k|v's GEMV, the logits and every cache row are those of `rope_kv`
    after the product, bit for bit, and rope_kv does not run."""
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=7).eval()
    if quantized:
        model = quantize_model(model, bits=4, group_size=32, method="rtn")
    model = model.to(DEVICE).set_attn_backend("triton")
    out = rope_on_and_off(monkeypatch, lambda: static_cache_steps(model))
    num_layers = model.config.num_layers
    (logits, cache), calls = out[True]
    if not CUDA:  # on CUDA the decode steps are replays: the calls were the capture's
        assert calls.count("norm_linear+rope") == num_layers  # the prefill: rotate only
        assert calls.count("norm_linear+rope+kv") == 2 * num_layers, calls
        assert not any(c.startswith("rope_kv") for c in calls), "rope_kv ran: no fusion"
        assert out[False][1].count("rope_kv+kv") == 2 * num_layers
    assert torch.equal(logits, out[False][0][0])
    for got, want in zip(cache, out[False][0][1]):
        assert torch.equal(got, want), "the cache differs"


def test_rope_in_the_qkv_gemv_gives_the_paged_engine_the_same_bits(triton_glue, monkeypatch):
    """The serving engine's paged cache (w4 model): 3 sequences decode in a bucket of 4, the
    padded row's K/V going to the trash slot through the epilogue; every step's logits,
    the tokens and the whole cache equal those with `rope_kv` after the product."""
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=8).eval()
    model = quantize_model(model, bits=4, group_size=32, method="rtn").to(DEVICE)
    prompts = [[5, 6, 7, 8, 9], [40, 41], [7, 7, 7, 7, 7, 7, 7]]

    def serve():
        engine = LLMEngine(model, num_blocks=32, block_size=4, max_num_seqs=4,
                           enforce_eager=False)
        logits, compute_logits = [], model.compute_logits
        with monkeypatch.context() as mp:
            mp.setattr(model, "compute_logits",
                       lambda h: logits.append(compute_logits(h).clone()) or logits[-1])
            tokens = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        kv = engine.kv_cache
        cache = [t.clone() for i in range(model.config.num_layers) for t in kv.flat(i)]
        return tokens, logits, cache, kv.trash_slot

    out = rope_on_and_off(monkeypatch, serve)
    (tokens, logits, cache, trash), calls = out[True]
    assert calls.count("norm_linear+rope+kv") >= 4 * model.config.num_layers, calls
    assert tokens == out[False][0][0]
    assert len(logits) == len(out[False][0][1])
    assert all(torch.equal(a, b) for a, b in zip(logits, out[False][0][1])), "logits differ"
    assert all(torch.equal(a, b) for a, b in zip(cache, out[False][0][2])), "caches differ"
    assert cache[0][trash].abs().sum() > 0, "the padded row should store into the trash slot"


@pytest.mark.skipif(CUDA, reason="builds its model on the CPU for Triton's interpreter "
                    "(TRITON_ON_CPU); with CUDA, Triton compiles and CPU tensors cannot be launched")
def test_a_hooked_linear_is_not_bypassed(triton_glue, monkeypatch):
    """A forward hook on a Linear (a profiler range, a calibration) must still see its
    input: the fused path steps aside for that layer."""
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=4).eval()
    model.set_attn_backend("triton")
    seen = []
    model.layers[0].attn.qkv_proj.register_forward_pre_hook(lambda m, a: seen.append(1))
    calls = count_gemv_calls(monkeypatch)
    g = decode_graph.get(model, 1, 16)
    with torch.inference_mode():
        g.prefill(torch.tensor([[5, 6, 7]]))
        seen.clear()
        calls.clear()
        g.decode(11, 3)
    assert seen == [1]
    num_layers = model.config.num_layers
    assert calls.count("norm_linear+rope+kv") == num_layers - 1  # layer 0's q|k|v: unfused
    assert calls.count("norm_linear") == num_layers and calls.count("rope_kv+kv") == 1

    # A forward set on the instance runs too, unless it only labels the call for a
    # profile (`measure.step_profile.hook_linears`: the GEMV runs inside its range).
    from minillm.measure import step_profile

    for h in list(model.layers[0].attn.qkv_proj._forward_pre_hooks):
        del model.layers[0].attn.qkv_proj._forward_pre_hooks[h]
    proj = model.layers[1].attn.qkv_proj
    proj.forward = lambda x, f=proj.forward: (seen.append(2), f(x))[1]
    seen.clear()
    calls.clear()
    with torch.inference_mode():
        g.decode(12, 4)
    assert seen == [2] and calls.count("norm_linear+rope+kv") == num_layers - 1
    del proj.forward
    handles = step_profile.hook_linears(model)
    try:
        calls.clear()
        with torch.inference_mode():
            g.decode(13, 5)
    finally:
        for h in handles:
            h.remove()
    assert calls.count("norm_linear+rope+kv") == num_layers  # labels only: every layer fused
    assert calls.count("linear") == num_layers  # o_proj's too
    assert not any("forward" in vars(m) for m in model.modules())

    # o_proj with a hook runs its own forward; the other layers' o_proj stay in the GEMV
    o_proj = model.layers[1].attn.o_proj
    hook = o_proj.register_forward_hook(lambda m, a, out: seen.append(3))
    seen.clear()
    calls.clear()
    with torch.inference_mode():
        g.decode(14, 6)
    hook.remove()
    assert seen == [3] and calls.count("linear") == num_layers - 1


def test_prefill_rows_a_subclass_and_training_take_the_unfused_path(triton_glue, monkeypatch):
    """More than MAX_ROWS rows (a prefill), a Linear subclass with its own forward (a
    tensor-parallel shard), or weights being trained never go through the GEMV."""
    from minillm.layers import Linear

    class Counting(Linear):
        def forward(self, x):
            return super().forward(x)

    x = torch.randn(1, dg.MAX_ROWS + 1, 64)
    lin = Linear(64, 32).requires_grad_(False)
    assert fused.gemv_weight(lin, x) is None
    assert fused.gemv_weight(lin, x[:, :dg.MAX_ROWS]) is lin.weight
    sub = Counting(64, 32)
    assert fused.gemv_weight(sub, x[:, :1]) is None
    trained = Linear(64, 32)  # requires grad: the kernel has no backward
    assert fused.gemv_weight(trained, x[:, :1]) is None
    with torch.no_grad():
        assert fused.gemv_weight(trained, x[:, :1]) is trained.weight
    norm_w = torch.ones(64, requires_grad=True)  # a norm being trained: the same
    assert fused.gemv_weight(lin, x[:, :1], norm_w) is None
    monkeypatch.setattr(fused, "FUSED_GEMV", False)
    assert fused.gemv_weight(lin, x[:, :1]) is None


@pytest.mark.skipif(CUDA, reason="compiles for sm_90 ahead of time: with a GPU the other "
                    "tests compile and run the kernels for real")
def test_kernel_compiles_for_cuda_sm90_without_a_gpu():
    """Every variant (prologue x weight kind, and q|k|v's with RoPE and the K/V store in its
    epilogue) builds for H100 (sm_90) in bf16 and fp32, with the tiles pinned on sm_90 for
    SmolLM2: no TF32 (every product is an FMA: no tl.dot), no register spills (cuobjdump's
    resource usage of the sm_90 cubin), 16-byte loads, and no barrier in a block that loads
    (a layout conversion through shared memory in the loop; the epilogue's split of the
    RoPE pairs comes after the loop)."""
    code = """
        import re
        import subprocess
        import tempfile
        from pathlib import Path
        import torch
        torch.cuda.is_available = lambda: True  # define the kernels as compiled
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from minillm.kernels import decode_gemv as dg

        fn = dg._decode_gemv_kernel
        BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # Triton's own tools
        # SmolLM2's products (prologue, with delta, N, K, RoPE): q|k|v after layer 0's norm
        # and after the open residual add, gate|up, down, o_proj; with the tiles _launch
        # picks. RoPE: None, or q|k|v's epilogue (K/V store, the tables' dtype: "dt" for the
        # model's, which rounds x * cos)
        products = ((1, False, 960, 576, None), (1, True, 960, 576, None),
                    (1, True, 3072, 576, None), (2, False, 576, 1536, None),
                    (0, False, 576, 576, None), (1, True, 960, 576, (False, "*fp32")),
                    (1, True, 960, 576, (True, "*fp32")), (1, False, 960, 576, (True, "dt")))
        for dt in ("*bf16", "*fp32"):
            for prologue, delta, n, k_in, rope in products:
                for int4, zeros, group in ((False, False, 0), (True, True, 64),
                                           (True, False, 32)):
                    block_k = group if int4 else dg._dense_block_k(k_in)
                    dtype = torch.float32 if dt == "*fp32" else torch.bfloat16
                    bucket = dg.bucket_for(n, k_in, int4, block_k, prologue, dtype)
                    block_n, warps, unroll, split = dg._launch_tiles(
                        n, k_in, int4, bucket, dg.DECODE_GEMV.pinned(bucket, 90))
                    w, s = ("*i32", "*fp32") if int4 else (dt, dt)
                    store, table = rope or (False, "*fp32")
                    table = dt if table == "dt" else table
                    types = dict(X=dt, Delta=dt, NormW=dt, Sum=dt, W=w, Scales=s, Zeros=s,
                                 Y=dt, eps="fp32", Cos=table, Sin=table, KC=dt, VC=dt,
                                 Slots="*i64")
                    consts = dict(PROLOGUE=prologue, HAS_DELTA=delta, INT4=int4,
                                  HAS_ZEROS=zeros, BLOCK_N=block_n, BLOCK_K=block_k,
                                  UNROLL=unroll, SPLIT=split,
                                  NORM_BLOCK=dg._dense_block_k(k_in), ROPE=rope is not None,
                                  WRITE_KV=store, ROUND_PRODUCT=table != "*fp32")
                    consts["stride_wk"] = 1  # what a launch specializes a unit stride to
                    sig = {n: "constexpr" if n in consts else types.get(n, "i32")
                           for n in fn.arg_names}
                    aligned = [n for n in fn.arg_names if types.get(n, "").startswith("*")
                               or n in ("stride_xm", "stride_dm", "stride_sm", "stride_wn",
                                        "stride_ym", "K", "N", "half", "stride_cr",
                                        "stride_sr", "stride_ks", "stride_kh", "stride_vs",
                                        "stride_vh")]  # SmolLM2: all 16k
                    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                             for n in aligned}
                    k = triton.compile(ASTSource(fn, sig, consts, attrs),
                                       target=GPUTarget("cuda", 90, 32),
                                       options=dict(num_warps=warps))
                    ptx = k.asm["ptx"]
                    what = (f"{dt} prologue {prologue} N {n} K {k_in} int4 {int4} g{group} "
                            f"RoPE {rope} tables {table}")
                    assert ".tf32" not in ptx, what
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(k.asm["cubin"])
                        f.flush()
                        usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name],
                                               capture_output=True, text=True).stdout
                    # a spill shows as stack (STACK:4224 at a 64 x 1024 tile, 4 warps)
                    assert "REG:" in usage and "STACK:0" in usage and "LOCAL:0" in usage, \
                        f"{what}: spilled: {usage}"
                    # the loops: no layout conversion through shared memory next to the loads
                    blocks = re.split(r"\\n\\$L__BB\\d+_\\d+:", ptx)
                    assert not any("ld.global" in b and "bar.sync" in b for b in blocks), what
                    # 16-byte loads wherever a chunk has >= 8 bf16 a thread, or (int4) at
                    # least a word a thread. The tile measured fastest for SmolLM2's down
                    # in 4 bits (H200: 2 rows, 1 warp) has half a word a thread, and is
                    # not held to it.
                    fills = not int4 or block_n * block_k // 8 >= 32 * warps
                    if dt == "*bf16" and (not int4 or block_k == 64) and fills:
                        assert "ld.global.v4" in ptx, f"{what}: no 16-byte loads"
        print("compiled")
    """
    assert_compiles(code, timeout=600)


@pytest.mark.skipif(CUDA, reason="compiles for sm_90 ahead of time: with a GPU, gpu_check's "
                    "gemv_tiles compiles and runs every candidate for real")
def test_every_4bit_candidate_compiles_for_sm90_without_spills_or_barriers_in_its_loop():
    """gemv_tiles' 4-bit candidates (`INT4_TILES`, SPLIT chunks side by side included) at
    SmolLM2's down (SiLU·up, K 1536) and q|k|v (add + norm, RoPE and the K/V store), g64
    bf16, build for sm_90 with no register spill and no barrier in a block that loads: each
    thread holds whole words, so no chunk converts layouts through shared memory."""
    code = """
        import re
        import subprocess
        import tempfile
        from pathlib import Path
        import torch
        torch.cuda.is_available = lambda: True
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from minillm.kernels import decode_gemv as dg

        fn = dg._decode_gemv_kernel
        BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        dt = "*bf16"
        types = dict(X=dt, Delta=dt, NormW=dt, Sum=dt, W="*i32", Scales="*fp32",
                     Zeros="*fp32", Y=dt, eps="fp32", Cos="*fp32", Sin="*fp32", KC=dt, VC=dt,
                     Slots="*i64")
        products = ((2, False, 576, 1536, False), (1, True, 960, 576, True))
        for prologue, delta, n, k_in, rope in products:
            for block_n, warps, unroll, split in dg.INT4_TILES:
                consts = dict(PROLOGUE=prologue, HAS_DELTA=delta, INT4=True, HAS_ZEROS=True,
                              BLOCK_N=block_n, BLOCK_K=64, UNROLL=unroll, SPLIT=split,
                              NORM_BLOCK=dg._dense_block_k(k_in), ROPE=rope, WRITE_KV=rope,
                              ROUND_PRODUCT=False, stride_wk=1)
                sig = {a: "constexpr" if a in consts else types.get(a, "i32")
                       for a in fn.arg_names}
                aligned = [a for a in fn.arg_names if types.get(a, "").startswith("*")
                           or a in ("stride_xm", "stride_dm", "stride_sm", "stride_wn",
                                    "stride_ym", "K", "N", "half", "stride_cr", "stride_sr",
                                    "stride_ks", "stride_kh", "stride_vs", "stride_vh")]
                attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
                k = triton.compile(ASTSource(fn, sig, consts, attrs),
                                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
                what = f"prologue {prologue} N {n} K {k_in} tiles {(block_n, warps, unroll, split)}"
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name],
                                           capture_output=True, text=True).stdout
                assert "STACK:0" in usage and "LOCAL:0" in usage, f"{what}: spilled: {usage}"
                blocks = re.split(r"\\n\\$L__BB\\d+_\\d+:", k.asm["ptx"])
                assert not any("ld.global" in b and "bar.sync" in b for b in blocks), what
        print("compiled")
    """
    assert_compiles(code, timeout=900)
