"""The tensor half of a paged KV cache: per-layer K and V storage cut into blocks.

Layout per layer: `k_caches[layer]`, `v_caches[layer]` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token slot s (from
`BlockManager.slot_mapping`) is row s of the flat view `[num_blocks * block_size, Hkv, D]`,
i.e. block s // block_size, offset s % block_size. Which block belongs to which sequence
is decided by `minillm.paged.block_pool` and `block_manager`; this module only moves bytes.

Invariants:
- After `write(layer, k, v, slots)`, flat row slots[i] of that layer holds k[i] / v[i];
  no other row changes.
- `copy_blocks([(src, dst), ...])` makes block dst equal block src in every layer, K and V
  (copy-on-write after a fork); dst blocks are fresh, never a src of the same call.
- One row past the last block, `trash_slot` (= num_blocks * block_size), belongs to no
  block: a write to it changes nothing any sequence reads. The padded rows of a CUDA-graph
  decode batch (`minillm.engine.cuda_graph`) write there, so the captured step needs no
  branch and no mask to skip them.
- `block_table_tensor` pads short tables with 0, a valid block id: kernels read only the
  entries below cdiv(context_len, block_size), and a stray read of the padding stays in
  bounds instead of reading outside the cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..devices import resolve_device


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError("num_layers, num_blocks, block_size, num_kv_heads and head_dim "
                             "must all be >= 1")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        device = resolve_device(device)  # None: minillm.devices.default_device()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Flat storage [slots + 1 trash row, Hkv, D] per layer; the caches view its blocks.
        flat = (num_blocks * block_size + 1, num_kv_heads, head_dim)
        self._k_flat = [torch.zeros(flat, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v_flat = [torch.zeros(flat, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_caches = [f[:-1].view(shape) for f in self._k_flat]
        self.v_caches = [f[:-1].view(shape) for f in self._v_flat]

    @property
    def device(self) -> torch.device:
        return self.k_caches[0].device

    @property
    def trash_slot(self) -> int:
        """The slot that belongs to no block: writes to it are discarded (see the module doc)."""
        return self.num_blocks * self.block_size

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V: block_size tokens of
        `calc.kv_cache_bytes_per_token` (the one formula)."""
        from .. import calc
        elem = torch.empty((), dtype=dtype).element_size()
        return int(block_size * calc.kv_cache_bytes_per_token(num_layers, num_kv_heads,
                                                              head_dim, elem))

    def nbytes(self) -> int:
        """The bytes this cache holds, allocated up front: every layer's K and V storage,
        the trash row included (`bytes_per_block() * num_blocks` plus that row)."""
        return sum(t.numel() * t.element_size() for t in self._k_flat + self._v_flat)

    def bytes_per_block(self) -> int:
        return self.block_bytes(self.num_layers, self.block_size, self.num_kv_heads,
                                self.head_dim, self.dtype)

    @classmethod
    def num_blocks_for_budget(cls, budget_bytes: int, num_layers: int, block_size: int,
                              num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """How many whole blocks fit in `budget_bytes` (raises if not even one)."""
        per_block = cls.block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        n = int(budget_bytes) // per_block
        if n < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block: one block "
                             f"takes {per_block} bytes; raise the budget or shrink block_size")
        return n

    @classmethod
    def from_budget(cls, budget_bytes: int, num_layers: int, block_size: int,
                    num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> PagedKVCache:
        n = cls.num_blocks_for_budget(budget_bytes, num_layers, block_size, num_kv_heads,
                                      head_dim, dtype)
        return cls(num_layers, n, block_size, num_kv_heads, head_dim, dtype, device)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's K and V storage as rows [trash_slot + 1, Hkv, D]: row s is slot s (the
        view a fused RoPE + K/V store writes through slot_mapping)."""
        return self._k_flat[layer], self._v_flat[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor | Sequence[int]) -> None:
        """Store k, v `[N, Hkv, D]` of N tokens into their slots `slot_mapping[N]` (a slot
        in [0, trash_slot]; `trash_slot` discards the row)."""
        kc, vc = self._k_flat[layer], self._v_flat[layer]
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != kc.shape[1:]:
            raise ValueError(f"k and v must both be [N, {self.num_kv_heads}, {self.head_dim}]; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        slots = torch.as_tensor(slot_mapping, dtype=torch.long, device=kc.device).reshape(-1)
        if slots.numel() != k.shape[0]:
            raise ValueError(f"slot_mapping has {slots.numel()} slots for {k.shape[0]} tokens")
        kc.index_copy_(0, slots, k.to(kc.dtype))
        vc.index_copy_(0, slots, v.to(vc.dtype))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer, K and V (copy-on-write)."""
        if not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.long).t()  # [2, P]: sources, destinations
        if self.device.type == "cuda":  # from pinned memory: no wait for the step in flight
            idx = idx.contiguous().pin_memory().to(self.device, non_blocking=True)
        src, dst = idx[0], idx[1]
        for cache in self.k_caches + self.v_caches:
            cache.index_copy_(0, dst, cache.index_select(0, src))


def block_table_tensor(block_tables: Sequence[Sequence[int]],
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Stack per-sequence block tables into int32 `[B, max_blocks]`, right-padded with 0.
    The width is the longest table (at least 1, so the tensor is never zero-width)."""
    width = max([len(t) for t in block_tables] + [1])
    out = torch.zeros((len(block_tables), width), dtype=torch.int32)
    for i, table in enumerate(block_tables):
        out[i, :len(table)] = torch.tensor(list(table), dtype=torch.int32)
    return out.to(resolve_device(device))
