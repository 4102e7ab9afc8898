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

The kernel reads the same bytes as 32-bit words: ``qweight.view(torch.int32)`` is ``[N, K / 8]``
and, little-endian, bits 4i..4i+3 of word j are column 8j + i. One 16-byte load brings 32
weights of a row. A nibble becomes a float without an int-to-float conversion (a
quarter-rate instruction on GPUs): OR-ed with the bits of 2^23 and read as fp32, a value u
in the low mantissa bits is exactly ``2^23 + u``, and ``f − (2^23 + z)`` is exactly ``u − z``.

Three shapes of work (one kernel; ``BLOCK_M`` and the tunable decide):

* **GEMV, M = 1** (``BLOCK_M == 1``, decode; the "w4a16_gemv" tunable). Nothing is
  reordered: nibble *plane* i of a tile of words (``[rows, words]``, its columns 8j + i) is
  multiplied, elementwise, by the x of those columns, ``x[8j + i]``, and the eight planes'
  products are summed (``_plane``, ``_gemv_step``). Each plane is masked where it lies, at
  bit 4p, and OR-ed with the exponent of 2^(23 − 4p), which makes the nibble's lowest bit
  worth 1: ``f = 2^(23 − 4p) + u`` with no shift (p = i for planes 0-4; planes 5-7 come
  from the word shifted right by 12 once). Per weight: one LOP3, one FADD (``− (2^(23 −
  4p) + z)``, exact), one FFMA. x's columns are loaded contiguously (16-byte loads; fp16 /
  bf16 as int32 pairs, a bf16 being the top half of its fp32) and split into the eight
  planes in registers. A warp covers 32 / ``K_THREADS`` rows; a thread loads one 16-byte chunk (32
  columns, inside one group) of each of its rows per step, so x is shared by its rows,
  and a step reads ``K_THREADS`` chunks of a row side by side (64 contiguous bytes at 4).
  The accumulator is ``[BLOCK_N, K_THREADS]`` fp32 (a chunk's scale multiplies its sum),
  summed across the K threads once, after the loop. Each iteration issues the next step's
  loads (into registers: one step ahead), so a load has a whole iteration to arrive.
* **Small M, 2 ≤ M ≤ 16** ("w4a16_small_m"): the tl.dot tiles below with ``BLOCK_M`` 16,
  or the GEMV once per x row (a config with ``BLOCK_M`` 1: the weight then comes from L2
  for every row after the first); the measurement picks per class (M ≤ 4, M ≤ 16).
* **Tiled, M > 16** ("w4a16_gemm"; ``BLOCK_M >= 16``): seven ``tl.interleave`` put the
  eight nibble planes back in column order (``_unpack``), then ``u − z`` (small integers,
  exact in fp16 / bf16) goes through ``tl.dot`` against a ``[BLOCK_M, BLOCK_K]`` tile of
  x, and the fp32 product is scaled per group.

What the compiler makes of the GEMV (the sm_90 SASS, read with cuobjdump from Triton's
bundled tools; the PTX checks are in ``test_kernel_compiles_for_cuda_sm90_without_a_gpu``):
the weight words, x and the rows' scales arrive with vector / scalar loads in the layout
of the weight tile, and the K loop has no shared memory and no barrier; 4.4 instructions
per weight at 4 rows per thread, 5.3 at 2, 6.7 at 1 (the kernel before this design: 7.2,
and its loop waited on a single 16-byte load per thread). The layout traps, avoided by
the candidate tiles: a tensor loaded with at least as many elements as the program has
threads gets a layout of its own (Triton's coalescing) and is converted through shared
memory (two barriers) every step, unless that layout happens to be the weight tile's:
x's step tile is ``4 · 4 · K_THREADS`` int32 pairs of fp16 / bf16 (``8 · 4 · K_THREADS``
fp32), so ``K_THREADS < 2 · warps`` (``< warps`` for fp32 x: correct but converted
otherwise); the scales ``[BLOCK_N, K_THREADS]`` load in the weight tile's layout by
construction (and ``stride_sn`` is not specialized, so that a scale per row,
per-channel, does not look contiguous and get vectorized).

**Split-K.** A 4096 x 4096 weight at BLOCK_N = 128 is only 32 row blocks, a quarter of an
H100's 132 SMs, and each would walk 4096 columns one load latency at a time. With
``SPLIT_K`` > 1 the grid gets a third axis: program (n, m, s) reduces the s-th of SPLIT_K
K ranges into fp32 ``partials[s]``, then takes a ticket from a per-tile counter
(``tl.atomic_add``, acquire-release); the program that draws the last ticket sums the
SPLIT_K partials *in split order* (so the result does not depend on who arrived last),
writes y in x's dtype and resets the counter to 0 (the "last block reduces" pattern of
CUDA's threadFenceReduction sample). One launch, no memset, deterministic, and safe to run
again and again (autotuning, CUDA graph replays): the counters are zero between launches.

**Large M.** From ``DEQUANT_MIN_M`` rows (prefills, large batches: compute-bound) the
weight is dequantized once into a buffer of x's dtype by ``_dequantize_kernel`` and
multiplied by ``torch.matmul`` (cuBLAS). The GPU check times both at M = 256 and 1024: on
the H100, every run since the dequantize kernel found it faster than the tiled GEMM at 256
rows (4096 x 4096, bf16: 95 against 126 µs, 46 against 159, 39 against 55) and at 1024.

Invariants:

* ``BLOCK_K`` is the largest power of two up to 64 that divides g (at least 16), so a K
  step of the tiled path never straddles two groups (one scale per row per step; the
  group index is carried from step to step, not divided), nor does a GEMV chunk (32
  columns, 16 when BLOCK_K is 16); K is a multiple of it. A GEMV step of several chunks
  may span groups (each chunk has its own scale) and the end of K (masked per chunk). A
  layout the kernel does not take (g not a multiple of 16, a qweight whose rows are not
  whole int32 words) is computed by the plain path ``F.linear(x, dequantize_packed(...))``:
  correct, slow, and never chosen for the layouts ``quantize_model`` makes (g 32 … 576).
* Zero points are integers (``packing.py``): ``2^(23 − 4p) + z`` is then exact.
* M and N edges are masked: the tiled path reads u = z = s = 0 for a masked row, the
  GEMV leaves it unread (what it computes there is never stored).
* Accumulation is fp32. The GEMV path multiplies x by the exact ``u − z`` and scales the
  sum, so it is *more* exact than the plain path (which rounds each ``(u − z) · s`` to x's
  dtype first); the tiled path's fp32 ``tl.dot`` is true fp32 on CUDA too (``_dot.dot``).
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
import triton.language as tl

from . import tuning
from ._dot import dot
from ._checks import check_packed_linear
from ._grid import cdiv
from .interpreter import interpreter_enabled

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


@triton.jit
def _unpack(words):
    """int32 words ``[R, W]`` -> fp32 ``[R, 8 W]`` holding ``2^23 + u``, columns in order
    (column 8j + i is nibble i, bits 4i..4i+3, of word j)."""
    words = words.to(tl.uint32, bitcast=True)  # logical shifts: no sign extension
    magic = 0x4B000000
    u0 = (words & 0xF) | magic
    u1 = ((words >> 4) & 0xF) | magic
    u2 = ((words >> 8) & 0xF) | magic
    u3 = ((words >> 12) & 0xF) | magic
    u4 = ((words >> 16) & 0xF) | magic
    u5 = ((words >> 20) & 0xF) | magic
    u6 = ((words >> 24) & 0xF) | magic
    u7 = (words >> 28) | magic
    # interleave(a, b)[2t] = a[t], [2t + 1] = b[t]: even columns 8j + {0, 2, 4, 6} in
    # order come from interleave(interleave(u0, u4), interleave(u2, u6)), the odd likewise.
    even = tl.interleave(tl.interleave(u0, u4), tl.interleave(u2, u6))
    odd = tl.interleave(tl.interleave(u1, u5), tl.interleave(u3, u7))
    return tl.interleave(even, odd).to(tl.float32, bitcast=True)


@triton.jit
def _plane(words, hi, zc, magic, i: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """``u − z`` (exact, fp32) of nibble plane i of ``words`` ``[BLOCK_N, K_THREADS, CW]``
    (``hi`` is ``words >> 12``; ``zc`` the zeros ``[BLOCK_N, K_THREADS]``): the weights of
    columns 8j + i. The nibble is masked where it lies, at bit 4p (p = i for i < 5; p =
    i − 3 in ``hi`` for the top three), and OR-ed with the exponent of 2^(23 − 4p): read as
    fp32 that is exactly 2^(23 − 4p) + u (the nibble's lowest bit is then worth 1). One
    LOP3 and one FADD per weight, no shift, no reordering."""
    p: tl.constexpr = i if i < 5 else i - 3
    src = words if i < 5 else hi
    # magic (2^23's bit pattern) is a run-time value: ptxas then fuses the AND with an
    # immediate and the OR with a register into one LOP3 (two immediates take two)
    f = ((src & (0xF << (4 * p))) | (magic - ((4 * p) << 23))).to(tl.float32, bitcast=True)
    if HAS_ZEROS:
        return f - (zc + (1 << (23 - 4 * p)))[:, :, None]
    else:  # symmetric: every zero is 8
        return f - ((1 << (23 - 4 * p)) + 8.0)


@triton.jit
def _gemv_loads(X, q_rows, s_rows, z_rows, x_row, n_mask, k0, k_end, group_size, stride_sg,
                stride_zg, stride_xk, K_THREADS: tl.constexpr, CW: tl.constexpr,
                HAS_ZEROS: tl.constexpr):
    """Everything one GEMV step reads: columns k0 .. k0 + K_THREADS · 8 CW − 1 in
    K_THREADS chunks of CW words (8 CW columns, one load per row, inside one group).
    Returns the words ``[BLOCK_N, K_THREADS, CW]``, each chunk's scales and zeros
    ``[BLOCK_N, K_THREADS]`` and x's eight planes ``[1, K_THREADS, CW]`` in fp32 (plane
    i: columns 8j + i). Chunks at or past ``k_end`` read nothing."""
    chunk = tl.arange(0, K_THREADS)
    live = k0 + 8 * CW * chunk < k_end                       # [K_THREADS]
    grp = (k0 + 8 * CW * chunk) // group_size                # each chunk's group
    offs_w = (tl.multiple_of(k0 // 8, CW) + CW * chunk[:, None]
              + tl.arange(0, CW)[None, :])                   # [K_THREADS, CW] word columns
    offs_w = tl.max_contiguous(tl.multiple_of(offs_w, [CW, CW]), [1, CW])
    words = tl.load(q_rows[:, None, None] + offs_w[None, :, :],
                    mask=n_mask[:, None, None] & live[None, :, None])
    rows_live = n_mask[:, None] & live[None, :]
    s = tl.load(s_rows[:, None] + grp[None, :] * stride_sg, mask=rows_live)
    if HAS_ZEROS:
        zc = tl.load(z_rows[:, None] + grp[None, :] * stride_zg, mask=rows_live)
    else:
        zc = s  # unused
    if X.dtype.element_ty.primitive_bitwidth == 16:
        # x's columns read as int32 pairs [1, K_THREADS, CW, 4] (16-byte loads, half as
        # many elements as 16-bit values; the host makes x's rows contiguous): pair e of
        # word j holds columns 8j + 2e (low half) and 8j + 2e + 1
        cols = 4 * offs_w[None, :, :, None] + tl.arange(0, 4)[None, None, None, :]
        xw = tl.load(x_row.to(tl.pointer_type(tl.int32)) + cols, mask=live[None, :, None, None])
        xw = tl.reshape(xw.to(tl.uint32, bitcast=True), [1, K_THREADS, CW, 2, 2])
        xa0, xa1 = tl.split(xw)       # pairs e = 2a + b: b = 0, 1
        xe0, xe2 = tl.split(xa0)      # a
        xe1, xe3 = tl.split(xa1)
        x0, x1 = _x_pair(xe0, X.dtype.element_ty)
        x2, x3 = _x_pair(xe1, X.dtype.element_ty)
        x4, x5 = _x_pair(xe2, X.dtype.element_ty)
        x6, x7 = _x_pair(xe3, X.dtype.element_ty)
    else:
        # x's columns as [1, K_THREADS, CW, 8] (contiguous: 16-byte loads), then with the 8
        # as [2, 2, 2] (column 8j + 4a + 2b + c at [.., a, b, c]): three splits
        cols = 8 * offs_w[None, :, :, None] + tl.arange(0, 8)[None, None, None, :]
        xs = tl.load(x_row + cols * stride_xk, mask=live[None, :, None, None]).to(tl.float32)
        xs = tl.reshape(xs, [1, K_THREADS, CW, 2, 2, 2])
        xc0, xc1 = tl.split(xs)       # c = 0, 1
        xc0b0, xc0b1 = tl.split(xc0)  # b
        xc1b0, xc1b1 = tl.split(xc1)
        x0, x4 = tl.split(xc0b0)      # a: planes 0 and 4 (c = 0, b = 0)
        x2, x6 = tl.split(xc0b1)
        x1, x5 = tl.split(xc1b0)
        x3, x7 = tl.split(xc1b1)
    return words.to(tl.uint32, bitcast=True), s, zc, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_pair(pair, dtype: tl.constexpr):
    """Two 16-bit floats packed in a uint32 -> (low, high) as fp32. A bf16 is the top half
    of its fp32: one shift or one AND each."""
    if dtype == tl.bfloat16:
        return (pair << 16).to(tl.float32, bitcast=True), \
            (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return (pair & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32), \
            (pair >> 16).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_step(words, s, zc, x0, x1, x2, x3, x4, x5, x6, x7, magic, HAS_ZEROS: tl.constexpr):
    """``scale · Σ (u − z) · x`` of one step per row and chunk ``[BLOCK_N, K_THREADS]``:
    plane by plane, each nibble multiplies the x of its own column, so the weights are
    never reordered; a chunk lies in one thread (its sum needs no shuffle)."""
    hi = words >> 12
    t = _plane(words, hi, zc, magic, 0, HAS_ZEROS) * x0
    t += _plane(words, hi, zc, magic, 1, HAS_ZEROS) * x1
    t += _plane(words, hi, zc, magic, 2, HAS_ZEROS) * x2
    t += _plane(words, hi, zc, magic, 3, HAS_ZEROS) * x3
    t += _plane(words, hi, zc, magic, 4, HAS_ZEROS) * x4
    t += _plane(words, hi, zc, magic, 5, HAS_ZEROS) * x5
    t += _plane(words, hi, zc, magic, 6, HAS_ZEROS) * x6
    t += _plane(words, hi, zc, magic, 7, HAS_ZEROS) * x7
    return tl.sum(t, axis=2) * s


@triton.jit
def _weight_step(q_rows, s_rows, z_rows, n_mask, k0, g, stride_sg, stride_zg,
                 BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """One K step of the program's rows, inside group g: (``u − z`` exactly, in fp32,
    ``[BLOCK_N, BLOCK_K]``; the group's scales ``[BLOCK_N]``). Masked rows read 0s."""
    # k0 is a multiple of BLOCK_K (so is every split's start): say so, for 16-byte loads
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    offs_w = tl.max_contiguous(tl.multiple_of(offs_w, BLOCK_K // 8), BLOCK_K // 8)
    words = tl.load(q_rows[:, None] + offs_w[None, :], mask=n_mask[:, None], other=0)
    s = tl.load(s_rows + g * stride_sg, mask=n_mask, other=0.0)
    if HAS_ZEROS:
        zc = tl.load(z_rows + g * stride_zg, mask=n_mask, other=0.0) + 8388608.0
        v = _unpack(words) - zc[:, None]
    else:  # symmetric: every zero is 8
        v = _unpack(words) - (8388608.0 + 8.0)
    return v, s


@triton.jit
def _step_columns(k0, BLOCK_K: tl.constexpr):
    """The columns k0 .. k0 + BLOCK_K - 1 of a step, marked aligned and contiguous."""
    return tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)


@triton.jit
def _next_step(g, in_group, group_size, BLOCK_K: tl.constexpr):
    """(group, column in the group) of the next K step (BLOCK_K divides group_size)."""
    in_group += BLOCK_K
    wrap = in_group == group_size
    return g + wrap.to(tl.int32), tl.where(wrap, 0, in_group)


# SPLIT_K is a run-time argument, never specialized: one compiled kernel per tile
# config serves every split count (autotuning compiles 5 programs per bucket, not 25). M and
# the partials' split stride (M * N) change with every engine step's row count: not
# specialized either, so a serving run compiles nothing new when its batch changes.
@triton.jit(do_not_specialize=["SPLIT_K", "k_per_split", "stride_sn", "stride_zn", "M",
                               "stride_ps"])
def _w4a16_kernel(
    X, QW, Scales, Zeros, Out, Partials, Counters,
    M, N, K, group_size, k_per_split, SPLIT_K,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_om, stride_on, stride_ps, stride_pm, magic,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, ROW_ALIGN: tl.constexpr, K_THREADS: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows_n = offs_n.to(tl.int64)
    # Row starts are ROW_ALIGN-word aligned (16 bytes when 4): vector loads of whole rows.
    q_rows = QW + tl.multiple_of(rows_n * stride_qn, ROW_ALIGN)
    s_rows = Scales + rows_n * stride_sn
    z_rows = Zeros + rows_n * stride_zn
    k_start = pid_k * k_per_split  # k_per_split: a multiple of BLOCK_K; the last split
    k_end = tl.minimum(k_start + k_per_split, K)  # may be shorter, or even empty
    g = k_start // group_size  # the step's group and its column in it, carried from
    in_group = k_start - g * group_size  # step to step (no division per step)

    if BLOCK_M == 1:  # GEMV: plane-wise products, one x row per program, loads one step ahead
        CW: tl.constexpr = 4 if BLOCK_K >= 32 else 2  # words per chunk: 16 (8) bytes a row
        GK: tl.constexpr = 8 * CW * K_THREADS         # columns per step
        x_row = X + pid_m.to(tl.int64) * stride_xm
        words, s, zc, x0, x1, x2, x3, x4, x5, x6, x7 = _gemv_loads(
            X, q_rows, s_rows, z_rows, x_row, n_mask, k_start, k_end, group_size, stride_sg,
            stride_zg, stride_xk, K_THREADS, CW, HAS_ZEROS)
        acc = tl.zeros([BLOCK_N, K_THREADS], dtype=tl.float32)
        for k0 in range(k_start, k_end, GK):
            nxt = _gemv_loads(X, q_rows, s_rows, z_rows, x_row, n_mask, k0 + GK, k_end,
                              group_size, stride_sg, stride_zg, stride_xk, K_THREADS, CW,
                              HAS_ZEROS)
            acc += _gemv_step(words, s, zc, x0, x1, x2, x3, x4, x5, x6, x7, magic, HAS_ZEROS)
            words, s, zc, x0, x1, x2, x3, x4, x5, x6, x7 = nxt
        acc2 = tl.sum(acc, axis=1)[None, :]  # the chunks' threads: one reduction at the end
        offs_m = pid_m + tl.arange(0, 1)
    else:  # tiled: tl.dot of an x tile with the exact integers u - z, scaled per group
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            v, s = _weight_step(q_rows, s_rows, z_rows, n_mask, k0, g, stride_sg, stride_zg,
                                BLOCK_K, HAS_ZEROS)
            cols = _step_columns(k0, BLOCK_K)
            x = tl.load(x_rows + cols[None, :] * stride_xk, mask=m_mask[:, None], other=0.0)
            # |u - z| <= 15: exact in fp16 / bf16, so only x's rounding enters the product
            acc2 += dot(x, tl.trans(v.to(x.dtype))) * s[None, :]
            g, in_group = _next_step(g, in_group, group_size, BLOCK_K)

    out_mask = (offs_m < M)[:, None] & n_mask[None, :]
    rows_m = offs_m.to(tl.int64)
    out_ptrs = Out + rows_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc2.to(Out.dtype.element_ty), mask=out_mask)
    else:  # partials [SPLIT_K, M, N] fp32; the last split of the tile to finish reduces
        part = Partials + rows_m[:, None] * stride_pm + offs_n[None, :]
        tl.store(part + pid_k.to(tl.int64) * stride_ps, acc2, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release)
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(Counters + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc2)
            for sp in range(0, SPLIT_K):  # in split order: the result is deterministic
                total += tl.load(part + sp * stride_ps, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")  # from L2, never a stale L1 line
            tl.store(out_ptrs, total.to(Out.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(Counters + tile, 0)  # zero again for the next launch


@triton.jit
def _dequantize_kernel(
    QW, Scales, Zeros, W, N, group_size,
    stride_qn, stride_sn, stride_sg, stride_zn, stride_zg, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):
    """W ``[N, K]`` in W's dtype, one ``[BLOCK_N, BLOCK_K]`` tile (inside one group) per
    program: ``(u − z) · s`` in fp32, then rounded, bit for bit as ``dequantize_packed``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    rows_n = offs_n.to(tl.int64)
    v, s = _weight_step(QW + tl.multiple_of(rows_n * stride_qn, ROW_ALIGN),
                        Scales + rows_n * stride_sn, Zeros + rows_n * stride_zn, n_mask, k0,
                        k0 // group_size, stride_sg, stride_zg, BLOCK_K, HAS_ZEROS)
    tl.store(W + rows_n[:, None] * stride_wn + _step_columns(k0, BLOCK_K)[None, :],
             (v * s[:, None]).to(W.dtype.element_ty), mask=n_mask[:, None])


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


def bucket_of_call(x: torch.Tensor, qweight: torch.Tensor, group_size: int):
    """(Tunable, bucket) a ``w4a16_linear`` call on the kernel path uses (None if it takes
    the plain path): the GPU check reports the pinned config of each row."""
    block_k = _block_k(group_size)
    if _as_words(qweight) is None or block_k is None:
        return None
    m = min(x.numel() // x.shape[-1], DEQUANT_MIN_M - 1)
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
