"""The fused glue (minillm.layers.fused) == its plain PyTorch reference, row by row.

RMSNorm, residual add + RMSNorm, RoPE in place and SiLU·up each run as one C++ pass on the
CPU. They must agree with the plain expressions to fp32 rounding, give a row the same bits
whatever else is in the call (batch invariance: the engine's tokens equal `generate`'s),
leave what they do not own alone (v's heads), and fall back to the reference wherever the
C++ does not apply. At model level: the fused model's logits match the unfused model's, its
greedy tokens are the same, and the serving engine with the fused glue gives the tokens of
the engine without it. These tests do not skip when the kernel fails to build: on this
project's machines it must build.
"""
import pytest
import torch

import minillm
from minillm.engine import LLMEngine, SamplingParams
from minillm.layers import fused
from minillm.model import apply_rope, rope_cos_sin

TOL = dict(rtol=2e-6, atol=2e-6)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    k = fused.load_kernel()
    assert k is not None, "the fused glue kernel did not build (see the warning above)"
    return k


@pytest.fixture
def unfused(monkeypatch):
    """Switch the C++ glue off: the model runs the plain PyTorch expressions."""
    monkeypatch.setattr(fused, "load_kernel", lambda: None)


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("hidden", [576, 40])  # 40: a tail past the 8-float vectors
def test_norms_match_reference(rows, hidden):
    x, d, w = rand(rows, hidden, seed=1), rand(rows, hidden, seed=2), rand(hidden, seed=3)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5), **TOL)
    s, h = fused.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d), "the residual add must be exact"
    torch.testing.assert_close(h, fused.rms_norm_ref(x + d, w, 1e-5), **TOL)


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_silu_mul_matches_reference_over_the_whole_range(rows):
    gate_up = rand(rows, 3072, seed=4, scale=6.0)
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 200.0])
    out = fused.silu_mul(gate_up)
    assert out.shape == (rows, 1536) and torch.isfinite(out).all()
    torch.testing.assert_close(out, fused.silu_mul_ref(gate_up), rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 9, 130])
