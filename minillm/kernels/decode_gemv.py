"""The decode GEMV: a few rows times a weight matrix, with the glue before it done in its
prologue (and for q|k|v, RoPE and the K/V store after it in its epilogue).

Why: replayed as a CUDA graph, a SmolLM2 decode step is a chain of ~280 small kernels, nine
per layer (`glue.py`), and on an H100 each costs ~1.5 µs of launch and drain on top of its
work, about as much as the work itself. Three of the nine exist only to feed a weight
product: the input norm (with the residual add) before q|k|v, the post-attention norm (with
its add) before gate|up, and SiLU·up before down. A GEMV can do that glue itself while it
loads its input row; and one more only finishes q|k|v's output: RoPE and the K/V store
(`glue.rope_kv`), which q|k|v's GEMV can do before it stores. So a decode layer becomes five
kernels:

    norm_linear(qkv, rope) -> attention -> o_proj -> norm_linear(gate_up)
    -> silu_mul_linear(down)

    linear(x, w)                         y = x Wᵀ
    norm_linear(x, delta, nw, eps, w)    (s, y): s = x + delta (or x), y = RMSNorm(s) Wᵀ
      ..., rope=Rope(...)                y's q and k heads rotated, k and v stored (below)
    silu_mul_linear(gate_up, w)          y = (silu(gate) * up) Wᵀ

W is a float matrix [N, K] of x's dtype, or an `Int4Weight`: the packed 4-bit layout of
`minillm.quant.packing` (uint8 [N, K / 2], fp32 scales and zeros [N, K / g]; zeros None for
a symmetric weight, every zero 8), read as int32 words and unpacked in registers (the
2^23 trick of `w4a16._unpack`). So a w4 model gets the same five kernels, reading a quarter
of the bytes.

One program computes BLOCK_N outputs of one row (grid: N / BLOCK_N x M). The prologue with
a norm first walks the row once for its sum of squares (the row is K values, 1-2 KiB: it
stays in L1 / L2 for the second walk), then the main loop recomputes the normalized input
chunk by chunk while it streams its BLOCK_N rows of W, and keeps a [BLOCK_N, BLOCK_K] fp32
accumulator summed once at the end. The first tile of each row also stores that row's s
(the residual stream the next layer adds to); every tile computes the same s.

The RoPE epilogue (`Rope`): RoPE rotates the column pairs (d, d + D/2) of each head, so a
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
- A row's result depends on that row only, and the tiles depend on N, K and the weight's
  kind, never on M: a padded CUDA-graph batch gives a sequence the bits of a batch of one.
- With RoPE the tiles, and each output's sum, are those of the plain product (only which
  rows a program takes changes): the epilogue's output and caches are the bits of
  `norm_linear` then `glue.rope_kv` (tests/test_decode_gemv.py).
- No value of a CUDA tensor is read on the host and nothing is allocated but the outputs:
  safe inside a CUDA-graph capture.
- Int4: BLOCK_K divides the group size (one scale per row per chunk of BLOCK_K columns;
  UNROLL chunks a step) and is a multiple of 8 (whole words); K is a multiple of it.

Where it runs (`minillm.layers.fused.norm_linear`, `norm_linear_rope`, `silu_mul_linear`):
wherever the Triton glue runs (CUDA, eager or in a graph; not inside torch.compile), for at
most MAX_ROWS rows, and for a weight that is a plain `Linear`'s or a 4-bit `QuantLinear`'s
with no hooks. `MINILLM_FUSED_GEMV=0` switches it off (the A/B of the GPU check),
`MINILLM_FUSED_ROPE=0` the RoPE epilogue alone. The tiles are chosen
from the shape (`_tiles`), not measured yet: the GPU check times this path against cuBLAS +
glue in the same run, and its opt-in `gemv_tiles` section times other tiles (`tiles`).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import _check_device_dtype
from ._grid import cdiv, next_power_of_2
from .glue import (add_rounded, normed_times_weight, rope_args, rope_pair, rope_tables,
                   silu_times_up, store_kv)
from .interpreter import interpreter_enabled
from .w4a16 import _as_words, _block_k, _check_args, _unpack

__all__ = ["Int4Weight", "int4_weight", "Rope", "linear", "norm_linear", "silu_mul_linear",
           "MAX_ROWS"]

MAX_ROWS = 4  # from here the unfused path (cuBLAS, w4a16's tiles): W re-read per row
MAX_DENSE_BLOCK_K = 1024  # columns per step of a float weight (`_dense_block_k`)
TILE_ELEMENTS = 8192  # weights per program per step at most (`_tiles`)
INT4_UNROLL = 8  # 4-bit chunks (one group, <= 64 columns, each) per step: 512 columns ...
INT4_ONE_STEP = 12  # ... unless K has at most this many: then all of them, one step
INTERPRETER_BLOCK_N = 256  # rows a program on the CPU interpreter
_NONE, _NORM, _SILU = 0, 1, 2  # the prologue


class Int4Weight(NamedTuple):
    """A 4-bit weight in `minillm.quant.packing`'s layout (see the module)."""
    qweight: torch.Tensor           # uint8 [N, K / 2]
    scales: torch.Tensor            # fp32 [N, K / group_size]
    zeros: torch.Tensor | None      # fp32 like scales; None: symmetric (every zero 8)
    group_size: int


