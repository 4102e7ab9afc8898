"""Paged KV cache: block bookkeeping (`block_pool` for the blocks, `block_manager` for the
per-sequence block tables), block storage (`kv_cache`) and the reference attention that
reads K/V through block tables (`attention_ref`)."""
from .attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref
from .block_manager import BlockManager
from .block_pool import Block, BlockPool, OutOfBlocksError, hash_block_tokens
from .kv_cache import PagedKVCache, block_table_tensor

__all__ = [
    "Block", "BlockManager", "BlockPool", "OutOfBlocksError", "hash_block_tokens",
    "PagedKVCache", "block_table_tensor",
    "paged_decode_attention_ref", "paged_prefill_attention_ref",
]
