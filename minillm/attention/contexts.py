"""Attention contexts for the contiguous world: where K/V live when there is no paging.

A context owns storage; a backend (`minillm.attention.backends`) owns the math. The model
calls `ctx.attend(layer_idx, q, k, v, kv_stored)` with q [B, T, Hq, D] and k/v [B, T, Hkv, D]
(after RoPE) and gets [B, T, Hq, D] back. Before that it asks `ctx.kv_write(layer_idx)`: a
context may return a `minillm.layers.fused.KVWrite` (where this step's K/V go), and then the
layer stores K/V itself (fused with RoPE on CUDA) and calls attend with kv_stored=True;
None (these two contexts) means attend stores them.

- `NoCacheContext`: full causal attention over this pass's T tokens; nothing is stored.
- `ContiguousCacheContext`: append this step's K/V to a `KVCache` row block at
  `start_pos`, then attend over everything cached (Lab 02, `minillm.generate`). A decode
  step (one query per row, no padding) over an fp32 or bf16 CPU cache with the torch
  backend reads the cache in place with the C++ decode kernel where this host measured it
  faster than SDPA (`minillm.attention.cpu_decode`); the math is the same.

The paged context of the serving engine is `minillm.attention.paged`.
"""
from __future__ import annotations

import torch

from ..kv_cache import kv_cache_append
from . import cpu_decode


class NoCacheContext:
    """Full causal attention over the T tokens of this forward pass; nothing is stored."""

    def __init__(self, backend, key_padding_mask=None):
        self.backend = backend
        self.key_padding_mask = key_padding_mask

    def kv_write(self, layer_idx):
        return None  # nothing is stored

    def attend(self, layer_idx, q, k, v, kv_stored=False):  # [B, T, H, D] in, [B, T, Hq, D] out
        out = self.backend.dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 causal=True, key_padding_mask=self.key_padding_mask)
        return out.transpose(1, 2)


class ContiguousCacheContext:
    """Append this step's K/V to a `KVCache` at `start_pos`, then attend over the cache.

    `append_fn` and `attend_fn` default to minillm's reference; Lab 02 plugs in the
    student's own functions with the same signatures (see `minillm.kv_cache`).
    """

    def __init__(self, backend, cache, start_pos: int, key_padding_mask=None,
                 append_fn=None, attend_fn=None):
        self.backend = backend
        self.cache = cache
        self.start_pos = start_pos
        self.key_padding_mask = key_padding_mask
        self.append_fn = append_fn
        self.attend_fn = attend_fn
        # Decided at the first decode step (`_takes_kernel`): can the kernel serve this
        # cache at all, then per bucket of context lengths, does it. `_decode` runs it.
        self._decode_kernel, self._by_bucket = None, {}
        self._decode = cpu_decode.ContiguousDecode(cache.k[0].shape[0])

    def kv_write(self, layer_idx):
        return None  # attend appends through append_fn (Lab 02's seam)

    def attend(self, layer_idx, q, k, v, kv_stored=False):
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        (self.append_fn or kv_cache_append)(k_cache, v_cache, k, v, self.start_pos)
        if self.attend_fn is not None:
            return self.attend_fn(q, k_cache, v_cache, self.start_pos)
        S = self.start_pos + q.shape[1]
        if q.shape[1] == 1 and self._takes_kernel(q, k_cache, S):
            return self._decode(q[:, 0], k_cache, v_cache, S)[:, None]
        out = self.backend.dense(q.transpose(1, 2), k_cache[:, :S].transpose(1, 2),
                                 v_cache[:, :S].transpose(1, 2), causal=True,
                                 key_padding_mask=self.key_padding_mask)
        return out.transpose(1, 2)

    def _takes_kernel(self, q, k_cache, length: int) -> bool:
        """Does this decode step's attention (over `length` cached positions) run the C++
        kernel? Decided once per context and bucket of lengths (the cache, backend and
        mask do not change; 30 layers ask per step), except autograd and torch.compile,
        asked each time: the kernel has no backward, and a compiled step is one graph (SDPA
        inside it; the pybind kernel would break it)."""
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and q.requires_grad):
            return False
        if self._decode_kernel is None:
            self._decode_kernel = (
                self.key_padding_mask is None and getattr(self.backend, "name", None) == "torch"
                and q.dtype == k_cache.dtype and k_cache.is_contiguous()
                and cpu_decode.supports(k_cache) and cpu_decode.load_kernel() is not None)
        if not self._decode_kernel:
            return False
        bucket = cpu_decode.context_bucket(length)
        if bucket not in self._by_bucket:
            self._by_bucket[bucket] = cpu_decode.contiguous_preferred(length, k_cache.dtype)
        return self._by_bucket[bucket]
