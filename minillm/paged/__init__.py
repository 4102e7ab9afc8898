"""Paged KV cache: block bookkeeping (`block_pool` for the blocks, `block_manager` for the
per-sequence block tables) and block storage (`kv_cache`). No attention here: the code that
reads K/V through block tables is `minillm.attention` (`paged`, `paged_ref`, `cpu_decode`)."""
from .block_manager import BlockManager
from .block_pool import Block, BlockPool, OutOfBlocksError, hash_block_tokens
from .kv_cache import PagedKVCache, block_table_tensor

__all__ = [
    "Block", "BlockManager", "BlockPool", "OutOfBlocksError", "hash_block_tokens",
    "PagedKVCache", "block_table_tensor",
]
