"""W4A16: a matmul whose weight is stored in 4 bits and dequantized on the fly, in Triton.

``w4a16_linear(x, qweight, scales, zeros, group_size)`` computes ``y = x @ Ŵᵀ`` for
activations x ``[..., K]`` in 16 bits (fp16 / bf16; fp32 is accepted too) and a weight Ŵ
``[N, K]`` that only exists in the packed 4-bit format of ``minillm.quant.packing``.

Why: a decode step multiplies one token (or a handful) by every weight matrix, so it does
~2 flops per weight byte read and is memory-bound on any GPU: its time is the bytes it
reads. 4-bit weights are a quarter of bf16's bytes (plus a scale, and a zero for an
asymmetric weight, per group), so the product can be up to ~3.5x faster; unpacking costs
ALU work the GPU has to spare, if it is cheap. Prefill (many rows) is compute-bound.

Layout (``packing.py``; W ``[N = out_features, K = in_features]``, groups of g columns,
G = K / g): ``qweight`` uint8 ``[N, K / 2]``, column 2j in the low nibble of byte j and
2j + 1 in the high one; ``scales``, ``zeros`` fp32 ``[N, G]``; ``Ŵ[n, k] = (u[n, k] −
zeros[n, k // g]) · scales[n, k // g]``. A symmetric 4-bit weight has every zero equal to 8:
pass ``zeros=None`` and the kernel reads no zeros at all.

The kernels (``w4a16_kernel.py``) read the packed bytes as 32-bit words and make floats of
the nibbles without a conversion instruction. Three shapes of work, one kernel: the GEMV
at M = 1 (decode), small M (2-16: a speculative verify, a small batch) and a tiled
``tl.dot`` GEMM above; split-K spreads a short, wide product over the GPU's SMs.

**Large M.** From ``DEQUANT_MIN_M`` rows (prefills, large batches: compute-bound) the
weight is dequantized once into a buffer of x's dtype by ``_dequantize_kernel`` and
multiplied by ``torch.matmul`` (cuBLAS). The GPU check times both at M = 256 and 1024: on
the H100, every run since the dequantize kernel found it faster than the tiled GEMM at 256
rows (4096 x 4096, bf16: 95 against 126 µs, 46 against 159, 39 against 55) and at 1024.

Invariants:

* ``BLOCK_K`` is the largest power of two up to 64 that divides g (at least 16), so no K
  step or GEMV chunk straddles two groups (``w4a16_kernel.py``); K is a multiple of it. A
  layout the kernel does not take (g not a multiple of 16, a qweight whose rows are not
  whole int32 words) is computed by the plain path ``F.linear(x, dequantize_packed(...))``:
  correct, slow, and never chosen for the layouts ``quantize_model`` makes (g 32 … 576).
* The counters are one int32 buffer per device (``COUNTER_SLOTS``), allocated by the first
  call (outside a graph capture when the caller warms up first, as the decode graphs and
  the engine do). Split-K launches on one device must not overlap in time (one stream at
  a time: the engine and CUDA graphs run their kernels in order). A shape with more tiles
  than slots runs with one split.
* The host wrapper checks shapes and dtypes only: no value of a CUDA tensor is read, so
  nothing synchronizes and a CUDA graph can capture the call.

Tiles (``tuning.py``): "w4a16_gemv" (M = 1), "w4a16_small_m" (M ≤ 16) and "w4a16_gemm"
(M > 16) pin BLOCK_N / SPLIT_K (and BLOCK_M, K_THREADS) / warps / stages per bucket: the M
class, BLOCK_K (from g), a class of N and of K (GEMV, small M), and the dtype width. Where
nothing is measured the GEMV's pins are chosen from the shapes (``analytic``). SPLIT_K is
a run-time argument, so the split counts of one tile shape share one compiled program.
On the interpreter: one fixed config per tunable with two splits (so the CPU tests always
cross the split-K reduction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from . import tuning
from ._checks import check_packed_linear
from ._grid import cdiv
from .interpreter import interpreter_enabled
from .w4a16_kernel import _dequantize_kernel, _w4a16_kernel

__all__ = ["w4a16_linear"]

MAX_BLOCK_K = 64          # the largest K step (a power of two dividing the group size)
MIN_BLOCK_K = 16          # groups with no power-of-two divisor this large take the plain path
FP32_TILED_BLOCK_K = 16   # fp32 x on a GPU, M > 1: the FMA dot holds both K-wide operands in
                          # registers (at 64 the GEMM spills 8.6 KB a thread on sm_90; at 16
                          # no pinned fp32 tile spills: cuobjdump --dump-resource-usage)
GEMV_MAX_M = 16           # up to here "w4a16_gemv" (M = 1) / "w4a16_small_m"; then "w4a16_gemm"
DEQUANT_MIN_M = 256       # from here: dequantize once, then torch.matmul (measured: Large M)
COUNTER_SLOTS = 1 << 16   # split-K tile counters per device (256 KiB)
FP32_2P23 = 0x4B000000    # the bits of 2.0 ** 23 in fp32 (the GEMV's `magic` argument)
SYM_ZERO = 8.0            # the zero point of every group of a symmetric 4-bit weight


# ----------------------------------------------------------------------------- tiles

_UNIT_STRIDES = ("stride_xk", "stride_sg", "stride_zg", "stride_on")  # see tuning.Tunable
_SIGNATURE = {"X": "*{dt}", "QW": "*i32", "Scales": "*fp32", "Zeros": "*fp32", "Out": "*{dt}",
              "Partials": "*fp32", "Counters": "*i32"}

def _gemv_config(bn, warps, k_threads, split, **extra):
    return triton.Config({**extra, "BLOCK_N": bn, "SPLIT_K": split, "K_THREADS": k_threads},
                         num_warps=warps, num_stages=1)


# The GEMV's tiles (BLOCK_N, warps, K_THREADS): a warp covers 32 / K_THREADS rows with
# K_THREADS threads each (16 * K_THREADS contiguous bytes of a row per step), a thread one
# 16-byte chunk of R = BLOCK_N * K_THREADS / (32 * warps) rows per step (its x is shared
# by those rows: 4.4 instructions per weight at R = 4, 5.3 at R = 2, 6.7 at R = 1 in the
# sm_90 SASS, benchmarks/w4a16_sass.py). x's step tile must have fewer elements than the
# program has threads (16 * K_THREADS int32 pairs < 32 * warps), or Triton loads it in a
# layout of its own and converts it through shared memory every step.
_GEMV_TILES = ((64, 2, 1), (128, 2, 1), (64, 4, 2), (128, 4, 2), (256, 4, 2), (128, 8, 4),
               (64, 8, 8), (128, 8, 8))
_SPLITS = (1, 2, 4, 8, 16)


def _gemv_analytic(b: dict) -> triton.Config:
    """The GEMV's tiles for a bucket, chosen from its shapes (nothing measured near)."""
    bn, warps, k_threads, split = {
        # (N class, K class): a short row (576) wants many small programs, a long one
        # (4096) 128 contiguous bytes a row per step; ~2 programs per SM, <= ~4 steps each
        (0, 0): (64, 4, 2, 4), (0, 1): (64, 4, 2, 8),    # 576 x 576: 36 programs
        (1, 0): (64, 4, 2, 4), (1, 1): (64, 8, 8, 4),    # 3072 x 576: 192; 4096^2: 256
        (2, 0): (256, 4, 2, 2), (2, 1): (64, 8, 8, 4),   # 49152 x 576: 384; 14336 x 4096
    }[b["N"], b["K"]]
    if b["dt"] == 32 and k_threads >= warps:  # fp32 x: twice the x tile (see _GEMV_TILES)
        bn, k_threads = 128, 4
    return _gemv_config(bn, warps, k_threads, split)


