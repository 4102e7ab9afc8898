"""The Triton W4A16 matmul against dequantize-then-matmul, on fresh random weights.

Oracle: ``packing.dequantize_packed`` (the reference every quantized kernel is tested
against) in fp32, then ``x @ Wᵀ`` in float64: the exact product of x as given and Ŵ. Weights are ``torch.randn`` matrices quantized by
``rtn`` (symmetric and asymmetric) and packed by ``packing.pack``, so the nibble order, the
int32 words the kernel reads and the zero points are all exercised; inputs are never zeros.

On a machine without CUDA the kernel runs in Triton's interpreter in fp32 (``minillm.kernels``
switches the interpreter on by itself); with CUDA the same tests run the compiled kernel in
fp16 and bf16, with the configs pinned for the GPU, and the CUDA-only tests at the end
capture it in a CUDA graph and run a quantized model through it. The interpreter is slow
(a few ms per program step), so the shapes cover the issue's grid - M in {1, 3, 16}, N in
{576, 1000, 3072}, K in {576, 1536, 4096}, groups of 32, 64 and 128 - as a covering subset,
not the full product: the file takes about a minute on 2 CPU cores.
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
from minillm.kernels import _checks, tuning, w4a16_linear  # noqa: E402
from minillm.quant.packing import dequantize_packed, pack  # noqa: E402
from minillm.quant.weights import rtn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEVICE == "cuda"
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]
# (rtol, atol) against the exact product (fp32 Ŵ, x as given, float64 sums). fp32 on the
# interpreter: sums of <= 4096 products in another order than float64, |y| < ~300;
# measured max error ~5e-5, while a wrong nibble, group or zero point is off by > 1e-1.
# fp16 / bf16: the kernel multiplies x by the exact u - z and sums in fp32, so its only
# real error is the output's rounding to the dtype (half an ulp: 5e-4 / 4e-3 relative).
# The reference must not round Ŵ to x's dtype first, as the plain path does: that alone
# is off by ~sqrt(K) * 2^-9 * |x||w| (0.07 at K = 4096 in bf16), more than the kernel,
# and on an H100 it failed 21 of 32 cases whose kernel output was exactly round(exact).
TOLERANCES = {torch.float32: (1e-4, 2e-4), torch.float16: (2e-3, 1e-2),
              torch.bfloat16: (1.6e-2, 1e-2)}


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


def reference(x, qweight, scales, zeros, weight_dtype=torch.float32):
    """x @ Ŵᵀ in float64. Ŵ in fp32 is exact ((u - z) * s, one rounding); the paths that
    dequantize first (large M, the plain path) round Ŵ to x's dtype and are compared with
    that: ``weight_dtype=x.dtype``."""
    w = dequantize_packed(qweight, scales, zeros, bits=4, dtype=weight_dtype)
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


def label(m, n, k, group_size, sym):
    return f"M={m} N={n} K={k} g={group_size} {'sym' if sym else 'asym'}"


# ----------------------------------------------------------------------------- correctness

# The grid, covered: every M with every N, K and group size at least once, both
# symmetric (zeros=None: no zeros read) and asymmetric weights, GEMV and tiled paths.
GRID = [
    (1, 576, 576, 32, False), (1, 1000, 1536, 64, True), (1, 3072, 576, 64, False),
    (1, 576, 4096, 128, False),
    (3, 1000, 576, 64, False), (3, 576, 1536, 32, True), (3, 1000, 4096, 128, True),
    (16, 576, 1536, 128, False), (16, 3072, 576, 32, True), (16, 1000, 576, 64, False),
]
# Edges: N odd and below a tile, M > 16 (the GEMM tunable) with a last tile of one row,
# per-channel (g = K = 576: BLOCK_K 64 in 9 steps of one group), the larger groups of the
# layout study (96 and 192: several 32- and 64-wide steps per group), g = 48 (BLOCK_K 16:
# the GEMV's 8-byte chunks) and K = 480, not a whole number of GEMV steps.
EDGES = [
    (1, 37, 96, 32, False), (17, 64, 128, 128, False), (2, 20, 576, 576, False),
    (5, 48, 576, 96, True), (1, 40, 1536, 192, True), (20, 24, 576, 192, False),
    (1, 50, 480, 48, False), (1, 20, 576, 576, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group_size,sym", GRID + EDGES,
                         ids=[label(*c) for c in GRID + EDGES])
def test_matches_dequantize_then_matmul(gen, m, n, k, group_size, sym, dtype):
    qweight, scales, zeros = packed_weight(gen, n, k, group_size, sym)
    x = randn(gen, m, k, dtype=dtype)
    got = w4a16_linear(x, qweight, scales, None if sym else zeros, group_size)
    assert got.shape == (m, n)
    assert_close(got, reference(x, qweight, scales, zeros), dtype, label(m, n, k, group_size, sym))


# Each path of the kernel with explicit configs: the plane-wise GEMV (BLOCK_M 1; K_THREADS
# threads per row, 1 to 8; once per x row when M > 1) and the tl.dot tiles (BLOCK_M 16 /
# 32), one split and several (the last split reduces; a split count above the number of K
# steps leaves some splits empty; 2 splits of 192 columns are not whole 128-column steps,
# nor is K = 384 a whole number of 256-column steps).
PATH_CONFIGS = [
    (1, 1, {"BLOCK_N": 64, "SPLIT_K": 1, "K_THREADS": 1}),
    (1, 1, {"BLOCK_N": 32, "SPLIT_K": 2, "K_THREADS": 4}),
    (1, 1, {"BLOCK_N": 64, "SPLIT_K": 3, "K_THREADS": 1}),
    (1, 1, {"BLOCK_N": 32, "SPLIT_K": 1, "K_THREADS": 8}),
    (1, 1, {"BLOCK_N": 64, "SPLIT_K": 16, "K_THREADS": 2}),
    (1, 3, {"BLOCK_N": 32, "SPLIT_K": 2, "K_THREADS": 2}),
    (16, 5, {"BLOCK_N": 32, "SPLIT_K": 1}), (16, 5, {"BLOCK_N": 64, "SPLIT_K": 4}),
    (16, 5, {"BLOCK_M": 32, "BLOCK_N": 32, "SPLIT_K": 2}),
]


@pytest.mark.parametrize("block_m,m,kwargs", PATH_CONFIGS,
                         ids=[f"BLOCK_M={bm} M={m} {kw}" for bm, m, kw in PATH_CONFIGS])
def test_every_path_and_split(gen, block_m, m, kwargs):
    import triton

    n, k, group_size = 100, 384, 64  # 6 K steps of 64
    qweight, scales, zeros = packed_weight(gen, n, k, group_size, sym=False)
    x = randn(gen, m, k, dtype=DTYPES[0])
    out = torch.empty(m, n, dtype=x.dtype, device=DEVICE)
    words, row_align = wk._as_words(qweight)
    cfg = triton.Config(kwargs, num_warps=4, num_stages=2)
    for _ in range(2):  # twice: the split-K counters are zero again after each launch
        out.fill_(float("nan"))
        wk._launch(x, words, row_align, scales, zeros, out, group_size,
                   wk._block_k(group_size), block_m, cfg)
        assert_close(out, reference(x, qweight, scales, zeros), DTYPES[0], f"{kwargs}")
    if kwargs["SPLIT_K"] > 1:
        assert int(wk._tile_counters(x.device).abs().sum()) == 0, "a tile counter was left set"


def test_every_split_launches_the_same_pointer_types(gen, monkeypatch):
    """One compiled program serves every SPLIT_K only if the pointer dtypes do not change
    with it: partials fp32 and counters int32 even for one split (a 16-bit dummy there
    would compile a second program, with a 16-bit atomic add that sm_80 does not have)."""
    import triton

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((args[5].dtype, args[6].dtype, args[12]))

    monkeypatch.setattr(wk, "_w4a16_kernel", Recorder())
    qweight, scales, zeros = packed_weight(gen, 32, 128, 64, sym=False)
    x = randn(gen, 1, 128, dtype=DTYPES[-1])
    words, row_align = wk._as_words(qweight)
    for split in (1, 3):
        wk._launch(x, words, row_align, scales, zeros, torch.empty(1, 32, dtype=x.dtype,
                                                                   device=DEVICE),
                   64, 64, 1, triton.Config({"BLOCK_N": 32, "SPLIT_K": split}, num_warps=4))
    assert seen == [(torch.float32, torch.int32, 1), (torch.float32, torch.int32, 3)]


def test_split_k_is_deterministic(gen):
    """The last split sums the partials in split order, whoever arrives last."""
    import triton

    qweight, scales, zeros = packed_weight(gen, 64, 1024, 64, sym=True)
    x = randn(gen, 1, 1024, dtype=DTYPES[0])
    words, row_align = wk._as_words(qweight)
    outs = []
    for _ in range(3):
        out = torch.empty(1, 64, dtype=x.dtype, device=DEVICE)
        wk._launch(x, words, row_align, scales, None, out, 64, 64, 1,
                   triton.Config({"BLOCK_N": 64, "SPLIT_K": 8}, num_warps=4, num_stages=2))
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_split_k_counters_are_not_made_inside_a_capture(monkeypatch):
    # Their zeroing would be captured, not run: eager launches would read garbage counts.
    monkeypatch.setattr(wk, "_counters", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run the model once on the device before capturing"):
        wk._tile_counters(torch.device("cuda", 0))
    assert wk._counters == {}
    assert wk._tile_counters(torch.device("cpu")).eq(0).all()  # the interpreter's: no capture


def test_symmetric_zeros_none_equals_explicit_eights(gen):
    qweight, scales, zeros = packed_weight(gen, 40, 256, 64, sym=True)
    assert bool((zeros == wk.SYM_ZERO).all())
    x = randn(gen, 1, 256, dtype=DTYPES[0])
    assert torch.equal(w4a16_linear(x, qweight, scales, None, 64),
                       w4a16_linear(x, qweight, scales, zeros, 64))


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_dequantize_kernel_is_bit_identical_to_the_reference(gen, sym):
    qweight, scales, zeros = packed_weight(gen, 70, 384, 128, sym)
    words, row_align = wk._as_words(qweight)
    for dtype in DTYPES:
        w = wk._dequantize(words, row_align, scales, None if sym else zeros, 128,
                           wk._block_k(128), 70, 384, dtype)
        assert torch.equal(w, dequantize_packed(qweight, scales, zeros, 4, dtype)), dtype


def test_large_m_dequantizes_then_multiplies(gen, monkeypatch):
    """From DEQUANT_MIN_M rows: one dequantize launch, then torch.matmul."""
    monkeypatch.setattr(wk, "DEQUANT_MIN_M", 8)
    called = []
    real = wk._dequantize
    monkeypatch.setattr(wk, "_dequantize", lambda *a: called.append(a) or real(*a))
    qweight, scales, zeros = packed_weight(gen, 48, 192, 64, sym=False)
    x = randn(gen, 9, 192, dtype=DTYPES[0])
    assert_close(w4a16_linear(x, qweight, scales, zeros, 64),
                 reference(x, qweight, scales, zeros, x.dtype), DTYPES[0], "dequantize + matmul")
    assert len(called) == 1


def test_layouts_the_kernel_does_not_take_use_the_plain_path(gen, monkeypatch):
    """g = 24 (no power of two >= 16 divides it) and a qweight whose rows do not start on
    whole int32 words: the plain path, still correct, and the kernel is not launched."""
    launched = []
    monkeypatch.setattr(wk, "_launch", lambda *a: launched.append(a))
    qweight, scales, zeros = packed_weight(gen, 33, 96, 24, sym=False)
    x = randn(gen, 4, 96, dtype=DTYPES[0])
    assert_close(w4a16_linear(x, qweight, scales, zeros, 24),
                 reference(x, qweight, scales, zeros, x.dtype), DTYPES[0], "g=24")
    qweight, scales, zeros = packed_weight(gen, 8, 64, 32, sym=True)
    shifted = torch.empty(8 * 32 + 1, dtype=torch.uint8, device=DEVICE)[1:].view(8, 32)
    shifted.copy_(qweight)  # storage offset 1: not a whole word
    assert wk._as_words(shifted) is None
    x = randn(gen, 1, 64, dtype=DTYPES[0])
    assert_close(w4a16_linear(x, shifted, scales, None, 32),
                 reference(x, qweight, scales, zeros, x.dtype), DTYPES[0], "unaligned qweight")
    assert not launched


def test_fp32_tiled_launches_take_a_narrow_k_step_on_a_gpu(gen, monkeypatch):
    # At BLOCK_K 64 the fp32 GEMM spills 8.6 KB a thread on sm_90 (its FMA dot holds both
    # K-wide operands in registers): on a GPU, fp32 with M > 1 steps 16 at a time, on a
    # tile pinned not to spill. The GEMV (M = 1) and 16-bit x keep the group's step.
    qweight, _, _ = packed_weight(gen, 64, 256, 64, sym=True)
    monkeypatch.setattr(wk, "interpreter_enabled", lambda: False)
    bk = {(m, dt): wk.bucket_of_call(torch.empty(m, 256, dtype=dt), qweight, 64)[1]["bk"]
          for m in (1, 8, 300) for dt in (torch.float32, torch.bfloat16)}
    assert bk == {(1, torch.float32): 64, (8, torch.float32): 16, (300, torch.float32): 16,
                  (1, torch.bfloat16): 64, (8, torch.bfloat16): 64, (300, torch.bfloat16): 64}
    for arch in tuning.PINNED_ARCHS:
        cfg = wk.W4A16_GEMM.pinned({"M": 256, "bk": 16, "dt": 32}, arch)
        assert (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps) == (32, 128, 4)
    monkeypatch.setattr(wk, "interpreter_enabled", lambda: True)  # keeps the wide step tested
    assert wk.bucket_of_call(torch.empty(8, 256), qweight, 64)[1]["bk"] == 64
    # the GPU check's rows that force the kernel past DEQUANT_MIN_M name its own bucket
    assert wk.bucket_of_call(torch.empty(1024, 256), qweight, 64,
                             dequantize_first=False)[1]["M"] == 1024
    assert wk.bucket_of_call(torch.empty(1024, 256), qweight, 64)[1]["M"] == 256


def test_block_k_and_buckets():
    assert [wk._block_k(g) for g in (32, 64, 96, 128, 192, 576, 48, 24)] == \
        [32, 64, 32, 64, 64, 64, 16, None]
    assert wk.bucket_for(1, 960, 576, 64, torch.bfloat16) == (
        wk.W4A16_GEMV, {"M": 1, "bk": 64, "N": 0, "K": 0, "dt": 16})
    assert wk.bucket_for(16, 14336, 4096, 32, torch.float32) == (
        wk.W4A16_SMALL_M, {"M": 16, "bk": 32, "N": 2, "K": 1, "dt": 32})
    assert wk.bucket_for(3, 4096, 4096, 64, torch.float16) == (
        wk.W4A16_SMALL_M, {"M": 4, "bk": 64, "N": 1, "K": 1, "dt": 16})
    assert wk.bucket_for(17, 4096, 4096, 64, torch.float16) == (
        wk.W4A16_GEMM, {"M": 64, "bk": 64, "dt": 16})
    assert wk.bucket_for(300, 4096, 4096, 16, torch.bfloat16)[1]["M"] == 1024
    # every bucket a call can produce lies in its tunable's space, and is pinned
    for m in (1, 2, 4, 5, 16, 17, 64, 65, 256, 257, wk.DEQUANT_MIN_M - 1):
        for n, k in ((576, 576), (3072, 1536), (49152, 4096)):
            for bk in (16, 32, 64):
                for dtype in (torch.float16, torch.float32):
                    t, bucket = wk.bucket_for(m, n, k, bk, dtype)
                    t.check_bucket(bucket)
                    for arch in tuning.PINNED_ARCHS:
                        assert tuning.bucket_key(bucket) in tuning.pinned_table(arch)[t.name]


def test_batched_3d_input(gen):
    qweight, scales, zeros = packed_weight(gen, 40, 128, 64, sym=False)
    x = randn(gen, 2, 3, 128, dtype=DTYPES[0])
    got = w4a16_linear(x, qweight, scales, zeros, 64)
    assert got.shape == (2, 3, 40)
    assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], "x [2, 3, K]")


def test_strided_inputs(gen):
    """Non-contiguous x and a weight cut from a wider packed matrix (strides, not copies):
    the rows are still whole words, read through the int32 view."""
    qweight, scales, zeros = packed_weight(gen, 24, 256, 32, sym=True)
    qweight, scales, zeros = qweight[:, :64], scales[:, :4], zeros[:, :4]  # K = 128 of 256
    assert wk._as_words(qweight) is not None
    for m in (1, 6):
        x = randn(gen, 128, m, dtype=DTYPES[0]).T  # [m, 128], column stride m
        assert not qweight.is_contiguous()
        got = w4a16_linear(x, qweight, scales, zeros, 32)
        assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], f"strided M={m}")


@pytest.mark.parametrize("m,n,k,group_size", [(1, 37, 96, 32), (4, 33, 96, 32)])
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


@pytest.mark.skipif(CUDA, reason="fp16 on the interpreter; the CUDA run covers fp16")
def test_fp16_on_interpreter(gen):
    qweight, scales, zeros = packed_weight(gen, 37, 96, 32, sym=False)
    for m in (1, 3):
        x = randn(gen, m, 96, dtype=torch.float16)
        got = w4a16_linear(x, qweight, scales, zeros, 32)
        assert_close(got, reference(x, qweight, scales, zeros), torch.float16, f"fp16 M={m}")


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
    with pytest.raises(ValueError, match=r"qweight \(8, 32\) holds 64 columns but x has K = 62 \(x.shape\[-1\]\)"):
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
    with pytest.raises(ValueError, match=r"scales must be .* = \[8, 2\], got torch.float32 "
                                         r"\(8, 1\)"):
        w4a16_linear(x, qweight, scales[:, :1], None, 32)  # a wrong scale shape
    with pytest.raises(ValueError, match=r"zeros must be torch.float32 .* got torch.float16"):
        w4a16_linear(x, qweight, scales, zeros.half(), 32)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"interpreter cannot compute in torch.bfloat16"):
            w4a16_linear(x.bfloat16(), qweight, scales, zeros, 32)
    else:
        with pytest.raises(ValueError, match=r"scales is on cpu but x is on cuda"):
            w4a16_linear(x, qweight, scales.cpu(), zeros, 32)


# ----------------------------------------------------------------------------- the CUDA path


@pytest.mark.skipif(CUDA, reason="on a GPU the pinned-config path runs in every test")
def test_cuda_dispatch_path_runs_on_the_interpreter(gen, monkeypatch):
    """The CUDA branch (bucket, pinned config for sm_90, launch closure) on CPU tensors:
    the interpreter runs each call with the config sm_90.json pins for its bucket."""
    monkeypatch.setattr(tuning, "interpreter_enabled", lambda: False)  # take the CUDA branch
    monkeypatch.setattr(_checks, "_check_device_dtype", lambda tensors: None)  # CPU tensors
    monkeypatch.setattr(tuning, "_ready", {})  # nothing resolved before, or kept after
    monkeypatch.setattr(tuning, "device_arch", lambda device=None: 90)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda name=None: False)
    used = []
    real = wk._launch
    monkeypatch.setattr(wk, "_launch", lambda *a: used.append(a[-1]) or real(*a))
    for m, n, k, g, sym in ((1, 96, 192, 64, False), (3, 40, 128, 32, True),
                            (20, 48, 192, 192, False)):
        qweight, scales, zeros = packed_weight(gen, n, k, g, sym)
        x = randn(gen, m, k)
        assert_close(w4a16_linear(x, qweight, scales, None if sym else zeros, g),
                     reference(x, qweight, scales, zeros), torch.float32, f"pinned M={m}")
        t, bucket = wk.bucket_for(m, n, k, wk._block_k(g), torch.float32)
        assert tuning.config_to_dict(used[-1]) == tuning.config_to_dict(t.pinned(bucket, 90))


@pytest.mark.skipif(CUDA, reason="on a GPU the kernel is compiled by every test")
def test_kernel_compiles_for_cuda_sm90_without_a_gpu():
    """The interpreter accepts things the compiler rejects; compile for H100 (sm_90), and the
    bf16 cases for A100 (sm_80), with Triton's bundled ptxas: the GEMV (BLOCK_M 1) with
    and without zeros, the tl.dot tiles, fp16 / bf16 / fp32 activations, and the
    dequantize kernel. With the specializations a real call gets (unit strides, 16-aligned
    pointers), the GEMV reads the packed weight and x with 16-byte loads (8-byte chunks for
    BLOCK_K 16) and its K loop has no barrier and no shared memory (no layout conversion)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    code = textwrap.dedent("""
        import re
        import torch
        torch.cuda.is_available = lambda: True  # define the kernel as compiled, not interpreted
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import minillm.kernels.w4a16 as wk

        def compile(fn, types, consts, warps, stages, arch=90):
            ones = {n: 1 for n in ("stride_xk", "stride_on", "stride_sg", "stride_zg")
                    if n in fn.arg_names}
            consts = {**consts, **ones}
            sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
            aligned = [n for n in fn.arg_names
                       if types.get(n, "").startswith("*") or n == "stride_xm"]
            attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            return triton.compile(ASTSource(fn, sig, consts, attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=warps, num_stages=stages))

        # (dtype, BLOCK_M, BLOCK_N, zeros, warps, stages, K_THREADS, BLOCK_K)
        for dt, bm, bn, zeros, warps, stages, kt, bk in [
                ("bf16", 1, 128, True, 4, 1, 2, 64), ("bf16", 1, 64, False, 2, 1, 1, 64),
                ("fp16", 1, 256, True, 4, 1, 2, 32), ("bf16", 1, 128, True, 8, 1, 4, 64),
                ("bf16", 1, 64, True, 8, 1, 8, 64), ("fp16", 1, 128, False, 8, 1, 8, 64),
                ("fp32", 1, 64, True, 4, 1, 2, 64), ("bf16", 1, 64, True, 4, 1, 2, 16),
                ("bf16", 16, 64, True, 4, 2, 1, 64), ("fp16", 64, 128, False, 4, 3, 1, 64)]:
            types = {n: t.format(dt=dt) for n, t in wk._SIGNATURE.items()}
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_ZEROS=zeros, ROW_ALIGN=4,
                          K_THREADS=kt)
            ptx = compile(wk._w4a16_kernel, types, consts, warps, stages).asm["ptx"]
            if dt == "bf16":  # A100 too: no instruction that only sm_90 has
                compile(wk._w4a16_kernel, types, consts, warps, stages, arch=80)
            what = f"GEMV {dt} BLOCK_N={bn} w{warps} K_THREADS={kt} BLOCK_K={bk}"
            if bm == 1:  # the K loop: the basic block(s) with the weight loads
                vec = "ld.global.v4.b32" if bk >= 32 else "ld.global.v2.b32"
                loop = [b for b in re.split(r"\\n\\$L__BB\\d+_\\d+:", ptx) if vec in b]
                assert loop, f"{what}: no {vec} loads"
                for bad in ("bar.sync", "ld.shared", "st.shared"):
                    assert not any(bad in b for b in loop), f"{what}: {bad} in the K loop"
            else:
                assert "mma" in ptx, f"no tensor-core MMA for {dt} BLOCK_M={bm}"
        compile(wk._dequantize_kernel, {"QW": "*i32", "Scales": "*fp32", "Zeros": "*fp32",
                                        "W": "*bf16"},
                dict(BLOCK_N=32, BLOCK_K=64, HAS_ZEROS=True, ROW_ALIGN=4), 4, 1)
        print("compiled")
    """)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: graph capture of the compiled kernel")