def test_rope_in_place_matches_apply_rope_and_leaves_v_alone(rows):
    cos, sin = rope_cos_sin(64, 2048, 1e5)
    pos = torch.randint(0, 2048, (1, rows), generator=torch.Generator().manual_seed(5))
    heads = rand(1, rows, 15, 64, seed=6)  # SmolLM2: 9 q + 3 k heads rotated, 3 v heads not
    expected = apply_rope(heads[:, :, :12], cos[pos], sin[pos])
    out = heads.clone()
    assert fused.rope_(out, 12, cos[pos], sin[pos]) is out  # in place
    torch.testing.assert_close(out[:, :, :12], expected, **TOL)
    assert torch.equal(out[:, :, 12:], heads[:, :, 12:])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_whatever_shares_the_call(threads):
    """Batch invariance: row 3 alone and among 64 rows, on 1 or 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, d, w = rand(64, 576, seed=7), rand(64, 576, seed=8), rand(576, seed=9)
        gate_up = rand(64, 3072, seed=10, scale=3.0)
        cos, sin = rope_cos_sin(64, 512, 1e5)
        heads = rand(64, 15, 64, seed=11)
        one, all_rows = fused.add_rms_norm(x[3:4], d[3:4], w, 1e-5), fused.add_rms_norm(x, d, w, 1e-5)
        assert torch.equal(one[1][0], all_rows[1][3])
        assert torch.equal(fused.rms_norm(x[3:4], w, 1e-5)[0], fused.rms_norm(x, w, 1e-5)[3])
        assert torch.equal(fused.silu_mul(gate_up[3:4])[0], fused.silu_mul(gate_up)[3])
        a, b = heads[3:4].clone()[None], heads.clone()[None]
        fused.rope_(a, 12, cos[3:4][None], sin[3:4][None])
        fused.rope_(b, 12, cos[:64][None], sin[:64][None])
        assert torch.equal(a[0, 0], b[0, 3])
        xb, db, wb = x.bfloat16(), d.bfloat16(), w.bfloat16()
        assert torch.equal(fused.add_rms_norm(xb[3:4], db[3:4], wb, 1e-5)[1][0],
                           fused.add_rms_norm(xb, db, wb, 1e-5)[1][3])
        assert torch.equal(fused.silu_mul(gate_up[3:4].bfloat16())[0],
                           fused.silu_mul(gate_up.bfloat16())[3])
    finally:
        torch.set_num_threads(before)


# bf16: the C++ computes in fp32 and rounds where the reference stores bf16, so the two agree
# to one bf16 step (2^-8 relative) where an fp32 intermediate lands on either side of a
# rounding boundary, and bit for bit nearly everywhere else.
BF16_TOL = dict(rtol=2 ** -7, atol=1e-6)


def assert_bf16_close(got, want):
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    same = (got == want).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of the values are bit-identical to the reference"


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("hidden", [576, 40])
def test_bf16_glue_matches_its_reference(rows, hidden):
    x, d = rand(rows, hidden, seed=21).bfloat16(), rand(rows, hidden, seed=22).bfloat16()
    w = rand(hidden, seed=23).bfloat16()
    assert fused.applies(x)
    assert_bf16_close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5))
    s, h = fused.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d), "the residual add must round as PyTorch's bf16 add does"
    assert_bf16_close(h, fused.rms_norm_ref(x + d, w, 1e-5))
    gate_up = rand(rows, 3072, seed=24, scale=6.0).bfloat16()
    assert_bf16_close(fused.silu_mul(gate_up), fused.silu_mul_ref(gate_up))
    cos, sin = rope_cos_sin(64, 2048, 1e5)
    pos = torch.randint(0, 2048, (1, rows), generator=torch.Generator().manual_seed(25))
    heads = rand(1, rows, 15, 64, seed=26).bfloat16()
    out = heads.clone()
    assert fused.rope_(out, 12, cos[pos], sin[pos]) is out
    assert_bf16_close(out[:, :, :12], apply_rope(heads[:, :, :12], cos[pos], sin[pos]))
    assert torch.equal(out[:, :, 12:], heads[:, :, 12:])


def test_bf16_rounds_to_nearest_even_and_keeps_nan_and_inf(kernel):
    """The narrowing on its edges: ties to even, NaN stays NaN, inf stays inf."""
    gate_up = torch.zeros(1, 32)
    gate_up[0, 16:] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("nan"), float("inf"),
                                    -float("inf"), 3e38, -1.5, 2 ** -130] + [1.0] * 8)
    gate_up[0, :16] = 30.0  # silu(30) rounds to 30 in bf16: out = 30 * up, rounded once
    got = kernel.silu_mul(gate_up.bfloat16())
    want = fused.silu_mul_ref(gate_up.bfloat16())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_falls_back_to_the_reference_where_the_kernel_does_not_apply():
    x, w = rand(4, 576, seed=12), rand(576, seed=13)
    # fp16, a bf16 input with fp32 weights, a non-contiguous input, and autograd: the plain
    # expressions, same contract.
    for xh, wh in ((x.half(), w.half()), (x.bfloat16(), w)):
        torch.testing.assert_close(fused.rms_norm(xh, wh, 1e-5),
                                   fused.rms_norm_ref(xh, wh, 1e-5), rtol=0, atol=0)
    xt = rand(576, 4, seed=14).t()
    assert not fused.applies(xt)
    torch.testing.assert_close(fused.rms_norm(xt, w, 1e-5), fused.rms_norm_ref(xt, w, 1e-5),
                               rtol=0, atol=0)
    xg = x.clone().requires_grad_()
    fused.rms_norm(xg, w, 1e-5).sum().backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0
    heads = rand(1, 2, 3, 24, seed=15)  # head_dim 24: not a multiple of 16
    cos, sin = rope_cos_sin(24, 8, 1e4)
    assert fused.rope_(heads, 2, cos[:2][None], sin[:2][None]) is None


def test_bad_arguments_get_clear_errors(kernel):
    x, w = rand(2, 64), rand(64)
    with pytest.raises(RuntimeError, match=r"x and delta must have one shape"):
        kernel.add_rms_norm(x, rand(2, 32), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \[64\]"):
        kernel.rms_norm(x, rand(32), 1e-5)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 on the CPU"):
        kernel.silu_mul(x.double())
    with pytest.raises(RuntimeError, match=r"tensors must share one dtype"):
        kernel.rms_norm(x.bfloat16(), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[2, 64\]"):
        kernel.rope_(rand(2, 3, 64), 2, rand(2, 32), rand(2, 32))
    with pytest.raises(RuntimeError, match=r"num_rotated must be in \[0, 3\]"):
        kernel.rope_(rand(2, 3, 64), 4, rand(2, 64), rand(2, 64))


# ---- the model and the engine, fused against unfused ----------------------------------
PROMPT = [1, 504, 3937, 314, 260, 3575, 282, 4649, 47, 2]


@pytest.mark.slow
def test_fused_model_matches_unfused_logits_and_greedy_tokens(smollm, monkeypatch):
    model, _ = smollm
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        logits = model(ids)
    tokens = minillm.generate(model, PROMPT, 24)
    monkeypatch.setattr(fused, "load_kernel", lambda: None)
    with torch.inference_mode():
        ref = model(ids)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert minillm.generate(model, PROMPT, 24) == tokens


@pytest.mark.slow
def test_fused_bf16_model_matches_unfused_logits_and_greedy_tokens(monkeypatch):
    """The bf16 model's eager glue goes through the C++ too; its logits stay within bf16
    noise of the plain ops' and its greedy tokens are the same."""
    model, _ = minillm.load_model(dtype=torch.bfloat16)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        logits = model(ids).float()
    tokens = minillm.generate(model, PROMPT, 16)
    monkeypatch.setattr(fused, "load_kernel", lambda: None)
    with torch.inference_mode():
        ref = model(ids).float()
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
    assert (logits[0, -1].argmax() == ref[0, -1].argmax()).item()
    assert minillm.generate(model, PROMPT, 16) == tokens