# M = 1 (decode). Buckets: bk (BLOCK_K, from the group size), classes of N (0: <= 1024,
# 1: <= 8192, 2: more) and of K (0: <= 1024, 1: more), the dtype width. SPLIT_K is a
# run-time argument: 40 candidates, 8 compiled programs.
W4A16_GEMV = tuning.register(tuning.Tunable(
    name="w4a16_gemv", fn=_w4a16_kernel,
    configs=tuple(_gemv_config(*tile, sk) for tile in _GEMV_TILES for sk in _SPLITS),
    default=_gemv_config(128, 4, 2, 8),
    interpreter=_gemv_config(64, 4, 2, 2),
    bucket_space={"M": (1,), "bk": (16, 32, 64), "N": (0, 1, 2), "K": (0, 1), "dt": (16, 32)},
    signature=_SIGNATURE,
    unit_strides=_UNIT_STRIDES,
    constexprs=lambda b: {"BLOCK_M": 1, "BLOCK_K": b["bk"], "HAS_ZEROS": True,
                          "ROW_ALIGN": 4, "K_THREADS": 1},
    analytic=_gemv_analytic,
))

# 2 <= M <= 16 (a speculative verify, a small batch): M classes 4 (2..4 rows) and 16.
# Candidates: tl.dot with 16-row tiles (the old list: 5 compiled programs), and the GEMV
# once per row (BLOCK_M 1: x rows in the grid, the weight re-read from L2), which may win
# for the smallest M.
_SMALL_M_DOT = tuple(triton.Config({"BLOCK_N": bn, "SPLIT_K": sk}, num_warps=w, num_stages=2)
                     for bn, w in ((32, 4), (64, 4), (128, 4), (128, 8), (256, 8))
                     for sk in _SPLITS)
