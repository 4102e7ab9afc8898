"""The attention context of the serving engine: K/V live in a paged cache, and one forward
pass carries the flattened tokens of many sequences (decodes and prefill chunks together).

`PagedAttentionMetadata.build` turns the step's sequences (block_table, start, query_len),
decodes (query_len == 1) FIRST, into tensors shared by every layer:

- `slot_mapping [N]`: the cache slot of each new token,
  slot = block_table[pos // block_size] * block_size + pos % block_size;
- for the decodes: block tables / context lengths (for the kernels), plus, for the
  "gather" path only, the same information as padded slot indices [n, Lmax] and key masks,
  one per group of decodes with similar context lengths;
- for the prefill chunks: cu_seqlens of queries and of keys (each chunk attends to its
  cached prefix and itself: context = start + query_len) and the slots of those keys.

`PagedAttentionContext.attend(layer, q, k, v)` (q [1, N, Hq, D]) writes this step's K/V
through slot_mapping first, so a sequence's own new tokens are in the cache when it
attends, then computes decode rows and prefill rows and returns [1, N, Hq, D]. Where the
Triton glue runs (CUDA), the context hands the layer a `KVWrite` instead (`kv_write`): RoPE
stores K/V through slot_mapping in its own pass, and attend skips the write.

`build` works on the host (CPU tensors, no device work and no device sync); the engine's
runner then sends every tensor of the step to the device in one copy (`tensors()`,
`with_tensors()`). `decode_only` makes the metadata of a padded, static decode batch from
tensors already on the device: what a CUDA graph captures (`minillm.engine.cuda_graph`).

Decode rows take one of three paths, a choice that belongs with the attention backend: the
torch backend has two (the C++ kernel on the CPU, or PyTorch's gather), every other backend
has its own paged kernel. `choose_decode_path` is the one place that picks it (the engine
calls it once and records the result in `engine.config.decode_path`):

- "kernel": on the CPU with the torch backend and an fp32 or bf16 cache, the C++ kernel of
  `minillm.attention.cpu_decode` reads K/V in place through the block tables: the cache is
  read once, with no copy. It is the default there when it builds and the measurement of
  `minillm.cpu_select` found it faster than "gather" on this host (`cpu_decode.preferred`).
- "gather": the PyTorch fast path, used when the kernel is off or cannot be built (and on
  a GPU with the torch backend). `TorchBackend.paged_decode`, the per-sequence reference
  loop, would spend a CPU step in Python overhead at 64 sequences x 30 layers; instead the
  decodes' K/V are gathered with one index op into [n, Lmax, Hkv, D] and attended with one
  SDPA call and a key mask. Same math, tested against the reference. The gather is pure
  memory traffic, and padding every row to the longest context would gather up to 2x the
  real K/V when lengths vary (16..512 in the benchmark). So decodes are grouped: the runner
  sorts them by context length, and a group is cut when the next length exceeds 1.5x its
  first one (groups keep at least DECODE_GROUP_MIN rows, to bound the number of calls).
- "backend": any other backend (Triton) gets `backend.paged_decode`, its own kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..layers import fused
from ..paged.kv_cache import PagedKVCache, block_table_tensor
from . import cpu_decode
from .backends import decode_attention

DECODE_GROUP_MIN, DECODE_GROUP_RATIO = 8, 1.5
DECODE_PATHS = ("kernel", "gather", "backend")


def choose_decode_path(backend, kv_cache: PagedKVCache, requested: str | None = None) -> str:
    """The decode path for this backend and cache (see the module doc): `requested` if given
    (checked against what this machine can run), else the fastest one available."""
    kernel_ok = cpu_decode.supports(kv_cache.k_caches[0]) and cpu_decode.load_kernel() is not None
    if requested is None:
        if getattr(backend, "name", None) != "torch":
            return "backend"
        return "kernel" if kernel_ok and cpu_decode.preferred() else "gather"
    if requested not in DECODE_PATHS:
        raise ValueError(f"decode_path must be None (choose) or one of {DECODE_PATHS}, "
                         f"got {requested!r}")
    if requested == "kernel" and not kernel_ok:
        raise ValueError(f"decode_path='kernel' needs an fp32 or bf16 cache on the CPU with "
                         f"head_dim a multiple of 8 and the C++ kernel built "
                         f"(MINILLM_CPU_KERNEL not 0); "
                         f"this cache is {kv_cache.dtype} on {kv_cache.device} with head_dim "
                         f"{kv_cache.head_dim}: pass None (choose) or 'gather'")
    return requested


def static_decode_problem(path: str, backend, device: torch.device) -> str | None:
    """Why decode rows on `path` cannot run as a padded batch of fixed shape that a CUDA
    graph may capture (static shapes, no host sync), or None if they can."""
    if path == "gather":
        return ("the gather path's key groups take their shapes from the step's context "
                "lengths")
    if (torch.device(device).type == "cuda" and path == "backend"
            and not getattr(backend, "graph_safe", False)):
        return (f"the {getattr(backend, 'name', type(backend).__name__)} backend's "
                f"paged_decode reads the context lengths back to the host")
    return None


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` (any shape, broadcast against block_table's rows)."""
    return (torch.gather(block_table, -1, positions // block_size) * block_size
            + positions % block_size)


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor          # [N] long
    num_decode_tokens: int              # rows 0 .. num_decode_tokens-1 are decodes
    decode_block_tables: torch.Tensor   # [Bd, max_blocks] int32
    decode_context_lens: torch.Tensor   # [Bd] int32
    # (first row, end row, slots [n, Lmax] long (padding -> slot 0), key mask [n, Lmax] bool)
    decode_groups: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    cu_seqlens_q: torch.Tensor          # [Bp + 1] int32, over the prefill rows only
    cu_seqlens_k: torch.Tensor          # [Bp + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    prefill_key_slots: torch.Tensor     # [sum of contexts] long
    # cu_seqlens_q and cu_seqlens_k as host ints, for a backend that splits the prefill rows
    # in Python (the torch one): reading the device tensors back would sync once per layer.
    cu_seqlens_host: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int]], block_size: int,
              decode_groups: bool = True) -> "PagedAttentionMetadata":
        """seqs: (block_table, start, query_len) per sequence, every query_len == 1 first.
        decode_groups=False skips the gather path's padded slots (the kernels don't read them).
        Every tensor is built on the CPU (move them with `tensors` / `with_tensors`)."""
        device = "cpu"
        lens = [q for _, _, q in seqs]
        nd = 0
        while nd < len(seqs) and lens[nd] == 1:
            nd += 1
        if any(q == 1 for q in lens[nd:]) or any(q < 1 for q in lens):
            raise ValueError("put every query_len == 1 sequence first; query_len must be >= 1")
        tables = block_table_tensor([t for t, _, _ in seqs], device).long()
        starts = torch.tensor([s for _, s, _ in seqs], dtype=torch.long, device=device)
        qlens = torch.tensor(lens, dtype=torch.long, device=device)
        # slot_mapping: row i of `tables` repeated query_len_i times, at start_i + offset.
        row = torch.repeat_interleave(torch.arange(len(seqs), device=device), qlens)
        offset = torch.arange(int(qlens.sum()), device=device) - \
            torch.repeat_interleave(torch.cumsum(qlens, 0) - qlens, qlens)
        slot_mapping = _slots(tables[row], (starts[row] + offset)[:, None], block_size)[:, 0]

        # Decodes: the key at position p < context_len sits in slot _slots(table, p).
        d_ctx, d_tables = starts[:nd] + 1, tables[:nd]
        ctx_list, groups, i = [s + 1 for _, s, _ in seqs[:nd]], [], 0
        while decode_groups and i < nd:
            j = i + 1
            while j < nd and (j - i < DECODE_GROUP_MIN
                              or ctx_list[j] <= DECODE_GROUP_RATIO * ctx_list[i]):
                j += 1
            lmax = max(ctx_list[i:j])
            pos = torch.arange(lmax, device=device).expand(j - i, lmax)
            slots = _slots(d_tables[i:j], pos.clamp(max=d_tables.shape[1] * block_size - 1),
                           block_size)
            key_mask = pos < d_ctx[i:j, None]
            groups.append((i, j, slots.masked_fill(~key_mask, 0), key_mask))
            i = j

        # Prefill chunks: keys are positions 0 .. start + query_len - 1 of each sequence.
        p_ctx = (starts + qlens)[nd:]
        p_row = torch.repeat_interleave(torch.arange(nd, len(seqs), device=device), p_ctx)
        p_pos = torch.arange(int(p_ctx.sum()), device=device) - \
            torch.repeat_interleave(torch.cumsum(p_ctx, 0) - p_ctx, p_ctx)
        key_slots = _slots(tables[p_row], p_pos[:, None], block_size)[:, 0]
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        cu_q = torch.cat([zero, torch.cumsum(qlens[nd:], 0).int()])
        cu_k = torch.cat([zero, torch.cumsum(p_ctx, 0).int()])
        return cls(slot_mapping, nd, d_tables.int(), d_ctx.int(), groups, cu_q, cu_k,
                   max(lens[nd:], default=0), int(p_ctx.max()) if len(p_ctx) else 0,
                   key_slots, (tuple(cu_q.tolist()), tuple(cu_k.tolist())))


    @classmethod
    def decode_only(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> "PagedAttentionMetadata":
        """A step of decode rows only, from device tensors of fixed shape (no host work):
        slot_mapping [B] long, block_tables [B, max_blocks] and context_lens [B] int32."""
        empty = slot_mapping.new_zeros(0)
        zero = context_lens.new_zeros(1)
        return cls(slot_mapping, slot_mapping.shape[0], block_tables, context_lens, [],
                   zero, zero, 0, 0, empty)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the metadata, in a fixed order (see `with_tensors`)."""
        out = [getattr(self, name) for name in _TENSOR_FIELDS]
        for _, _, slots, mask in self.decode_groups:
            out += [slots, mask]
        return out

    def with_tensors(self, tensors: list[torch.Tensor]) -> "PagedAttentionMetadata":
        """A copy holding `tensors` (same order and shapes as `tensors()`, e.g. moved to the
        device together)."""
        n = len(_TENSOR_FIELDS)
        groups = [(i, j, tensors[n + 2 * g], tensors[n + 2 * g + 1])
                  for g, (i, j, _, _) in enumerate(self.decode_groups)]
        return replace(self, decode_groups=groups, **dict(zip(_TENSOR_FIELDS, tensors)))


_TENSOR_FIELDS = ("slot_mapping", "decode_block_tables", "decode_context_lens", "cu_seqlens_q",
                  "cu_seqlens_k", "prefill_key_slots")


def decode_attention_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor, key_mask: torch.Tensor,
                              sm_scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: one attention call over K/V gathered to [B, Lmax, Hkv, D];
    key_mask [B, Lmax] marks each row's real keys."""
    B, Lmax = slots.shape
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.view(-1, hkv, dim).index_select(0, slots.reshape(-1)).view(B, Lmax, hkv, dim)
    v = v_cache.view(-1, hkv, dim).index_select(0, slots.reshape(-1)).view(B, Lmax, hkv, dim)
    return decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), key_mask, sm_scale)


