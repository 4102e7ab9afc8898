"""The decode GEMV (`minillm.kernels.decode_gemv`) against the unfused path it replaces.

Oracle: the plain glue of `minillm.layers.fused` (`rms_norm_ref`, `silu_mul_ref`, `x + delta`)
rounded to the dtype where it rounds, then the product in float64 with W as given (a float
W, or Ŵ = `dequantize_packed` in fp32: exact). The kernel reads the same rounded input and
sums in fp32, so the products agree to the fp32 sum's error, and to the output's rounding
in fp16 / bf16; a wrong column, group, zero point or norm is off by far more. The residual
sum s must equal `x + delta` bit for bit. On a CPU the kernel runs in Triton's interpreter
(fp32, fp16); with CUDA the same tests run compiled, in bf16 too. At model level, a tiny
model's decode steps through it give the unfused path's logits.
"""
from __future__ import annotations

import zlib

import pytest
import torch
from compile_utils import assert_compiles

import minillm.kernels  # noqa: F401  (chooses the interpreter before triton is imported)
from minillm import LlamaModel, ModelConfig, decode_graph
from minillm.kernels import decode_gemv as dg
from minillm.layers import fused
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


# ------------------------------------------------------------------------ in the model


@pytest.fixture
def triton_glue(monkeypatch):
    monkeypatch.setattr(fused, "TRITON_ON_CPU", True)


def count_gemv_calls(monkeypatch):
    calls = []
    for name in ("norm_linear", "silu_mul_linear"):
        real = getattr(dg, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(dg, name, counted)
    return calls


@pytest.mark.parametrize("quantized", [False, True])
def test_a_decode_step_through_the_gemv_gives_the_unfused_logits(triton_glue, monkeypatch,
                                                                 quantized):
    """A tiny model (float, then w4 g32) decodes through DecodeGraph's static step: with the
    GEMV three of its four products per layer go through it, and the logits equal the
    unfused glue's."""
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
            assert calls.count("norm_linear") == 2 * model.config.num_layers
            assert calls.count("silu_mul_linear") == model.config.num_layers
            assert fused.FUSED_GEMV, "the GEMV failed and switched itself off"
        else:
            assert not calls, "with FUSED_GEMV off the GEMV must not run"
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)


def test_a_gemv_that_fails_is_switched_off_with_a_warning(triton_glue, monkeypatch):
    """A kernel that does not compile on some stack must cost the step its fusion only: the
    unfused path's logits, one warning, and the GEMV off for the rest of the process."""
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
    model.__dict__.pop("_decode_graphs")
    g = decode_graph.get(model, 1, 16)
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="no such instruction"):
        g.prefill(torch.tensor([[5, 6, 7]]))
    assert fused.FUSED_GEMV is False
    with torch.inference_mode():
        torch.testing.assert_close(g.decode(11, 3), expected, rtol=0, atol=0)


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
    assert calls.count("norm_linear") == 2 * model.config.num_layers - 1


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


def test_kernel_compiles_for_cuda_sm90_without_a_gpu():
    """Every variant (prologue x weight kind) builds for H100 (sm_90) in bf16 and fp32, with the
    tiles `_tiles` picks for SmolLM2: no TF32 (every product is an FMA: no tl.dot), no
    register spills (cuobjdump's resource usage of the sm_90 cubin), 16-byte loads, and no barrier in a block that loads (a layout
    conversion through shared memory in the loop)."""
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
        # SmolLM2's products (prologue, with delta, N, K): q|k|v after layer 0's norm and
        # after the open residual add, gate|up, down, o_proj; with the tiles _launch picks
        products = ((1, False, 960, 576), (1, True, 960, 576), (1, True, 3072, 576),
                    (2, False, 576, 1536), (0, False, 576, 576))
        for dt in ("*bf16", "*fp32"):
            for prologue, delta, n, k_in in products:
                for int4, zeros, group in ((False, False, 0), (True, True, 64),
                                           (True, False, 32)):
                    block_k = group if int4 else dg._dense_block_k(k_in)
                    block_n, warps = dg._tiles(n, block_k, int4)
                    w, s = ("*i32", "*fp32") if int4 else (dt, dt)
                    types = dict(X=dt, Delta=dt, NormW=dt, Sum=dt, W=w, Scales=s, Zeros=s,
                                 Y=dt, eps="fp32")
                    consts = dict(PROLOGUE=prologue, HAS_DELTA=delta, INT4=int4,
                                  HAS_ZEROS=zeros, BLOCK_N=block_n, BLOCK_K=block_k,
                                  UNROLL=dg._int4_unroll(k_in, block_k) if int4 else 1,
                                  NORM_BLOCK=dg._dense_block_k(k_in))
                    consts["stride_wk"] = 1  # what a launch specializes a unit stride to
                    sig = {n: "constexpr" if n in consts else types.get(n, "i32")
                           for n in fn.arg_names}
                    aligned = [n for n in fn.arg_names if types.get(n, "").startswith("*")
                               or n in ("stride_xm", "stride_dm", "stride_sm", "stride_wn",
                                        "stride_ym", "K", "N")]  # SmolLM2: all 16k
                    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                             for n in aligned}
                    k = triton.compile(ASTSource(fn, sig, consts, attrs),
                                       target=GPUTarget("cuda", 90, 32),
                                       options=dict(num_warps=warps))
                    ptx = k.asm["ptx"]
                    what = f"{dt} prologue {prologue} N {n} K {k_in} int4 {int4} g{group}"
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
                    if dt == "*bf16" and (not int4 or block_k == 64):  # >= 8 bf16 a thread
                        assert "ld.global.v4" in ptx, f"{what}: no 16-byte loads"
        print("compiled")
    """
    assert_compiles(code, timeout=600)