W4A16_SMALL_M = tuning.register(tuning.Tunable(
    name="w4a16_small_m", fn=_w4a16_kernel,
    configs=_SMALL_M_DOT + tuple(_gemv_config(*tile, sk, BLOCK_M=1)
                                 for tile in ((128, 4, 2), (256, 4, 2)) for sk in (4, 8, 16)),
    default=triton.Config({"BLOCK_N": 64, "SPLIT_K": 8}, num_warps=4, num_stages=2),
    interpreter=triton.Config({"BLOCK_N": 64, "SPLIT_K": 2}, num_warps=4, num_stages=1),
    bucket_space={"M": (4, 16), "bk": (16, 32, 64), "N": (0, 1, 2), "K": (0, 1),
                  "dt": (16, 32)},
    signature=_SIGNATURE,
    unit_strides=_UNIT_STRIDES,
    constexprs=lambda b: {"BLOCK_M": 16, "BLOCK_K": b["bk"], "HAS_ZEROS": True,
                          "ROW_ALIGN": 4, "K_THREADS": 1},
    # measured on an H100 before the GEMV's redesign: BLOCK_N 64, SPLIT_K 8 at 4096 x 4096
    analytic=lambda b: triton.Config({"BLOCK_N": 64, "SPLIT_K": 8 if b["K"] else 4},
                                     num_warps=4, num_stages=2),
))

# 16 < M < DEQUANT_MIN_M (prefill chunks, large batches): tiled, BLOCK_M from the config.
_GEMM_DEFAULT = triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 1}, num_warps=4,
                              num_stages=3)
W4A16_GEMM = tuning.register(tuning.Tunable(
    name="w4a16_gemm", fn=_w4a16_kernel,
    configs=tuple(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": sk}, num_warps=w,
                                num_stages=st)
                  for bm, bn, sk, w, st in (
                      (32, 64, 1, 4, 3), (32, 128, 1, 4, 3), (32, 64, 4, 4, 3),
                      (64, 64, 1, 4, 3), (64, 128, 1, 4, 3), (64, 128, 1, 8, 3),
                      (64, 64, 2, 4, 3), (64, 128, 2, 4, 4), (64, 64, 4, 4, 4),
                      (128, 64, 1, 4, 3), (128, 128, 1, 8, 3), (128, 128, 2, 8, 3),
                      (128, 128, 1, 8, 4), (128, 64, 2, 4, 4))),
    default=_GEMM_DEFAULT,
    interpreter=triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "SPLIT_K": 1}, num_warps=4,
                              num_stages=1),
    # fp32: the largest candidate tile that spills nothing at BLOCK_K 16 (229 registers on
    # sm_90; the default's 64 x 128 spills 456 B a thread).
    analytic=lambda b: (triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, "SPLIT_K": 1},
                                      num_warps=4, num_stages=3) if b["dt"] == 32
                        else _GEMM_DEFAULT),
    bucket_space={"M": (64, 256, 1024), "bk": (16, 32, 64), "dt": (16, 32)},
    signature=_SIGNATURE,
    unit_strides=_UNIT_STRIDES,
    constexprs=lambda b: {"BLOCK_K": b["bk"], "HAS_ZEROS": True, "ROW_ALIGN": 4,
                          "K_THREADS": 1},
))

DEQUANT_BLOCK_N = 32  # the dequantize kernel's fixed tile: BLOCK_N rows x BLOCK_K columns


def _n_class(n: int) -> int:
    return 0 if n <= 1024 else (1 if n <= 8192 else 2)


def _k_class(k: int) -> int:
    return 0 if k <= 1024 else 1


def _gemm_m_class(m: int) -> int:
    return 64 if m <= 64 else (256 if m <= 256 else 1024)


