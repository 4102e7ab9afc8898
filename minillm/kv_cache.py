"""The contiguous KV cache: one preallocated [batch, max_seq, kv_heads, head_dim] buffer per
layer for K and for V.

This is the cache of Lab 02 and of `minillm.generate`. Paged storage for the serving engine
lives in `minillm.paged`.

Invariants:
- Slots [0, start_pos + T) of every row hold the K/V of positions 0 .. start_pos+T-1 after a
  step that wrote T tokens at `start_pos`; nothing beyond is ever read.
- A write that does not fit (start_pos < 0 or start_pos + T > max_seq) raises ValueError and
  leaves the cache unchanged.
"""
from __future__ import annotations

import torch

from .config import ModelConfig


def kv_cache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                    v_new: torch.Tensor, start_pos: int) -> None:
    """Write k_new/v_new [B, T, Hkv, D] into the caches [B, max_seq, Hkv, D] at
    positions start_pos .. start_pos+T-1, in place."""
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} differ")
    if k_new.dim() != 4 or k_new.shape[0] != k_cache.shape[0] or k_new.shape[2:] != k_cache.shape[2:]:
        raise ValueError(f"new K/V must be [B, T, Hkv, D] = [{k_cache.shape[0]}, T, "
                         f"{k_cache.shape[2]}, {k_cache.shape[3]}], got {tuple(k_new.shape)}")
    T, max_seq = k_new.shape[1], k_cache.shape[1]
    if not 0 <= start_pos <= max_seq - T:
        raise ValueError(f"cannot write {T} tokens at position {start_pos}: the cache holds "
                         f"positions 0..{max_seq - 1} (max_seq={max_seq})")
    k_cache[:, start_pos:start_pos + T] = k_new
    v_cache[:, start_pos:start_pos + T] = v_new


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     start_pos: int, key_padding_mask: torch.Tensor | None = None,
                     sm_scale: float | None = None) -> torch.Tensor:
    """Attention of T new queries over everything cached so far.

    q: [B, T, Hq, D] for positions start_pos .. start_pos+T-1. The caches must already hold
    those tokens' K/V. Query t sees keys 0 .. start_pos+t (causal). key_padding_mask
    [B, >= start_pos+T] bool marks real (True) versus padding (False) slots.
    Returns [B, T, Hq, D].
    """
    B, T, Hq, D = q.shape
    S = start_pos + T
    k = k_cache[:, :S].transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache[:, :S].transpose(1, 2)
    mask = None
    if T > 1:
        # Query t (absolute position start_pos+t) may see key s when s <= start_pos + t.
        q_pos = torch.arange(start_pos, S, device=q.device)[:, None]
        mask = torch.arange(S, device=q.device)[None, :] <= q_pos  # [T, S]
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, None, :S]  # [B, 1, 1, S]
        mask = pad if mask is None else (mask[None, None] & pad)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, scale=sm_scale,
        enable_gqa=Hq != k.shape[1])
    return out.transpose(1, 2)


class KVCache:
    """Per-layer K and V buffers for a batch of sequences that advance together."""

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device=None):
        """Buffers on ``device`` (None: ``minillm.devices.default_device()``)."""
        from .devices import resolve_device

        device = resolve_device(device)
        if max_seq_len > config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's context length "
                             f"{config.max_position_embeddings}")
        shape = (batch_size, max_seq_len, config.num_kv_heads, config.head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