class Rope(NamedTuple):
    """RoPE on the q and k heads of q|k|v's product, and the K/V store: what
    `glue.rope_kv(y.view(M, H, D), num_q, num_kv, cos, sin, kv)` does after it."""
    num_q: int
    num_kv: int
    head_dim: int
    cos: torch.Tensor               # [M, head_dim] rows at each token's position, fp32 or
    sin: torch.Tensor               # x's dtype (both alike)
    kv: tuple | None = None         # (k_cache, v_cache [num_slots, num_kv, D], slot_mapping [M])


def int4_weight(qweight, scales, zeros, group_size: int) -> Int4Weight | None:
    """The Int4Weight of a packed 4-bit weight, or None for a layout the kernel does not read
    (a group size with no power-of-two divisor >= 16, rows that are not whole int32 words)."""
    if _block_k(group_size) is None or _as_words(qweight) is None:
        return None
    return Int4Weight(qweight, scales, zeros, group_size)


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
                        BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
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

    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # The input chunk is computed as a [BLOCK_N, BLOCK_K] tile whose rows are all alike: the
    # same shape and contiguity as the weight tile, so it gets the weight's layout and needs
    # no conversion through shared memory (two barriers) each step; the repeated loads hit
    # L1. (As a [BLOCK_K] vector it would get a layout of its own: sm_90 PTX, 2026-11-27.)
    rows_alike = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    if INT4:
        # BLOCK_K / 8 words a row a chunk, inside one group: one scale (and zero) a row.
        # UNROLL chunks a step, unrolled: their loads are independent, so all of a step's
        # are in flight at once (a short group would otherwise make K / g steps, each
        # waiting for its own loads).
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
    else:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + k_offs[None, :] + rows_alike
            mask = cols < K
            h = _input_chunk(X, Delta, NormW, row_x, row_d, cols, mask, inv, K,
                             PROLOGUE, HAS_DELTA)
            w = tl.load(W + n64[:, None] * stride_wn + cols * stride_wk,
                        mask=n_mask[:, None] & mask, other=0.0)
            acc += w.to(tl.float32) * h
    y = tl.sum(acc, axis=1).to(Y.dtype.element_ty)  # rounded as the unfused product's output
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
    """Group g's scale and zero point of each of the tile's rows ([BLOCK_N] fp32; a symmetric
    weight's zero is 8)."""
    s = tl.load(Scales + n64 * stride_sn + g, mask=mask, other=0.0)
    if HAS_ZEROS:
        z = tl.load(Zeros + n64 * stride_zn + g, mask=mask, other=0.0)
    else:
        z = tl.full(s.shape, 8.0, dtype=tl.float32)
    return s, z


def _int4_unroll(k: int, block_k: int) -> int:
    """4-bit chunks per step: all of K in one step when it is short (SmolLM2's 576 at g64: 9
    chunks, 91 registers a thread in the sm_90 SASS, no spill), else INT4_UNROLL (1536: 3
    steps of 8), so that no step is mostly chunks past K."""
    chunks = cdiv(k, block_k)
    return chunks if chunks <= INT4_ONE_STEP else INT4_UNROLL


def _dense_block_k(k: int) -> int:
    """A float weight's columns per step: all of K up to 1024 (SmolLM2's 576 in one step, so
    every load of the program is in flight at once), else 1024 a step."""
    return min(MAX_DENSE_BLOCK_K, max(16, next_power_of_2(k)))


