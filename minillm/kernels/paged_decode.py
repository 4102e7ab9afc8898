"""Decode attention over a paged KV cache (one new query token per sequence), in Triton.

Cache layout (per layer): ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, D]``.
Token position ``t`` of sequence ``b`` lives in block ``block_tables[b, t // block_size]``
at offset ``t % block_size`` (slot = block_id * block_size + offset). Only the first
``context_lens[b]`` positions are read; block-table entries past them are never touched
(they may hold anything, e.g. -1 or stale ids).

Design:

* One program per (sequence, KV head, split). It handles *all* ``Hq // Hkv`` query heads
  that share that KV head, as the rows of a ``[BLOCK_H, D]`` query tile padded with zero
  rows to ``BLOCK_H >= 16`` (``tl.dot`` needs every dim >= 16). The padding wastes
  tensor-core flops, but decode is memory-bound: what counts is that each K/V row is
  loaded once per KV head instead of once per query head (3x less traffic for
  SmolLM2's 9 q / 3 kv heads). The elementwise-multiply + ``tl.sum`` alternative would
  avoid the padding but re-read K/V for every query head or spill registers.
* K/V rows are gathered token by token through the block table, so the key tile
  ``BLOCK_N`` is independent of the cache's ``block_size``.
* Split-K (FlashDecoding): with few sequences a long context would keep only
  ``B * Hkv`` programs busy, so the context is cut into ``num_splits`` ranges processed in
  parallel. Each writes a partial output (already divided by its own ``l``) and its
  log-sum-exp; a second small kernel combines them:
  ``out = sum_s exp(lse_s - max lse) * out_s / sum_s exp(lse_s - max lse)``.
  With one split the first kernel writes the final output directly.
* Online softmax in fp32, base 2 (see ``flash_attention_kernel.py``). A split that holds no
  token (context shorter than the split's start) has l = 0 and lse = -inf, weight 0.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import tuning
from ._dot import dot
from .interpreter import interpreter_enabled
from ._checks import _check_device_dtype, _check_heads, _check_out, _is_integer
from ._grid import cdiv, next_power_of_2
from .flash_attention import _block_d
from .flash_attention_kernel import LOG2E

__all__ = ["paged_decode_attention"]

CPU_BLOCK_N = 64  # interpreter: one fixed key tile


# The block table's width (its row stride) and the split length change with the step's
# longest context: never specialized on, so a serving run compiles one program per config.
@triton.jit(do_not_specialize=["stride_btb", "tokens_per_split"])
def _paged_decode_kernel(
    Q, KC, VC, BlockTables, ContextLens, Out, Lse,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_kt, stride_kh, stride_kd,
    stride_vblk, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    group, block_size, tokens_per_split, head_dim, qk_scale,
    STORE_LSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # torch.compile (Inductor) passes a Python float as fp64: in fp64 the scores, and through
    # them acc, would no longer be the fp32 that tl.dot accumulates into.
    qk_scale = tl.cast(qk_scale, tl.float32)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ContextLens + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)

    offs_h = tl.arange(0, BLOCK_H)  # row r is query head kvh * group + r
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < group
    d_mask = offs_d < head_dim
    heads = (kvh * group + offs_h).to(tl.int64)
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    k_head = KC + kvh.to(tl.int64) * stride_kh
    v_head = VC + kvh.to(tl.int64) * stride_vh
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0  # logical token positions
        n_mask = offs_n < end
        block_id = tl.load(BlockTables + b64 * stride_btb + (offs_n // block_size) * stride_btn,
                           mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % block_size
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head + (block_id * stride_kblk + in_block * stride_kt)[:, None]
                    + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k)) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # start_n < end, so every tile holds >= 1 real key and m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (block_id * stride_vblk + in_block * stride_vt)[:, None]
                    + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None]
        acc = dot(p.to(v.dtype), v, acc)
        m_i = m_new

    empty = l_i == 0.0  # this split holds no token of the sequence
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptr = Out + b64 * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # base 2
        tl.store(Lse + b64 * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    Partial, Lse, Out, num_splits, head_dim,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + offs_s * stride_ls, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # context_len 0: every weight is 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    part = tl.load(Partial + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :] * stride_pd, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=d_mask)


# Tiles: BLOCK_N keys per step; the bucket is the kernel's shape class (see tuning.py).
PAGED_DECODE = tuning.register(tuning.Tunable(
    name="paged_decode", fn=_paged_decode_kernel,
    configs=tuple(triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
                  for bn in (32, 64, 128) for w in (2, 4) for st in (2, 3)),
    default=triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
    interpreter=triton.Config({"BLOCK_N": CPU_BLOCK_N}, num_warps=4, num_stages=1),
    bucket_space={"D": (16, 32, 64, 128, 256), "H": (16, 32, 64, 128), "dt": (16, 32),
                  "lse": (0, 1)},
    signature={"Q": "*{dt}", "KC": "*{dt}", "VC": "*{dt}", "BlockTables": "*i32",
               "ContextLens": "*i32", "Out": "*fp32", "Lse": "*fp32", "qk_scale": "fp32"},
    constexprs=lambda b: {"STORE_LSE": bool(b["lse"]), "BLOCK_H": b["H"], "BLOCK_D": b["D"]},
    unit_strides=("stride_qd", "stride_kd", "stride_vd", "stride_btn", "stride_od"),
))


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Split-K costs a second launch (the combine kernel), which pays only when each split still
# reads a long stretch of context. On an H100 (BENCHMARKS.md, "Measured on a GPU") a launch
# cost ~30 us whatever it read, so at context 1024 four splits of 256 tokens took 60 us
# against 30 us for one launch: every split holds at least this many positions.
MIN_SPLIT_TOKENS = 1024


def _num_splits_for(batch: int, hkv: int, max_tokens: int, sms: int) -> int:
    """Split-K count: about two waves of (sequence, KV head, split) programs over `sms`
    multiprocessors, and never a split of fewer than MIN_SPLIT_TOKENS positions (so
    contexts shorter than 2 * MIN_SPLIT_TOKENS run as one launch, without the combine)."""
    want = cdiv(2 * sms, batch * hkv)
    return max(1, min(want, max_tokens // MIN_SPLIT_TOKENS))


def _default_num_splits(batch: int, hkv: int, max_tokens: int) -> int:
    if interpreter_enabled():
        return 1  # more programs only cost time in the interpreter
    sms = _sm_count(torch.device("cuda", torch.cuda.current_device()))
    return _num_splits_for(batch, hkv, max_tokens, sms)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None = None,
    *,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    q ``[B, Hq, D]``; k_cache, v_cache ``[num_blocks, block_size, Hkv, D]``;
    block_tables ``[B, max_blocks]``; context_lens ``[B]`` with
    ``1 <= context_lens[b] <= max_blocks * block_size``; both int32, or any integer dtype
    such as int64 (converted to int32; float dtypes are refused). The query is the newest
    token, whose K/V must already be in the cache, so it sees all ``context_lens[b]``
    positions (no mask needed beyond the length). ``sm_scale`` defaults to ``1 / sqrt(D)``.
    ``num_splits`` (split-K over the context) defaults to 1 on the interpreter and to a
    GPU-occupancy heuristic on CUDA; the splits cut ``max_context_len`` positions, which
    defaults to the block table's width ``max_blocks * block_size`` (pass the true maximum,
    known on the host, so that no split is spent on positions no sequence has). Returns ``[B, Hq, D]`` in q's dtype (written into
    ``out`` if given: same shape, dtype and device as q).

    Block-table and length *values* are checked only for CPU tensors (checking CUDA
    tensors would cost a host sync on every decode step).
    """
    names = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
             "context_lens": context_lens}
    for name, t in names.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D] (rank 3, one token per sequence); got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    bsz, hq, d = q.shape
    num_blocks, block_size, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"cache head_dim {dk} differs from q head_dim {d}")
    _check_heads(hq, hkv, d)
    _check_device_dtype({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or not _is_integer(block_tables):
        raise ValueError(f"block_tables must be int32 [B={bsz}, max_blocks], or another integer "
                         f"dtype such as torch.int64 (converted to int32); got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if context_lens.shape != (bsz,) or not _is_integer(context_lens):
        raise ValueError(f"context_lens must be int32 [B={bsz}], or another integer dtype such as "
                         f"torch.int64 (converted to int32); got {tuple(context_lens.shape)} "
                         f"{context_lens.dtype}")
    for name in ("block_tables", "context_lens"):
        if names[name].device != q.device:
            raise ValueError(f"{name} is on {names[name].device} but q is on {q.device}")
    table_tokens = block_tables.shape[1] * block_size
    if max_context_len is not None and not 1 <= max_context_len <= table_tokens:
        raise ValueError(f"max_context_len={max_context_len} must be in [1, max_blocks * block_size "
                         f"= {table_tokens}]")
    max_tokens = table_tokens if max_context_len is None else int(max_context_len)
    if q.device.type == "cpu" and bsz > 0:
        if int(context_lens.min()) < 1 or int(context_lens.max()) > max_tokens:
            raise ValueError(f"context_lens must be in [1, max_context_len or max_blocks * block_size "
                             f"= {max_tokens}]; got {context_lens.tolist()}")
        for i, n in enumerate(context_lens.tolist()):
            used = block_tables[i, : cdiv(n, block_size)]
            if bool(((used < 0) | (used >= num_blocks)).any()):
                raise ValueError(f"block_tables[{i}] uses block ids {used.tolist()} for its "
                                 f"{n} tokens; valid ids are 0..{num_blocks - 1}")
    # The kernel reads int32. Converted after the value checks, so on CPU every value it
    # reads is known to fit; an int32 tensor is used as is (no copy).
    block_tables, context_lens = block_tables.to(torch.int32), context_lens.to(torch.int32)

    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    out = _check_out(out, q)
    if bsz == 0:
        return out
    if num_splits is None:
        num_splits = _default_num_splits(bsz, hkv, max_tokens)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = min(num_splits, max(1, max_tokens))
    tokens_per_split = cdiv(max_tokens, num_splits)
    group = hq // hkv

    if num_splits == 1:  # write the final output directly, viewed as [B, Hq, 1, D]
        # Lse is never written (STORE_LSE=False); a tensor of its own, not `out` again:
        # torch.compile treats each pointer a kernel may store to as a separate output, and
        # two aliases of `out` could be copied back in the wrong order.
        partial, lse = out, out.new_empty(0)
        p_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        l_strides = (0, 0, 0)
    else:
        partial = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
        p_strides, l_strides = partial.stride(), lse.stride()
    args = (q, k_cache, v_cache, block_tables, context_lens, partial, lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
            *p_strides, *l_strides, group, block_size, tokens_per_split, d, sm_scale * LOG2E)
    meta = dict(STORE_LSE=num_splits > 1, BLOCK_H=max(16, next_power_of_2(group)),
                BLOCK_D=_block_d(d))
    bucket = {"D": meta["BLOCK_D"], "H": min(meta["BLOCK_H"], 128),
              "dt": tuning.dtype_bits(q.dtype), "lse": int(meta["STORE_LSE"])}
    grid = (bsz, hkv, num_splits)
    PAGED_DECODE.run(bucket, lambda cfg: _paged_decode_kernel[grid](
        *args, **meta, **tuning.launch_options(cfg)), q.device)

    if num_splits > 1:
        _combine_splits_kernel[(bsz, hq)](
            partial, lse, out, num_splits, d, *partial.stride(), *lse.stride(), *out.stride(),
            BLOCK_S=max(2, next_power_of_2(num_splits)), BLOCK_D=_block_d(d))
    return out
