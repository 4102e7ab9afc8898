"""The W4A16 kernels in Triton: a matmul whose weight is stored in 4 bits and dequantized
on the fly, and the kernel that dequantizes a whole weight. What they compute, the weight's
layout, the wrappers that check arguments and launch them, and their tiles: ``w4a16.py``.

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

Invariants:

* Zero points are integers (``packing.py``): ``2^(23 − 4p) + z`` is then exact.
* M and N edges are masked: the tiled path reads u = z = s = 0 for a masked row, the
  GEMV leaves it unread (what it computes there is never stored).
* Accumulation is fp32. The GEMV path multiplies x by the exact ``u − z`` and scales the
  sum, so it is *more* exact than the plain path (which rounds each ``(u − z) · s`` to x's
  dtype first); the tiled path's fp32 ``tl.dot`` is true fp32 on CUDA too (``_dot.dot``).
* A K step of the tiled path never straddles two groups (``BLOCK_K`` divides g: one scale
  per row per step; the group index is carried from step to step, not divided), nor does
  a GEMV chunk (32 columns, 16 when BLOCK_K is 16). A GEMV step of several chunks may span
  groups (each chunk has its own scale) and the end of K (masked per chunk).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import dot


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