def test_kernel_inside_cuda_graph_capture(gen):
    """Captured once, replayed with new inputs: no host sync, no allocation that breaks the
    capture, and the split-K counters reset themselves on every replay."""
    results = []
    for m, sym in ((1, False), (1, True), (16, False)):
        qweight, scales, zeros = packed_weight(gen, 1000, 1536, 64, sym)
        z = None if sym else zeros
        x = randn(gen, m, 1536, dtype=torch.bfloat16)
        w4a16_linear(x, qweight, scales, z, 64)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w4a16_linear(x, qweight, scales, z, 64)
        for _ in range(3):
            x.copy_(randn(gen, m, 1536, dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert_close(y, reference(x, qweight, scales, zeros), torch.bfloat16,
                         f"graph replay M={m} {'sym' if sym else 'asym'}")
        results.append(int(wk._tile_counters(x.device).abs().sum()))
    assert results == [0, 0, 0], "a split-K tile counter was left set after a replay"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: a quantized model decoding on CUDA")
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_quantized_tiny_model_on_cuda_matches_the_reference(sym, monkeypatch):
    """quantize_model(...).to("cuda") runs every projection through w4a16_linear; its
    logits match the same quantized model on the CPU (the plain path), and greedy decoding
    through a CUDA graph gives eager's tokens."""
    import minillm
    from minillm import LlamaModel, ModelConfig
    from minillm.quant import quantize_model

    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()
    qmodel = quantize_model(model, "rtn", 4, 32, sym=sym, progress=False)
    ids = torch.tensor([[5, 9, 17, 33, 2, 64, 100, 7]])
    with torch.no_grad():
        ref = qmodel(ids).float()
        cuda_model = quantize_model(model, "rtn", 4, 32, sym=sym, progress=False).to("cuda")
        calls = []
        real = wk.w4a16_linear
        monkeypatch.setattr(wk, "w4a16_linear", lambda *a: calls.append(a[0].shape) or real(*a))
        got = cuda_model(ids.cuda()).float().cpu()
        monkeypatch.undo()
    assert len(calls) == 4 * model.config.num_layers, "not every projection took the kernel"
    err = (got - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item(), f"fp32 logits differ by {err:.3g}"
    # Triton attention: the graph replays eager's kernels, so the tokens must be equal
    bf16 = cuda_model.to(torch.bfloat16).set_attn_backend("triton")
    prompt = [5, 9, 17, 33]
    eager = minillm.generate(bf16, prompt, 12, ignore_eos=True, cuda_graph=False)
    assert minillm.generate(bf16, prompt, 12, ignore_eos=True, cuda_graph=True) == eager
