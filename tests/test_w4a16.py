"""The Triton W4A16 matmul against dequantize-then-matmul, on fresh random weights.

Oracle: ``packing.dequantize_packed`` (the reference every quantized kernel is tested
against), then ``x @ Wᵀ`` in float64. Weights are ``torch.randn`` matrices quantized by
``rtn`` (symmetric and asymmetric) and packed by ``packing.pack``, so both the nibble order
and the zero points are exercised; inputs are never zeros.

On a machine without CUDA the kernel runs in Triton's interpreter in fp32 (``minillm.kernels``
switches the interpreter on by itself); with CUDA the same tests run the compiled kernel in
fp16 and bf16 (those tolerances are untested so far). Shapes are odd on purpose (N, M not
multiples of a tile, M > 16, K not a multiple of the K step) and small: the file takes a
few seconds on 2 CPU cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the W4A16 kernel is written in Triton")

import minillm.kernels.w4a16 as wk  # noqa: E402
from minillm.kernels import w4a16_linear  # noqa: E402
from minillm.quant.packing import dequantize_packed, pack  # noqa: E402
from minillm.quant.weights import rtn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]
# (rtol, atol) against the float64 product of the same (dtype-rounded) weight. fp32 on the
# interpreter: sums of <= 576 products in a different order than float64, outputs |y| < ~80;
# measured max error ~3e-5, while a wrong nibble, group or zero point is off by > 1e-1.
# fp16 / bf16: the output is rounded to the dtype (half an ulp: 5e-4 / 4e-3 relative).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 1e-2),
              torch.bfloat16: (1.6e-2, 5e-2)}


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's own id: fresh inputs per test, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def packed_weight(g, n, k, group_size, sym):
    """(qweight, scales, zeros) of a random [n, k] weight, on DEVICE."""
    qweight, scales, zeros = pack(rtn(torch.randn(n, k, generator=g), bits=4,
                                      group_size=group_size, sym=sym))
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def reference(x, qweight, scales, zeros):
    w = dequantize_packed(qweight, scales, zeros, bits=4, dtype=x.dtype)  # as the kernel rounds it
    return x.double() @ w.double().T


def assert_close(actual, expected, dtype, what=""):
    rtol, atol = TOLERANCES[dtype]
    assert actual.dtype == dtype, f"{what}: output dtype {actual.dtype}, expected x's {dtype}"
    assert not actual.isnan().any(), f"{what}: NaN in output (an unmasked load or unwritten row)"
    err = (actual.double() - expected).abs()
    bad = err > atol + rtol * expected.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max abs "
                           f"error {err.max().item():.3g}; first bad index "
                           f"{tuple(bad.nonzero()[0].tolist())}")


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m,n,k,group_size", [
    (1, 37, 96, 32),     # decode: one row in a 16-row tile, N odd
    (3, 100, 192, 64),   # several K steps per group on the interpreter (step 32)
    (17, 64, 128, 128),  # M > 16: two row tiles, the second holding one row
    (5, 48, 576, 64),    # SmolLM2's hidden size
    (2, 20, 576, 576),   # per-channel: one group per row (g is not a power of two)
    (4, 33, 96, 24),     # no power of two >= 16 divides g: the general path, K % step != 0
])
def test_matches_dequantize_then_matmul(gen, m, n, k, group_size, sym, dtype):
    qweight, scales, zeros = packed_weight(gen, n, k, group_size, sym)
    x = randn(gen, m, k, dtype=dtype)
    got = w4a16_linear(x, qweight, scales, zeros, group_size)
    assert got.shape == (m, n)
    assert_close(got, reference(x, qweight, scales, zeros), dtype,
                 f"M={m} N={n} K={k} g={group_size} {'sym' if sym else 'asym'}")


def test_paths_are_the_intended_ones():
    """The shapes above cover both paths: one group per K step, and a group index per column."""
    assert wk._block_k(32, 128) == (32, True)
    assert wk._block_k(256, 128) == (128, True)
    assert wk._block_k(576, 128) == (64, True)  # 576 = 9 * 64
    assert wk._block_k(576, wk.CPU_MAX_BLOCK_K) == (32, True)
    assert wk._block_k(24, 128) == (wk._GENERAL_BLOCK_K, False)
    assert 96 % wk._GENERAL_BLOCK_K != 0  # so the (4, 33, 96, 24) case masks K


def test_batched_3d_input(gen):
    qweight, scales, zeros = packed_weight(gen, 40, 128, 64, sym=False)
    x = randn(gen, 2, 3, 128, dtype=DTYPES[0])
    got = w4a16_linear(x, qweight, scales, zeros, 64)
    assert got.shape == (2, 3, 40)
    assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], "x [2, 3, K]")


def test_strided_inputs(gen):
    """Non-contiguous x and a weight cut from a wider packed matrix (strides, not copies)."""
    qweight, scales, zeros = packed_weight(gen, 24, 256, 32, sym=True)
    qweight, scales, zeros = qweight[:, :64], scales[:, :4], zeros[:, :4]  # K = 128 of 256
    x = randn(gen, 128, 6, dtype=DTYPES[0]).T  # [6, 128], column stride 6
    assert not x.is_contiguous() and not qweight.is_contiguous()
    got = w4a16_linear(x, qweight, scales, zeros, 32)
    assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], "strided")


@pytest.mark.parametrize("m,n,k,group_size", [(1, 37, 96, 32), (4, 33, 96, 24)])
def test_nothing_past_the_edges_is_read(gen, m, n, k, group_size):
    """x, scales and zeros are views into NaN-filled buffers: a load past K or past the last
    group (a missing mask) would bring a NaN into the output."""
    qweight, scales, zeros = packed_weight(gen, n, k, group_size, sym=False)

    def in_nan_buffer(t):
        big = torch.full((t.shape[0] + 3, t.shape[1] + 40), float("nan"), dtype=t.dtype,
                         device=t.device)
        big[: t.shape[0], : t.shape[1]] = t
        return big[: t.shape[0], : t.shape[1]]

    x = randn(gen, m, k, dtype=DTYPES[0])
    got = w4a16_linear(in_nan_buffer(x), qweight, in_nan_buffer(scales), in_nan_buffer(zeros),
                       group_size)
    assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], "NaN past the edges")


def test_no_rows_gives_an_empty_output(gen):
    qweight, scales, zeros = packed_weight(gen, 8, 64, 32, sym=True)
    got = w4a16_linear(randn(gen, 0, 64, dtype=DTYPES[0]), qweight, scales, zeros, 32)
    assert got.shape == (0, 8)


@pytest.mark.skipif(DEVICE != "cpu", reason="fp16 on the interpreter; the CUDA run covers fp16")
def test_fp16_on_interpreter(gen):
    qweight, scales, zeros = packed_weight(gen, 37, 96, 32, sym=False)
    x = randn(gen, 3, 96, dtype=torch.float16)
    got = w4a16_linear(x, qweight, scales, zeros, 32)
    assert_close(got, reference(x, qweight, scales, zeros), torch.float16, "fp16")


# ----------------------------------------------------------------------------- bad inputs


def test_rejects_bad_arguments(gen):
    qweight, scales, zeros = packed_weight(gen, 8, 64, 32, sym=False)
    x = randn(gen, 2, 64, dtype=DTYPES[0])
    with pytest.raises(ValueError, match=r"qweight must be a torch.Tensor, got ndarray"):
        w4a16_linear(x, qweight.cpu().numpy(), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"x must be a float tensor"):
        w4a16_linear(x.long(), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"dtype torch.float64 is not supported"):
        w4a16_linear(x.double(), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"qweight must be a 2-d torch.uint8 tensor \[N, K / 2\]"):
        w4a16_linear(x, qweight.to(torch.int32), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"qweight \(8, 32\) holds 64 columns but x has K = 62"):
        w4a16_linear(x[:, :62], qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"K = x.shape\[-1\] = 63 must be even"):
        w4a16_linear(x[:, :63], qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"group_size 24 does not divide K = 64"):
        w4a16_linear(x, qweight, scales, zeros, 24)
    with pytest.raises(ValueError, match=r"group_size must be a positive integer, got 0"):
        w4a16_linear(x, qweight, scales, zeros, 0)
    with pytest.raises(ValueError, match=r"scales must be torch.float32 \[N, K / group_size\] "
                                         r"= \[8, 4\]"):
        w4a16_linear(x, qweight, scales, zeros, 16)  # scales hold 2 groups, not 4
    with pytest.raises(ValueError, match=r"zeros must be torch.float32 .* got torch.float16"):
        w4a16_linear(x, qweight, scales, zeros.half(), 32)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"interpreter cannot compute in torch.bfloat16"):
            w4a16_linear(x.bfloat16(), qweight, scales, zeros, 32)
    else:
        with pytest.raises(ValueError, match=r"scales is on cpu but x is on cuda"):
            w4a16_linear(x, qweight, scales.cpu(), zeros, 32)


# ----------------------------------------------------------------------------- the CUDA path


def test_autotune_keys_and_pruning():
    # triton's Autotuner silently ignores a key that is not an argument name.
    assert set(wk._w4a16_tuned.keys) <= set(wk._w4a16_kernel.arg_names)
    for m, block_ms in ((1, {16}), (16, {16}), (17, {32, 64}), (64, {32, 64}), (65, {64, 128})):
        kept = wk._prune_configs(wk._cuda_configs(), {"m_bucket": wk._m_bucket(m)})
        assert kept and {c.kwargs["BLOCK_M"] for c in kept} == block_ms, m


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the real autotuned path runs in every test")
def test_cuda_dispatch_path_runs_on_the_interpreter(gen, monkeypatch):
    """The autotuned launch (grid lambda, keys, meta-parameters) with one config, so nothing
    is timed; BLOCK_K then follows the CUDA rule (up to 128)."""
    import triton

    one = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=2)]
    tuned = triton.autotune(configs=one, key=wk._w4a16_tuned.keys)(wk._w4a16_kernel)
    monkeypatch.setattr(wk, "_w4a16_tuned", tuned)
    monkeypatch.setattr(wk, "interpreter_enabled", lambda: False)  # take the CUDA branch
    qweight, scales, zeros = packed_weight(gen, 37, 256, 128, sym=False)
    x = randn(gen, 3, 256)
    assert_close(w4a16_linear(x, qweight, scales, zeros, 128),
                 reference(x, qweight, scales, zeros), torch.float32, "autotuned branch")
    assert tuned.best_config is not None


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the kernel is compiled by every test")
def test_kernel_compiles_for_cuda_sm90_without_a_gpu():
    """The interpreter accepts things the compiler rejects; compile for H100 (sm_90) anyway,
    with triton.compile + ASTSource (pinned triton 3.7.1) and the bundled ptxas: both paths,
    decode and prefill tiles, fp16 / bf16 / fp32 activations."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    code = textwrap.dedent("""
        import torch
        torch.cuda.is_available = lambda: True  # define the kernel as compiled, not interpreted
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import minillm.kernels.w4a16 as wk

        fn = wk._w4a16_kernel
        cases = [("fp16", 16, 64, 128, True, True, 4, 3), ("bf16", 16, 32, 64, False, False, 2, 2),
                 ("fp32", 16, 64, 32, True, True, 4, 2), ("bf16", 128, 128, 64, True, True, 8, 4)]
        for dt, bm, bn, bk, aligned, even_k, warps, stages in cases:
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_ALIGNED=aligned, EVEN_K=even_k)
            types = dict(X="*" + dt, QW="*u8", Scales="*fp32", Zeros="*fp32", Out="*" + dt)
            sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps, num_stages=stages))
            assert "mma" in k.asm["ptx"], f"no tensor-core MMA for {dt}"
        print("compiled")
    """)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