def bucket_for(m: int, n: int, k: int, block_k: int, dtype: torch.dtype):
    """(Tunable, bucket) of a product with M rows (M < DEQUANT_MIN_M), N x K weight."""
    dt = tuning.dtype_bits(dtype)
    if m == 1:
        return W4A16_GEMV, {"M": 1, "bk": block_k, "N": _n_class(n), "K": _k_class(k), "dt": dt}
    if m <= GEMV_MAX_M:
        return W4A16_SMALL_M, {"M": 4 if m <= 4 else 16, "bk": block_k, "N": _n_class(n),
                               "K": _k_class(k), "dt": dt}
    return W4A16_GEMM, {"M": _gemm_m_class(m), "bk": block_k, "dt": dt}


# ----------------------------------------------------------------------------- host side

_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters: zero between launches (the kernel resets them)."""
    c = _counters.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Made here, their zeroing would be a node of the graph, not run now: an eager
            # split-K launch before the first replay would read garbage counts.
            raise RuntimeError("the W4A16 split-K counters of a device are made at its first "
                               "launch, and this one is inside a CUDA-graph capture; run the "
                               "model once on the device before capturing")
        c = _counters[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return c


def _block_k(group_size: int) -> int | None:
    """The largest power of two <= MAX_BLOCK_K that divides the group size, or None when
    it is below MIN_BLOCK_K (the kernel then does not take the layout)."""
    bk = MAX_BLOCK_K
    while bk >= MIN_BLOCK_K:
        if group_size % bk == 0:
            return bk
        bk //= 2
    return None


def _as_words(qweight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(qweight read as int32 words [N, K / 8], row alignment in words: 4 = 16 bytes), or
    None when its rows are not whole, aligned words (the plain path takes those)."""
    if (qweight.shape[1] % 4 or qweight.stride(1) != 1 or qweight.stride(0) % 4
            or qweight.storage_offset() % 4):
        return None
    words = qweight.view(torch.int32)
    row = words.stride(0)
    return words, (4 if row % 4 == 0 else (2 if row % 2 == 0 else 1))


