"""The decode GEMV's Triton kernel: a few rows times a weight matrix, with the glue before
it in its prologue and, for q|k|v, RoPE and the K/V store in its epilogue. What it is for,
the wrappers that check arguments and launch it, and its tiles: ``decode_gemv.py``.

One program computes BLOCK_N outputs of one row (grid: N / BLOCK_N x M). The prologue with
a norm first walks the row once for its sum of squares (the row is K values, 1-2 KiB: it
stays in L1 / L2 for the second walk), then the main loop recomputes the normalized input
chunk by chunk while it streams its BLOCK_N rows of W, and keeps a [BLOCK_N, BLOCK_K] fp32
accumulator summed once at the end. The first tile of each row also stores that row's s
(the residual stream the next layer adds to); every tile computes the same s.

The RoPE epilogue: RoPE rotates the column pairs (d, d + D/2) of each head, so a
program's BLOCK_N rows of W (even: whole pairs) are BLOCK_N / 2 such pairs, each pair's two
rows side by side; after the sum, a reshape and `tl.split` hand each pair to its thread in
registers (no shared memory or barrier added in the sm_90 PTX). The sums are rounded to the
output dtype (what the unfused product stores), rotated by glue's own `rope_pair` (what
`rope_kv` does with what it loads) and stored; k and v also go to the caches (glue's
`store_kv`). The tables and the slot are loaded before the main loop.

Invariants:
- The input is rounded to the model dtype exactly where the unfused path rounds it (the sum
  x + delta; the normalized row before the norm weight; that product; silu(gate) before
  `* up`; the product): the GEMV reads the same bf16 values the unfused path hands to
  cuBLAS, then multiplies in fp32. Int4: `(u − z) · s` in fp32 (exact u − z, one rounding),
  times the input, in fp32, as the W4A16 GEMV does.
- No tl.dot (every product is an FMA): any BLOCK size is valid, fp32 stays fp32 on a GPU.
- A row's result depends on that row only, and the tiles never on M: a padded CUDA-graph
  batch gives a sequence the bits of a batch of one.
- With RoPE the tiles, and each output's sum, are those of the plain product (only which
  rows a program takes changes): the epilogue's output and caches are the bits of the
  product then `glue.rope_kv` (tests/test_decode_gemv.py).
- Int4: BLOCK_K divides the group size (one scale per row per chunk of BLOCK_K columns;
  SPLIT chunks side by side a step, UNROLL steps a loop iteration) and is a multiple of 8
  (whole words); K is a multiple of it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .glue import add_rounded, normed_times_weight, rope_pair, rope_tables, silu_times_up, store_kv
from .w4a16_kernel import _unpack


@triton.jit
def _input_chunk(X, Delta, NormW, row_x, row_d, cols, mask, inv, inter,
                 PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr):
    """The GEMV's input at columns `cols` (fp32), rounded as the unfused glue rounds it (the
    glue kernels' own rounding helpers: the same bits)."""
    dtype = X.dtype.element_ty
    if PROLOGUE == 2:  # silu(gate) * up, gate | up side by side in X's row
        g = tl.load(X + row_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        return silu_times_up(g, u, dtype).to(tl.float32)
    x = tl.load(X + row_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = add_rounded(x, tl.load(Delta + row_d + cols, mask=mask, other=0.0), dtype)
    if PROLOGUE == 1:  # RMSNorm
        w = tl.load(NormW + cols, mask=mask, other=0.0)
        return normed_times_weight(x.to(tl.float32), inv, w, dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _decode_gemv_kernel(X, Delta, NormW, Sum, W, Scales, Zeros, Y,
                        N, K, eps, group_size,
                        stride_xm, stride_dm, stride_sm, stride_wn, stride_wk,
                        stride_sn, stride_zn, stride_ym,
                        Cos, Sin, KC, VC, Slots, num_q, num_rot, half,
                        stride_cr, stride_sr, stride_ks, stride_kh, stride_vs, stride_vh,
                        PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr, INT4: tl.constexpr,
                        HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, SPLIT: tl.constexpr,
                        NORM_BLOCK: tl.constexpr, ROPE: tl.constexpr,
                        WRITE_KV: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    if ROPE:
        # The tile's rows are RoPE pairs: row 2p is pair j = pid_n * BLOCK_N / 2 + p's x[d]
        # (head j // (D/2), d = j % (D/2)), row 2p + 1 its partner x[d + D/2]. A tile's
        # weights are still contiguous along K: the main loop does not change.
        r = tl.arange(0, BLOCK_N)
        row_pair = pid_n * (BLOCK_N // 2) + r // 2
        n_offs = (row_pair // half) * (2 * half) + row_pair % half + (r % 2) * half
        # the epilogue's pairs, tables and slot, loaded before the loop (in flight with it)
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        head, hd = pair // half, pair % half  # (hd: `d` is the prologue's delta chunk)
        pair_ok = pair < N // 2
        c1, c2, s1, s2 = rope_tables(Cos, Sin, row * stride_cr, row * stride_sr, hd, half,
                                     pair_ok)
        if WRITE_KV:
            slot = tl.load(Slots + row).to(tl.int64)
    else:
        n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    n64 = n_offs.to(tl.int64)
    k_offs = tl.arange(0, BLOCK_K)
    row_x, row_d = row * stride_xm, row * stride_dm

    inv = 1.0
    if PROLOGUE == 1:  # the first walk: the sum of squares of s = x + delta (rounded)
        ssq = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):  # one step up to K = NORM_BLOCK (SmolLM2: 576)
            cols = k0 + tl.arange(0, NORM_BLOCK)
            mask = cols < K
            x = tl.load(X + row_x + cols, mask=mask, other=0.0)
            if HAS_DELTA:
                d = tl.load(Delta + row_d + cols, mask=mask, other=0.0)
                x = add_rounded(x, d, X.dtype.element_ty)
                if pid_n == 0:  # every program computes the same s: the first tile keeps it
                    tl.store(Sum + row * stride_sm + cols, x, mask=mask)
            xf = x.to(tl.float32)
            ssq += xf * xf
        inv = tl.rsqrt(tl.sum(ssq, axis=0) / K + eps)

    # The input chunk is computed as a tile whose rows are all alike: the same shape and
    # contiguity as the weight tile, so it gets the weight's layout and needs no conversion
    # through shared memory (two barriers) each step; the repeated loads hit L1. (As a
    # [BLOCK_K] vector it would get a layout of its own: sm_90 PTX, 2026-11-27.)
    if INT4 and SPLIT > 1:
        # SPLIT chunks side by side, a [BLOCK_N, SPLIT, BLOCK_K] tile (each chunk inside one
        # group, its own scale): a short weight's few rows a program still give each thread
        # of several warps whole words, where a [BLOCK_N, BLOCK_K] tile on more warps than it
        # fills converts layouts through shared memory every chunk. UNROLL such steps.
        sub = tl.arange(0, SPLIT)
        w_base3 = (W + n64[:, None, None] * stride_wn + (sub * (BLOCK_K // 8))[None, :, None]
                   + tl.arange(0, BLOCK_K // 8)[None, None, :])
        alike3 = tl.zeros([BLOCK_N, 1, 1], dtype=tl.int32)
        acc3 = tl.zeros([BLOCK_N, SPLIT, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K * SPLIT * UNROLL):
            for j in tl.static_range(UNROLL):
                ks = k0 + j * (BLOCK_K * SPLIT) + sub * BLOCK_K  # each chunk's first column
                inside = ks < K  # a chunk past K reads nothing and adds 0 (s = 0)
                words = tl.load(w_base3 + (k0 + j * (BLOCK_K * SPLIT)) // 8,
                                mask=n_mask[:, None, None] & inside[None, :, None], other=0)
                s, z = _group_scale_zero(Scales, Zeros, n64[:, None],
                                         n_mask[:, None] & inside[None, :], stride_sn,
                                         stride_zn, (ks // group_size)[None, :], HAS_ZEROS)
                cols = ks[None, :, None] + k_offs[None, None, :] + alike3
                h = _input_chunk(X, Delta, NormW, row_x, row_d, cols, cols < K, inv, K,
                                 PROLOGUE, HAS_DELTA)
                acc3 += ((_unpack(words) - (z + 8388608.0)[:, :, None]) * s[:, :, None]) * h
        total = tl.sum(tl.sum(acc3, axis=2), axis=1)
    elif INT4:
        # BLOCK_K / 8 words a row a chunk, inside one group: one scale (and zero) a row.
        # UNROLL chunks a step, unrolled: their loads are independent, so all of a step's
        # are in flight at once (a short group would otherwise make K / g steps, each
        # waiting for its own loads).
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        rows_alike = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
        w_base = W + n64[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
        for k0 in range(0, K, BLOCK_K * UNROLL):
            for j in tl.static_range(UNROLL):
                kj = k0 + j * BLOCK_K
                inside = kj < K  # a chunk past K reads nothing and adds 0 (s = 0)
                words = tl.load(w_base + kj // 8, mask=n_mask[:, None] & inside, other=0)
                s, z = _group_scale_zero(Scales, Zeros, n64, n_mask & inside, stride_sn,
                                         stride_zn, kj // group_size, HAS_ZEROS)
                cols = kj + k_offs[None, :] + rows_alike
                h = _input_chunk(X, Delta, NormW, row_x, row_d, cols, cols < K, inv, K,
                                 PROLOGUE, HAS_DELTA)
                # _unpack gives 2^23 + u exactly; minus (2^23 + z): the exact u − z
                acc += ((_unpack(words) - (z + 8388608.0)[:, None]) * s[:, None]) * h
        total = tl.sum(acc, axis=1)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        rows_alike = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + k_offs[None, :] + rows_alike
            mask = cols < K
            h = _input_chunk(X, Delta, NormW, row_x, row_d, cols, mask, inv, K,
                             PROLOGUE, HAS_DELTA)
            w = tl.load(W + n64[:, None] * stride_wn + cols * stride_wk,
                        mask=n_mask[:, None] & mask, other=0.0)
            acc += w.to(tl.float32) * h
        total = tl.sum(acc, axis=1)
    y = total.to(Y.dtype.element_ty)  # rounded as the unfused product's output
    if ROPE:  # then rotated exactly as glue.rope_kv rotates what it loads
        x1, x2 = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        y1, y2 = rope_pair(x1, x2, c1, c2, s1, s2, ROUND_PRODUCT)
        rotated = head < num_rot  # q and k heads; v as it is
        out = Y + row * stride_ym + head.to(tl.int64) * (2 * half) + hd
        tl.store(out, tl.where(rotated, y1, x1), mask=pair_ok)
        tl.store(out + half, tl.where(rotated, y2, x2), mask=pair_ok)
        if WRITE_KV:
            store_kv(KC, VC, slot, head, hd, half, num_q, num_rot, pair_ok, y1, y2, x1, x2,
                     stride_ks, stride_kh, stride_vs, stride_vh)
    else:
        tl.store(Y + row * stride_ym + n_offs, y, mask=n_mask)


@triton.jit
def _group_scale_zero(Scales, Zeros, n64, mask, stride_sn, stride_zn, g,
                      HAS_ZEROS: tl.constexpr):
    """Group g's scale and zero point of each of the tile's rows ([BLOCK_N] fp32, or
    [BLOCK_N, SPLIT] for a group index per chunk; a symmetric weight's zero is 8)."""
    s = tl.load(Scales + n64 * stride_sn + g, mask=mask, other=0.0)
    if HAS_ZEROS:
        z = tl.load(Zeros + n64 * stride_zn + g, mask=mask, other=0.0)
    else:
        z = tl.full(s.shape, 8.0, dtype=tl.float32)
    return s, z
