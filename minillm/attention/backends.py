"""Attention backends: how attention is computed (plain PyTorch or Triton kernels).

The model computes q, k, v and RoPE, then hands them to an *attention context* (how K/V are
stored: none, a contiguous cache, a paged cache) which calls a *backend* (how attention is
computed: plain PyTorch or Triton kernels). Contexts own storage; backends own math.

Every backend implements the same three operations, with these layouts:

- `dense(q [B,Hq,T,D], k/v [B,Hkv,S,D], causal, key_padding_mask [B,S] | None)`.
  Causal masking is bottom-right aligned: query t sees keys s <= t + (S - T), so a chunk of
  T new queries over S >= T keys (a cached prefix plus itself) is masked correctly.
- `varlen(q [Nq,Hq,D], k/v [Nk,Hkv,D], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k)`: packed sequences, causal, bottom-right aligned per sequence.
- `paged_decode(q [B,Hq,D], k_cache/v_cache [num_blocks, block_size, Hkv, D],
  block_tables [B, max_blocks] int32, context_lens [B] int32)`: one query per sequence.

GQA is handled inside each backend (query head h uses KV head h // (Hq // Hkv)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _bottom_right_causal_mask(T: int, S: int, device) -> torch.Tensor:
    q_pos = torch.arange(S - T, S, device=device)[:, None]
    return torch.arange(S, device=device)[None, :] <= q_pos  # [T, S] bool, True = visible


def decode_attention(q, k, v, key_padding_mask=None, sm_scale=None):
    """One query per sequence: q [B, Hq, D], k/v [B, Hkv, S, D] -> [B, Hq, D].

    The G = Hq / Hkv query heads that share a KV head become G queries of one attention
    over that head (q viewed as [B, Hkv, G, D]), so each KV head is read once, not G
    times: ~2x faster than SDPA's own GQA handling for decode on a CPU. Same math: query
    head h uses KV head h // G either way (G = 1 for MHA). key_padding_mask [B, >= S]
    marks real keys.
    """
    B, Hq, D = q.shape
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :k.shape[2]].bool()
    out = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], Hq // k.shape[1], D), k, v,
                                         attn_mask=mask, scale=sm_scale)
    return out.reshape(B, Hq, D)


class TorchBackend:
    """Reference backend built on `scaled_dot_product_attention`."""

    name = "torch"
    # May `paged_decode` run inside a CUDA graph (fixed shapes, no host sync)? Not this
    # reference: it reads each sequence's context length back to the host.
    graph_safe = False

    def dense(self, q, k, v, causal=True, key_padding_mask=None, sm_scale=None):
        T, S = q.shape[2], k.shape[2]
        if T == 1:  # a decode step: one query sees every key, so causality is moot
            return decode_attention(q[:, :, 0], k, v, key_padding_mask, sm_scale)[:, :, None]
        gqa = q.shape[1] != k.shape[1]
        if key_padding_mask is None and (not causal or T == S):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  scale=sm_scale, enable_gqa=gqa)
        mask = _bottom_right_causal_mask(T, S, q.device) if causal else None
        if key_padding_mask is not None:
            pad = key_padding_mask[:, None, None, :S].bool()
            mask = pad if mask is None else (mask & pad)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale,
                                              enable_gqa=gqa)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
               max_seqlen_k=None, sm_scale=None, cu_seqlens_host=None):
        """cu_seqlens_host: (cu_seqlens_q, cu_seqlens_k) as host ints, when the caller has
        them: splitting the rows by the device tensors reads them back (a sync on CUDA)."""
        out = torch.empty_like(q)
        cq, ck = cu_seqlens_host or (cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
        for i in range(len(cq) - 1):
            qs = q[cq[i]:cq[i + 1]].transpose(0, 1)[None]  # [1, Hq, Tq, D]
            ks = k[ck[i]:ck[i + 1]].transpose(0, 1)[None]
            vs = v[ck[i]:ck[i + 1]].transpose(0, 1)[None]
            out[cq[i]:cq[i + 1]] = self.dense(qs, ks, vs, True, None, sm_scale)[0].transpose(0, 1)
        return out

    def paged_decode(self, q, k_cache, v_cache, block_tables, context_lens, sm_scale=None):
        from .paged_ref import paged_decode_attention_ref
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens,
                                          sm_scale=sm_scale)


class TritonBackend(TorchBackend):
    """FlashAttention-2 style Triton kernels (the interpreter runs them on CPU, in fp32).

    Dense attention with a key padding mask (static batching with left padding) has no
    kernel, so it falls back to the reference; everything else runs the kernels.
    """

    name = "triton"
    graph_safe = True  # the paged-decode kernel reads lengths and block tables on the device
    # ((B, S, device), block_tables, context_lens) of the last eager decode step: see
    # `_decode_tables`. One entry: every layer of a step asks with the same (B, S).
    _last_tables: tuple | None = None

    def _decode_tables(self, B: int, S: int, device: torch.device):
        """(block_tables [B, 1] = row b -> block b, context_lens [B] = S), int32: how `dense`
        hands a contiguous cache of S positions to the paged decode kernel.

        Made once per step, not once per layer (on CUDA that saves 2 tiny kernels per layer,
        60 per SmolLM2 step): kept for the last (B, S, device) asked. Sound because nothing
        writes them: `paged_decode_attention` only loads both (its `.to(torch.int32)` is the
        tensor itself) and they go nowhere else. Neither kept nor reused, but made afresh as
        before, (1) while torch.compile traces: S may be symbolic (comparing it would
        specialize the graph) and fresh ops simply become part of the graph; (2) while a
        CUDA graph is captured: a tensor made inside a capture holds its values only once
        the graph replays (capture records the fill, it does not run it), so an eager step
        reusing it before a replay would read garbage; and a kept tensor read by the graph
        would be freed when the next step replaces it, while the graph still points at it.
        Made inside the capture, they live in the graph's own memory pool, as before."""
        fresh = torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        key = (B, S, device)
        last = None if fresh else self._last_tables  # `fresh` first: a trace must not compare S
        if last is not None and last[0] == key:
            return last[1], last[2]
        block_tables = torch.arange(B, dtype=torch.int32, device=device)[:, None]
        context_lens = torch.full((B,), S, dtype=torch.int32, device=device)
        if not fresh:
            self._last_tables = (key, block_tables, context_lens)
        return block_tables, context_lens

    def dense(self, q, k, v, causal=True, key_padding_mask=None, sm_scale=None):
        if key_padding_mask is not None:
            return super().dense(q, k, v, causal, key_padding_mask, sm_scale)
        from ..kernels import flash_attention, paged_decode_attention
        B, T, S = q.shape[0], q.shape[2], k.shape[2]
        if T == 1:
            # One new token per row over a contiguous cache: that cache is a paged cache
            # whose block_size is S and whose row b is block b, so the decode kernel (one
            # program per KV head, not per query tile) serves it.
            block_tables, context_lens = self._decode_tables(B, S, q.device)
            out = paged_decode_attention(q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2),
                                         block_tables, context_lens, sm_scale=sm_scale)
            return out[:, :, None]
        return flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
               max_seqlen_k=None, sm_scale=None, cu_seqlens_host=None):
        from ..kernels import flash_attention_varlen
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, causal=True, sm_scale=sm_scale)

    def paged_decode(self, q, k_cache, v_cache, block_tables, context_lens, sm_scale=None):
        from ..kernels import paged_decode_attention
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                      sm_scale=sm_scale)


BACKENDS = {"torch": TorchBackend, "triton": TritonBackend}


def get_backend(name_or_backend) -> TorchBackend:
    if not isinstance(name_or_backend, str):
        return name_or_backend
    try:
        return BACKENDS[name_or_backend]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name_or_backend!r}; "
                         f"choose one of {sorted(BACKENDS)}") from None