def _check_args(x, qweight, scales, zeros, group_size) -> tuple[int, int, int]:
    """(N, K, G) after checking every argument (`_checks.check_packed_linear`); zeros may be
    None (a symmetric weight)."""
    return check_packed_linear(x, qweight, scales, zeros, group_size, 4, zeros_optional=True)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group_size: int, *,
                 dequantize_first: bool | None = None) -> torch.Tensor:
    """``x @ Ŵᵀ`` with Ŵ ``[N, K]`` given in the packed 4-bit layout (see the module docstring).

    x ``[..., K]`` fp16 / bf16 / fp32 (CUDA; fp16 / fp32 on the interpreter); qweight uint8
    ``[N, K / 2]``; scales fp32 ``[N, K / group_size]``; zeros fp32 like scales, or None for
    a symmetric 4-bit weight (every zero point 8); ``group_size`` divides K. Returns
    ``[..., N]`` in x's dtype. Any strides are accepted. ``dequantize_first``: None takes
    the dequantize-then-``torch.matmul`` path from ``DEQUANT_MIN_M`` rows; True / False
    forces it or the kernel (the GPU check times both).
    """
    n, k, _ = _check_args(x, qweight, scales, zeros, group_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    words, block_k = _as_words(qweight), _block_k(group_size)
    if words is None or block_k is None:  # a layout the kernel does not take
        return _plain(x2, qweight, scales, zeros).reshape(*lead, n)
    qw32, row_align = words
    if dequantize_first is None:
        dequantize_first = m >= DEQUANT_MIN_M
    if dequantize_first:
        w = _dequantize(qw32, row_align, scales, zeros, group_size, block_k, n, k, x.dtype)
        return torch.matmul(x2, w.T, out=out).reshape(*lead, n)  # compute-bound: cuBLAS
    block_k = _tiled_block_k(block_k, m, x.dtype)
    tunable, bucket = bucket_for(m, n, k, block_k, x.dtype)
    block_m = 1 if m == 1 else 16
    tunable.run(bucket, lambda cfg: _launch(x2, qw32, row_align, scales, zeros, out,
                                            group_size, block_k, block_m, cfg), x.device)
    return out.reshape(*lead, n)


def bucket_of_call(x: torch.Tensor, qweight: torch.Tensor, group_size: int, *,
                   dequantize_first: bool | None = None):
    """(Tunable, bucket) a ``w4a16_linear`` call on the kernel path uses (None if it takes
    the plain path): the GPU check reports the pinned config of each row. With
    ``dequantize_first`` as the call's (False: the kernel at any M), the bucket of the kernel
    it launches; None: of a call under DEQUANT_MIN_M rows (the kernel path's largest M)."""
    block_k = _block_k(group_size)
    if _as_words(qweight) is None or block_k is None:
        return None
    m = x.numel() // x.shape[-1]
    if dequantize_first is None:
        m = min(m, DEQUANT_MIN_M - 1)
    return bucket_for(m, qweight.shape[0], x.shape[-1], _tiled_block_k(block_k, m, x.dtype),
                      x.dtype)


def _tiled_block_k(block_k: int, m: int, dtype: torch.dtype) -> int:
    """The K step of a kernel launch: FP32_TILED_BLOCK_K for fp32 x on a GPU in the tiled
    paths (M > 1; it divides every group the kernel takes, as block_k >= 16 does), else
    `block_k`. The interpreter has no registers to spill and keeps the wide step tested."""
    if m > 1 and dtype == torch.float32 and not interpreter_enabled():
        return FP32_TILED_BLOCK_K
    return block_k


def _launch(x2, qw32, row_align, scales, zeros, out, group_size, block_k, block_m, cfg):
    """One launch of ``_w4a16_kernel`` with ``cfg`` (BLOCK_N, SPLIT_K, BLOCK_M for the GEMM
    tunable, warps, stages). Rewrites all of ``out``: it may run several times (autotuning)."""
    opts = tuning.launch_options(cfg)
    block_m, split = opts.pop("BLOCK_M", block_m), opts.pop("SPLIT_K")
    if block_m == 1 and x2.element_size() == 2 and (
            x2.stride(1) != 1 or x2.stride(0) % 2 or x2.storage_offset() % 2):
        x2 = x2.clone(memory_format=torch.contiguous_format)  # the GEMV reads 16-bit pairs
    m, k = x2.shape
    n = qw32.shape[0]
    n_tiles, m_tiles = cdiv(n, opts["BLOCK_N"]), cdiv(m, block_m)
    if n_tiles * m_tiles > COUNTER_SLOTS:
        split = 1
    k_per_split = cdiv(k // block_k, split) * block_k
    # The same pointer types whatever the split (one compiled program for every SPLIT_K,
    # and no atomic on a 16-bit pointer, which sm_80 lacks): the int32 counters always,
    # and with one split, which writes `out` directly, an fp32 view of them as partials.
    counters = _tile_counters(x2.device)
    if split > 1:
        partials = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
        p_strides = partials.stride()[:2]
    else:
        partials, p_strides = counters.view(torch.float32), (0, 0)  # never touched
    z, z_strides = (scales, (0, 0)) if zeros is None else (zeros, zeros.stride())
    _w4a16_kernel[(n_tiles, m_tiles, split)](
        x2, qw32, scales, z, out, partials, counters, m, n, k, group_size, k_per_split, split,
        *x2.stride(), qw32.stride(0), *scales.stride(), *z_strides, *out.stride(), *p_strides,
        FP32_2P23,
        BLOCK_M=block_m, BLOCK_K=block_k, HAS_ZEROS=zeros is not None, ROW_ALIGN=row_align,
        **opts)


def _dequantize(qw32, row_align, scales, zeros, group_size, block_k, n, k, dtype):
    """Ŵ ``[N, K]`` in ``dtype`` by ``_dequantize_kernel`` (bit for bit ``dequantize_packed``)."""
    w = torch.empty((n, k), dtype=dtype, device=qw32.device)
    z, z_strides = (scales, (0, 0)) if zeros is None else (zeros, zeros.stride())
    _dequantize_kernel[(cdiv(n, DEQUANT_BLOCK_N), k // block_k)](
        qw32, scales, z, w, n, group_size, qw32.stride(0), *scales.stride(), *z_strides,
        w.stride(0), BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=block_k, HAS_ZEROS=zeros is not None,
        ROW_ALIGN=row_align, num_warps=4)
    return w


def _plain(x2, qweight, scales, zeros):
    """The plain path for layouts the kernel does not take: dequantize, then F.linear."""
    from ..quant.packing import dequantize_packed

    z = torch.full_like(scales, SYM_ZERO) if zeros is None else zeros
    return F.linear(x2, dequantize_packed(qweight, scales, z, 4, x2.dtype))