@pytest.mark.slow
def test_fused_engine_step_equals_the_unfused_one(smollm, monkeypatch):
    """The serving engine's batched steps (decodes and prefill chunks together) with the
    fused glue give every request the tokens of the same engine without it."""
    model, _ = smollm
    prompts = [PROMPT[:3 + 2 * i] + [100 + i] * (i % 4) for i in range(6)]

    def serve():
        engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=24)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=10 + i, ignore_eos=True))
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] = o.token_ids
        return [out[str(i)] for i in range(len(prompts))]

    fused_tokens = serve()
    monkeypatch.setattr(fused, "load_kernel", lambda: None)
    assert serve() == fused_tokens


@pytest.mark.parametrize("cpp", [True, False])
def test_the_open_residual_add_changes_no_bit(monkeypatch, cpp):
    """The model's loop leaves each layer's last residual add open and the next layer's norm
    adds it (`DecoderLayer.forward_open`): the same bits as running `layer(x)` one by one, with
    the C++ glue and without it."""
    from minillm import LlamaModel, ModelConfig
    from minillm.attention import NoCacheContext

    if not cpp:
        monkeypatch.setattr(fused, "load_kernel", lambda: None)
    model = LlamaModel(ModelConfig.tiny(num_layers=3)).init_random_weights(seed=4)
    model = model.eval().requires_grad_(False)  # so that the C++ applies to the weights
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    positions = torch.arange(9).expand(2, 9)
    ctx = NoCacheContext(model.attn_backend)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    x = model.embed_tokens(ids)
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, ctx, i)
    assert torch.equal(model._run_layers(ids, positions, ctx), x)
    assert torch.equal(model.hidden_states(ids), model.norm(x))