def _tiles(n: int, block_k: int, int4: bool, elem_bytes: int = 2) -> tuple[int, int]:
    """(BLOCK_N, warps) from the shape, not measured. A float weight: ~1-2 programs per SM
    of a 132-SM GPU for SmolLM2's widths (N 576 -> 4 rows a program, 960 -> 4, 3072 -> 8
    with 1024-wide steps), at most TILE_ELEMENTS weights a step of 16-bit ones (32 a thread
    at 8 warps: registers; half as many fp32 ones: Triton 3.6 spilled fp32 gate|up's 8 x
    1024 tile with the residual add), and warps for ~16 of them a thread. A 4-bit weight: 4 rows, one warp (more
    warps put two layout conversions through shared memory in every chunk, 32 barriers a
    step in the sm_90 PTX; one warp needs none), so 4-8 programs per SM. The interpreter
    runs one program at a time in numpy: there, few wide ones (the results do not depend
    on it)."""
    if interpreter_enabled():
        return min(INTERPRETER_BLOCK_N, max(4, next_power_of_2(n))), 4
    if int4:
        return 4, 1
    block_n = max(4, min(64, next_power_of_2(max(1, n // 128)) // 2,
                         TILE_ELEMENTS * 2 // elem_bytes // block_k))
    warps = max(1, min(8, block_n * block_k // 512))
    return block_n, warps


_tile_override: dict = {}  # set only inside `tiles`


@contextlib.contextmanager
def tiles(block_n: int | None = None, warps: int | None = None, unroll: int | None = None):
    """Launch every decode GEMV inside the block with these tiles (None: the shape's own,
    `_tiles` / `_int4_unroll`): for timing candidates on a GPU (`gpu_check.py --sections
    gemv_tiles`), not for models. block_n: rows a program, a power of two >= 2 (RoPE pairs);
    warps: 1, 2, 4 or 8; unroll: 4-bit chunks a step, >= 1 (a float weight has none). A
    candidate changes which program computes which rows, the order of a sum's last
    reduction at most (its warps), never what is computed. Not thread-safe."""
    if block_n is not None and (isinstance(block_n, bool) or not isinstance(block_n, int)
                                or block_n < 2 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 2 (whole RoPE pairs), got {block_n!r}")
    if warps is not None and warps not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {warps!r}")
    if unroll is not None and (isinstance(unroll, bool) or not isinstance(unroll, int)
                               or unroll < 1):
        raise ValueError(f"unroll must be an integer >= 1 (4-bit chunks a step), got {unroll!r}")
    before = dict(_tile_override)
    _tile_override.update({k: v for k, v in (("block_n", block_n), ("warps", warps),
                                             ("unroll", unroll)) if v is not None})
    try:
        yield
    finally:
        _tile_override.clear()
        _tile_override.update(before)


def launch_tiles(n: int, k: int, weight, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, warps, UNROLL) of a launch over ``weight`` (a float [N, K] or an
    Int4Weight) with an input of ``dtype`` and width k: the shape's own, or `tiles`'."""
    int4 = isinstance(weight, Int4Weight)
    block_k = _block_k(weight.group_size) if int4 else _dense_block_k(k)
    return _launch_tiles(n, k, int4, block_k, torch.empty((), dtype=dtype).element_size())


def _launch_tiles(n: int, k: int, int4: bool, block_k: int,
                  elem_bytes: int) -> tuple[int, int, int]:
    block_n, warps = _tiles(n, block_k, int4, elem_bytes)
    unroll = _int4_unroll(k, block_k) if int4 else 1
    o = _tile_override
    return (o.get("block_n", block_n), o.get("warps", warps),
            o.get("unroll", unroll) if int4 else 1)


def _rows(x: torch.Tensor, name: str, width: int) -> torch.Tensor:
    """x [..., width] as [M, width] with a contiguous last dimension (no copy)."""
    if x.dim() < 1 or x.shape[-1] != width:
        raise ValueError(f"{name} must be [..., {width}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides "
                         f"{x.stride()}: pass {name}.contiguous()")
    return x.reshape(-1, width)


def _weight_args(weight, x: torch.Tensor):
    """(N, group size, kernel arguments, INT4, HAS_ZEROS, BLOCK_K) after checking the weight
    against x [M, K] (the GEMV's input: for silu_mul_linear, the gate half)."""
    if isinstance(weight, Int4Weight):
        n, _, _ = _check_args(x, weight.qweight, weight.scales, weight.zeros, weight.group_size)
        words, block_k = _as_words(weight.qweight), _block_k(weight.group_size)
        if words is None or block_k is None:
            raise ValueError(f"this 4-bit layout (group size {weight.group_size}, qweight "
                             f"strides {weight.qweight.stride()}) is not one the decode GEMV "
                             "reads: the group size needs a power-of-two divisor >= 16 and "
                             "qweight whole int32 words a row; use QuantLinear's own path")
        qw32, z = words[0], weight.scales if weight.zeros is None else weight.zeros
        for name, t in (("scales", weight.scales), ("zeros", z)):
            if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:  # only rows are strided
                raise ValueError(f"{name} must have contiguous groups (stride 1 along its "
                                 f"last dimension), got strides {t.stride()}: pass "
                                 f"{name}.contiguous()")
        return (n, weight.group_size, (qw32, weight.scales, z, qw32.stride(0), 1,
                                       weight.scales.stride(0), z.stride(0)),
                True, weight.zeros is not None, block_k)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-d float tensor [N, K] or an Int4Weight, got "
                         f"{type(weight).__name__} {tuple(getattr(weight, 'shape', ()))}")
    _check_device_dtype({"x": x, "weight": weight})
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"the GEMV's input has K = {x.shape[-1]} columns but weight is "
                         f"[N, K] = {tuple(weight.shape)}")
    return (weight.shape[0], 1, (weight, weight, weight, weight.stride(0), weight.stride(1),
                                 0, 0), False, False, _dense_block_k(weight.shape[1]))


def _rope_args(rope: Rope | None, m: int, n: int, y: torch.Tensor) -> tuple[tuple, dict]:
    """The epilogue's kernel arguments (`glue.rope_args`) after checking rope against the
    product's output y [M, N]; placeholders without rope."""
    if rope is None:
        return (y,) * 5 + (0, 0, 1) + (0,) * 6, dict(ROPE=False, WRITE_KV=False,
                                                      ROUND_PRODUCT=False)
    heads = rope.num_q + 2 * rope.num_kv
    if heads * rope.head_dim != n:
        raise ValueError(f"RoPE's heads need N = (num_q + 2 num_kv) * head_dim = ({rope.num_q} "
                         f"+ 2 * {rope.num_kv}) * {rope.head_dim} = {heads * rope.head_dim} "
                         f"output columns, but the weight has N = {n}")
    args, consts = rope_args(m, rope.num_q, rope.num_kv, rope.head_dim, y, rope.cos, rope.sin,
                             rope.kv)
    return args, dict(ROPE=True, **consts)


def _launch(x2, delta2, norm_weight, eps, weight, prologue, k, rope=None):
    """y [M, N] (and s, x2 + delta2, when delta2 is given) for x2's rows: one kernel. k: the
    GEMV's input width (x2's, or half of it for SiLU·up); rope: the epilogue, or None."""
    n, group_size, (w, scales, zeros, swn, swk, ssn, szn), int4, has_zeros, block_k = \
        _weight_args(weight, x2[:, :k])
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    s = torch.empty_like(x2) if delta2 is not None else x2
    epilogue, epilogue_consts = _rope_args(rope, m, n, y)
    if m == 0 or n == 0:
        return s, y
    d = delta2 if delta2 is not None else x2
    nw = norm_weight if norm_weight is not None else x2
    block_n, warps, unroll = _launch_tiles(n, k, int4, block_k, x2.element_size())
    _decode_gemv_kernel[(cdiv(n, block_n), m)](
        x2, d, nw, s, w, scales, zeros, y, n, k, float(eps), group_size,
        x2.stride(0), d.stride(0), s.stride(0), swn, swk, ssn, szn, y.stride(0), *epilogue,
        PROLOGUE=prologue, HAS_DELTA=delta2 is not None, INT4=int4, HAS_ZEROS=has_zeros,
        BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll,
        NORM_BLOCK=_dense_block_k(k) if prologue == _NORM else 16, **epilogue_consts,
        num_warps=warps)
    return s, y


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [..., K] Wᵀ -> [..., N] (W float [N, K] of x's dtype, or an Int4Weight)."""
    k = x.shape[-1] if x.dim() else 0
    x2 = _rows(x, "x", k)
    _, y = _launch(x2, None, None, 0.0, weight, _NONE, k)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight, rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s) Wᵀ) with s = x + delta (delta None: s = x), in one kernel. x, delta
    [..., K] of one dtype; norm_weight [K] of that dtype. With rope (W: q|k|v's weight), the
    product's q and k heads come out rotated and, with rope.kv, k and v are stored in the
    caches: the bits of this product then `glue.rope_kv` on its [M, H, D] view."""
    k = x.shape[-1] if x.dim() else 0
    x2 = _rows(x, "x", k)
    delta2 = None
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
            raise ValueError(f"delta must match x: {tuple(x.shape)} {x.dtype} on {x.device}, "
                             f"got {tuple(delta.shape)} {delta.dtype} on {delta.device}")
        delta2 = _rows(delta, "delta", k)
    if (not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (k,)
            or norm_weight.dtype != x.dtype or norm_weight.device != x.device
            or norm_weight.stride(0) != 1):
        raise ValueError(f"norm_weight must be a contiguous [{k}] {x.dtype} tensor on {x.device} "
                         f"like x, got {getattr(norm_weight, 'shape', norm_weight)!r}")
    s, y = _launch(x2, delta2, norm_weight, eps, weight, _NORM, k, rope)
    lead = x.shape[:-1]
    return s.reshape(*lead, k), y.reshape(*lead, y.shape[-1])


def silu_mul_linear(gate_up: torch.Tensor, weight) -> torch.Tensor:
    """(silu(gate) * up) Wᵀ for gate_up [..., 2I] = [gate | up]; W reads K = I columns."""
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate | up), got {width}")
    x2 = _rows(gate_up, "gate_up", width)
    _, y = _launch(x2, None, None, 0.0, weight, _SILU, width // 2)
    return y.reshape(*gate_up.shape[:-1], y.shape[-1])
