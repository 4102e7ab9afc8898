"""Reference paged attention in plain PyTorch: the oracle for the paged Triton kernels.

K/V are read through the block table: position t of sequence b is at
`k_cache[block_tables[b, t // block_size], t % block_size]`, caches being
`[num_blocks, block_size, Hkv, D]`. GQA: query head h reads KV head h // (Hq // Hkv).

One function does the work, `paged_prefill_attention_ref`: sequence b contributes the
packed queries q[query_start_loc[b] : query_start_loc[b+1]], which are the LAST query_len_b
of its context_lens[b] tokens (their K/V already written into the cache). Causal: query i
sits at absolute position context_len - query_len + i and sees keys at positions <= that.
Decode is the case query_len == 1 (the newest token sees its whole context), so
`paged_decode_attention_ref` just builds query_start_loc = [0, 1, ..., B] and calls it.

Softmax runs in fp32; the result is cast back to q's dtype. Written for clarity (a Python
loop over sequences), not speed.
"""
from __future__ import annotations

import math

import torch


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `context_len` K and V rows of one sequence, contiguous: `[L, Hkv, D]`."""
    block_size = k_cache.shape[1]
    num_used = -(-context_len // block_size)
    ids = block_table[:num_used].long()  # entries past the context are never read
    k = k_cache[ids].flatten(0, 1)[:context_len]
    v = v_cache[ids].flatten(0, 1)[:context_len]
    return k, v


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, sm_scale: float | None = None,
                                ) -> torch.Tensor:
    """q `[N, Hq, D]` packed over B sequences -> `[N, Hq, D]` (see the module docstring)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads} for GQA")
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    if len(starts) != len(lens) + 1 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc must be [B+1] = [{len(lens) + 1}] ending at "
                         f"N = {q.shape[0]}; got {starts}")
    out = torch.empty_like(q)
    for b, L in enumerate(lens):
        qs = q[starts[b]:starts[b + 1]].float()                 # [T, Hq, D]
        T = qs.shape[0]
        if not 0 <= T <= L:
            raise ValueError(f"sequence {b} has {T} queries but context_len {L}: the queries "
                             f"are the last tokens of the context, so need T <= context_len")
        k, v = gather_kv(k_cache, v_cache, block_tables[b], L)
        k = k.float().repeat_interleave(group, dim=1)            # [L, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", qs, k) * scale     # [Hq, T, L]
        q_pos = torch.arange(L - T, L)[:, None]
        visible = torch.arange(L)[None, :] <= q_pos             # [T, L], causal
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[b]:starts[b + 1]] = torch.einsum("hts,shd->thd", probs, v).to(q.dtype)
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               sm_scale: float | None = None) -> torch.Tensor:
    """One query per sequence, q `[B, Hq, D]`, over its context_lens[b] cached tokens."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc,
                                       context_lens, sm_scale)