class PagedAttentionContext:
    """Plugs into `LlamaModel`'s layers: `attend(layer_idx, q, k, v)` over a paged cache.
    path: one of DECODE_PATHS, as `choose_decode_path` returned it (the engine's config)."""

    def __init__(self, backend, kv_cache: PagedKVCache, metadata: PagedAttentionMetadata,
                 path: str):
        self.backend, self.kv_cache, self.meta, self.path = backend, kv_cache, metadata, path
        if path == "gather" and metadata.num_decode_tokens and not metadata.decode_groups:
            raise ValueError("the gather path needs metadata built with decode_groups=True")
        self.glue_stores_kv = fused.stores_kv(kv_cache.k_caches[0])

    def kv_write(self, layer_idx: int) -> fused.KVWrite | None:
        """Where the layer's RoPE pass stores K/V (the Triton glue), or None: attend does."""
        if not self.glue_stores_kv:
            return None
        return fused.KVWrite(*self.kv_cache.flat(layer_idx), self.meta.slot_mapping)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, kv_stored: bool = False) -> torch.Tensor:
        m = self.meta
        if q.shape[0] != 1:
            raise ValueError(f"the paged context takes flattened tokens, q [1, N, Hq, D]; "
                             f"got batch {q.shape[0]}")
        q, k, v = q[0], k[0], v[0]
        if not kv_stored:
            self.kv_cache.write(layer_idx, k, v, m.slot_mapping)
        k_cache, v_cache = self.kv_cache.k_caches[layer_idx], self.kv_cache.v_caches[layer_idx]
        nd = m.num_decode_tokens
        parts = []
        if nd and self.path == "kernel":
            parts.append(cpu_decode.paged_decode_cpu(q[:nd], k_cache, v_cache,
                                                     m.decode_block_tables, m.decode_context_lens))
        elif nd and self.path == "gather":
            parts += [decode_attention_gathered(q[i:j], k_cache, v_cache, slots, mask)
                      for i, j, slots, mask in m.decode_groups]
        elif nd:
            parts.append(self.backend.paged_decode(q[:nd], k_cache, v_cache,
                                                   m.decode_block_tables, m.decode_context_lens))
        if nd < q.shape[0]:
            hkv, dim = k_cache.shape[2], k_cache.shape[3]
            keys = k_cache.view(-1, hkv, dim).index_select(0, m.prefill_key_slots)
            values = v_cache.view(-1, hkv, dim).index_select(0, m.prefill_key_slots)
            parts.append(self.backend.varlen(q[nd:], keys, values, m.cu_seqlens_q,
                                             m.cu_seqlens_k, m.max_seqlen_q, m.max_seqlen_k,
                                             cu_seqlens_host=m.cu_seqlens_host))
        return (parts[0] if len(parts) == 1 else torch.cat(parts))[None]
