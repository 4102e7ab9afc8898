"""The bookkeeping half of a paged KV cache, part 1: the pool of blocks.

KV memory is a fixed number of blocks of `block_size` token slots. A sequence owns a
`block_table` (list of block ids); its token at position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`. No tensors here: the K/V
storage itself is `minillm.paged.kv_cache.PagedKVCache`.

- `BlockPool` owns the blocks, their ref counts, the LRU free queue and the prefix cache
  (chained block hash -> block).
- `BlockManager` (`minillm.paged.block_manager`) keeps one block table per sequence on
  top of the pool: allocate (with prefix-cache hits), append_slots (with copy-on-write),
  fork, free, slot_mapping.

Invariants (`BlockManager.check_invariants` asserts them; the tests call it after every step):
  I1  a block is in the free queue (ref_cnt == 0) or referenced (ref_cnt > 0), never both;
  I2  ref_cnt == the number of block-table entries that hold the block;
  I3  num_free_blocks() == len(free queue), and free + referenced == num_blocks (no leak);
  I4  cached[h] is b  <=>  b.block_hash == h; then b is full, and its KV is that of
      b.token_ids computed right after the block whose content_id is b.parent_content_id
      (written by the end of the step that offered it: see `BlockManager`). Only full
      blocks are cached.
Free-queue order is deterministic, so tests can assert exact block ids:
  - a fresh pool hands out blocks 0, 1, 2, ... in id order;
  - allocation takes from the head (least recently freed), freeing appends to the tail;
  - a sequence's blocks are freed tail first, so its prefix blocks (the ones most likely
    to be shared again) are the last to be evicted.
A freed block keeps its hash: a later hit revives it (out of the free queue, ref_cnt 1).
Its hash is dropped only when the block is taken from the free queue for reuse (eviction).

Prefix caching: full blocks are keyed by a chained hash of (parent_hash, block tokens). A
block is cached when the step that computes it is scheduled (`BlockManager.cache_blocks`,
or `append_slots` for the tokens before the new ones); if equal content is already cached
elsewhere, the first copy stays the cached one. A hit is exact, not just probable: see
`BlockPool.lookup`.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks right now. Check `can_allocate` / `can_append` first, or
    preempt a sequence (free it) to make room. The pool is left exactly as it was."""


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: it identifies the block's tokens *and* its prefix.

    sha256 of the text repr, cut to 64 bits: the same in every process (unlike hash() of
    str) and far harder to collide on purpose than hash() of a tuple of ints, which is all a
    client controls. Still, the hash only *finds* a candidate:
    `BlockPool.lookup` accepts it after checking its tokens and its parent block, so even a
    collision costs a miss, never a wrong KV block.
    """
    data = repr((parent_hash, token_ids)).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    # A number no other block content ever had: renewed each time the block is handed out
    # (get_new_blocks), so it names "these bytes", not just "this block id".
    content_id: int = -1
    block_hash: int | None = None              # set only while the block is in the cache
    token_ids: tuple[int, ...] | None = None   # the tokens the hash stands for (hit check)
    parent_content_id: int | None = None       # content_id of the block before it (None: first)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The free queue: insertion-ordered block ids, head = next to hand out. An
        # OrderedDict gives O(1) pop-from-head, append-to-tail and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, Block] = {}
        self._next_content_id = 0

    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be handed out) first."""
        return list(self._free)

    def cached_blocks(self) -> dict[int, int]:
        """block_hash -> block_id for every cached block (a copy)."""
        return {h: b.block_id for h, b in self._cached.items()}

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue (evicting their cached hashes)."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} free blocks, only {len(self._free)} are free")
        out = []
        for _ in range(n):
            block = self.blocks[self._free.popitem(last=False)[0]]
            self.uncache(block)
            block.ref_cnt, block.content_id = 1, self._next_content_id
            self._next_content_id += 1
            out.append(block)
        return out

    def lookup(self, block_hash: int, token_ids: tuple[int, ...],
               parent: Block | None) -> Block | None:
        """The cached block for `block_hash`, if it really is `token_ids` computed right after
        `parent` (the block matched for the previous position, None for the first block).

        Comparing tokens alone is not enough: two prefixes whose chained hashes collide
        would share a key, and the KV of a block depends on its whole prefix. By induction
        from the first block, "same tokens, same parent content" means "same prefix"."""
        block = self._cached.get(block_hash)
        parent_cid = None if parent is None else parent.content_id
        if block is None or block.token_ids != token_ids or block.parent_content_id != parent_cid:
            return None  # a miss, or a hash collision: never hand out the wrong KV
        return block

    def touch(self, blocks: Sequence[Block]) -> None:
        """Add one reference to each block; a free block is revived (leaves the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block, in the given order; a block whose count
        reaches 0 goes to the tail of the free queue and keeps its hash."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: Block, block_hash: int, token_ids: tuple[int, ...],
                    parent: Block | None) -> bool:
        """Register a full, computed block (that follows `parent` in its sequence) under its
        hash. If the hash is taken (the same content in another block, or a collision) the
        first block stays cached and this one is not: returns False."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(token_ids)} tokens, "
                             f"block_size is {self.block_size}")
        if block_hash in self._cached:
            return False
        block.block_hash, block.token_ids = block_hash, token_ids
        block.parent_content_id = None if parent is None else parent.content_id
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (a cold cache for benchmarks). Blocks in use keep their
        data; they just can no longer be shared. Returns how many hashes were dropped."""
        n = len(self._cached)
        for block in list(self._cached.values()):
            self.uncache(block)
        return n

    def uncache(self, block: Block) -> None:
        """Forget the block's hash (it stays allocated or free as it was)."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent_content_id = None
