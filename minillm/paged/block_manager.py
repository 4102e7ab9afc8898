"""The bookkeeping half of a paged KV cache, part 2: one block table per sequence.

`BlockManager` sits on a `BlockPool` (`minillm.paged.block_pool`, which documents the
invariants I1-I4 and the free-queue order that `check_invariants` asserts). A sequence's
token at position p lives in slot block_table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .block_pool import Block, BlockPool, OutOfBlocksError, _cdiv, hash_block_tokens


@dataclass
class _SeqBlocks:
    block_table: list[int]
    num_tokens: int  # token slots reserved: positions 0 .. num_tokens-1 have a slot
    # chained hashes of the leading full blocks already offered to the cache
    block_hashes: list[int] = field(default_factory=list)
    version: int = 0  # see BlockManager.block_table_version


class BlockManager:
    """Block tables for sequences, on top of a `BlockPool`.

    A sequence's lifetime: `allocate` (reserves slots for the cached prefix plus the first
    chunk, or the whole prompt, and returns how many leading tokens are already cached) ->
    per step `append_slots` for the tokens that step computes and `slot_mapping` for the
    positions written -> `free`. `fork` shares all blocks with a child (parallel sampling);
    the first write into a shared, partly filled block triggers copy-on-write, returned by
    `append_slots` as (src, dst) block pairs to copy.

    A full block becomes shareable (cached) through `cache_blocks(seq, tokens, n)`, which
    promises that the KV of the first n tokens is written before anyone reads it: after the
    step that computes them, or - what the engine does - when that step is scheduled, since
    its forward pass writes each layer's K/V for every token before that layer attends, so
    a request admitted in the same step can share them. A promise the step then does not
    keep (it failed) is taken back with `free(seq, num_computed_tokens=...)`, which drops the
    hashes of the blocks that were never written. Sharing a block whose KV is never written
    would let another request read garbage.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self._versions = itertools.count(1)  # block table versions, never reused (0: none)
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0      # ... of which were found (returned as num_cached_tokens)

    # ---- queries -------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks()

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def get_block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def block_table_version(self, seq_id: Hashable) -> int:
        """A number that changes whenever the sequence's block table does (a block
        appended, a copy-on-write, a new allocation or fork) and is never given to another
        table, even of a sequence freed and allocated again under the same id: equal
        versions mean equal tables. The CUDA-graph runner rewrites a row's table only when
        its version changed (about once per block_size decode steps)."""
        return self._seq(seq_id).version

    def get_num_tokens(self, seq_id: Hashable) -> int:
        """How many token slots the sequence has reserved."""
        return self._seq(seq_id).num_tokens

    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up (0.0 before any)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def slot_mapping(self, seq_id: Hashable, start_pos: int, end_pos: int) -> list[int]:
        """Cache slots of positions start_pos .. end_pos-1 (the tokens written this step)."""
        seq, bs = self._seq(seq_id), self.block_size
        if not 0 <= start_pos <= end_pos <= seq.num_tokens:
            raise ValueError(f"positions [{start_pos}, {end_pos}) are outside the "
                             f"{seq.num_tokens} reserved slots of sequence {seq_id!r}; "
                             f"call append_slots first")
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start_pos, end_pos)]

    # ---- allocate / append / fork / free --------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Conservative: True if the prompt fits even with no prefix-cache hit."""
        return _cdiv(num_tokens, self.block_size) <= self.pool.num_free_blocks()

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int],
                 token_budget: int | None = None, watermark: int = 0) -> int:
        """Reserve slots for the prompt `token_ids`; return num_cached_tokens, the number of
        leading tokens whose KV is already cached (a multiple of block_size, always less
        than len(token_ids): the last token is computed so the model yields logits).

        token_budget: reserve slots only for the cached prefix plus the next
        min(token_budget, uncached) tokens (the first chunk; later chunks get theirs from
        `append_slots`). None reserves the whole prompt. watermark: refuse (OutOfBlocksError)
        unless at least this many blocks stay free afterwards."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks; free it first")
        if len(token_ids) == 0:
            raise ValueError("cannot allocate an empty prompt: it needs at least one token")
        bs, tokens = self.block_size, tuple(int(t) for t in token_ids)
        if min(tokens, default=0) < 0:
            raise ValueError("a prompt with a negative token id (a placeholder?) cannot be "
                             "hashed or computed; allocate only known tokens")
        if _cdiv(len(tokens), bs) > self.num_blocks:
            raise ValueError(f"a {len(tokens)}-token prompt needs {_cdiv(len(tokens), bs)} "
                             f"blocks of {bs} but the pool only has {self.num_blocks}: "
                             f"shorten the prompt or give the KV cache more memory")
        hits, hashes = self._find_cached_prefix(tokens)
        if len(hits) * bs == len(tokens):  # never the whole prompt: recompute its last block
            hits, hashes = hits[:-1], hashes[:-1]
        num_slots = len(tokens) if token_budget is None else \
            min(len(tokens), len(hits) * bs + token_budget)
        num_needed = _cdiv(num_slots, bs)
        num_revived = sum(b.ref_cnt == 0 for b in hits)  # hits sitting in the free queue
        num_taken = num_needed - len(hits) + num_revived
        if num_taken + watermark > self.pool.num_free_blocks():
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {num_taken} free blocks"
                + (f" (and {watermark} kept free)" if watermark else "")
                + f", {self.pool.num_free_blocks()} are free; free or preempt a sequence")
        self.pool.touch(hits)  # before get_new_blocks, so no hit gets evicted
        new = self.pool.get_new_blocks(num_needed - len(hits))
        table = [b.block_id for b in hits + new]
        self._seqs[seq_id] = _SeqBlocks(table, num_slots, hashes, next(self._versions))
        self.num_queried_tokens += len(tokens)
        self.num_hit_tokens += len(hits) * bs
        return len(hits) * bs

    def can_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        return self._blocks_to_append(self._seq(seq_id), num_new_tokens) <= self.pool.num_free_blocks()

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int],
                     num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Reserve slots for the last `num_new_tokens` of `token_ids` (all the sequence's
        tokens so far, new ones included; every token before them must be computed, and
        full blocks among them get cached). Returns copy-on-write (src, dst) block pairs the
        caller must copy in the KV tensors before writing. Raises OutOfBlocksError, leaving
        everything unchanged, if the pool is short (check `can_append` first)."""
        seq = self._seq(seq_id)
        if num_new_tokens < 0 or len(token_ids) != seq.num_tokens + num_new_tokens:
            raise ValueError(f"sequence {seq_id!r} has {seq.num_tokens} slots; token_ids must "
                             f"hold them plus the {num_new_tokens} new tokens, got "
                             f"{len(token_ids)} tokens")
        needed = self._blocks_to_append(seq, num_new_tokens)
        if needed > self.pool.num_free_blocks():
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {needed} free blocks to append "
                                   f"{num_new_tokens} tokens, {self.pool.num_free_blocks()} "
                                   f"are free; preempt a sequence first")
        self._cache_full_blocks(seq, token_ids, seq.num_tokens)
        copies = []
        if not needed:  # a decode's common case: the last block has room and is its own
            seq.num_tokens += num_new_tokens
            return copies
        if self._needs_cow(seq, num_new_tokens):
            # The partly filled last block is shared (fork): write into a private copy.
            old = self.pool.blocks[seq.block_table[-1]]
            (new,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([old])
            seq.block_table[-1] = new.block_id
            copies.append((old.block_id, new.block_id))
            needed -= 1
        seq.block_table += [b.block_id for b in self.pool.get_new_blocks(needed)]
        seq.num_tokens += num_new_tokens
        seq.version = next(self._versions)
        return copies

    def cache_blocks(self, seq_id: Hashable, token_ids: Sequence[int],
                     num_computed_tokens: int) -> int:
        """Tell the pool the KV of the first `num_computed_tokens` tokens is written: full
        blocks among them become shareable. Returns how many blocks got newly cached."""
        seq = self._seq(seq_id)
        if not 0 <= num_computed_tokens <= min(seq.num_tokens, len(token_ids)):
            raise ValueError(f"num_computed_tokens={num_computed_tokens} must be within the "
                             f"{seq.num_tokens} reserved slots and the {len(token_ids)} tokens")
        return self._cache_full_blocks(seq, token_ids, num_computed_tokens)

    def _cache_full_blocks(self, seq: _SeqBlocks, token_ids: Sequence[int],
                           num_computed_tokens: int) -> int:
        """`cache_blocks` for a checked sequence. Called for every sequence every step: a
        step that fills no block returns at once, reading no token."""
        bs = self.pool.block_size
        if not self.pool.enable_prefix_caching or \
                num_computed_tokens // bs <= len(seq.block_hashes):
            return 0
        num_cached = 0
        for i in range(len(seq.block_hashes), num_computed_tokens // bs):
            tokens = tuple(int(t) for t in token_ids[i * bs:(i + 1) * bs])
            if min(tokens) < 0:  # the engine's placeholder for a token not read back yet
                raise ValueError(f"block {i} of sequence tokens {tokens} holds a negative "
                                 f"token id: a placeholder must never be hashed; cache a "
                                 f"block only once its tokens are known")
            h = hash_block_tokens(seq.block_hashes[-1] if i else None, tokens)
            parent = self.pool.blocks[seq.block_table[i - 1]] if i else None
            num_cached += self.pool.cache_block(self.pool.blocks[seq.block_table[i]], h,
                                                tokens, parent)
            seq.block_hashes.append(h)
        return num_cached

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give `child_id` the parent's blocks (shared: every ref_cnt + 1, no copy yet)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into {child_id!r}: that sequence already exists")
        self.pool.touch([self.pool.blocks[i] for i in parent.block_table])
        self._seqs[child_id] = _SeqBlocks(list(parent.block_table), parent.num_tokens,
                                          list(parent.block_hashes), next(self._versions))

    def free(self, seq_id: Hashable, num_computed_tokens: int | None = None) -> None:
        """Release the sequence's blocks, last block first (so its prefix is evicted last).

        num_computed_tokens: how many leading tokens really have their KV written. Blocks
        past them that this sequence offered to the prefix cache (`cache_blocks` at
        schedule time, for a step that then never ran) are taken out of the cache first."""
        seq = self._seq(seq_id)
        if num_computed_tokens is not None:
            for i in range(num_computed_tokens // self.block_size, len(seq.block_hashes)):
                block = self.pool.blocks[seq.block_table[i]]
                if block.block_hash == seq.block_hashes[i]:
                    self.pool.uncache(block)
            del seq.block_hashes[num_computed_tokens // self.block_size:]
        self.pool.free_blocks([self.pool.blocks[i] for i in reversed(seq.block_table)])
        del self._seqs[seq_id]

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # ---- helpers ---------------------------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> _SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}: allocate it first "
                             f"(known: {len(self._seqs)} sequences)") from None

    def _find_cached_prefix(self, tokens: tuple[int, ...]) -> tuple[list[Block], list[int]]:
        hits: list[Block] = []
        hashes: list[int] = []
        if not self.pool.enable_prefix_caching:
            return hits, hashes
        for i in range(len(tokens) // self.block_size):
            block_tokens = tokens[i * self.block_size:(i + 1) * self.block_size]
            h = hash_block_tokens(hashes[-1] if hashes else None, block_tokens)
            block = self.pool.lookup(h, block_tokens, hits[-1] if hits else None)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
        return hits, hashes

    def _needs_cow(self, seq: _SeqBlocks, num_new_tokens: int) -> bool:
        return (num_new_tokens > 0 and seq.num_tokens % self.block_size != 0
                and self.pool.blocks[seq.block_table[-1]].ref_cnt > 1)

    def _blocks_to_append(self, seq: _SeqBlocks, num_new_tokens: int) -> int:
        grow = _cdiv(seq.num_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        return max(grow, 0) + self._needs_cow(seq, num_new_tokens)

    def check_invariants(self) -> None:
        """Assert I1-I4 (see the module docstring). For tests; O(num_blocks + tokens)."""
        pool, free = self.pool, set(self.pool.free_block_ids())
        holders = [0] * self.num_blocks
        for seq in self._seqs.values():
            for i in seq.block_table:
                holders[i] += 1
        for b in pool.blocks:
            assert (b.block_id in free) == (b.ref_cnt == 0), \
                f"I1: block {b.block_id} has ref_cnt {b.ref_cnt} but in_free_queue={b.block_id in free}"
            assert b.ref_cnt == holders[b.block_id], \
                f"I2: block {b.block_id} has ref_cnt {b.ref_cnt} but {holders[b.block_id]} table entries"
            if b.block_hash is not None:
                assert pool._cached.get(b.block_hash) is b, f"I4: block {b.block_id} hash not in cache map"
        assert len(free) == pool.num_free_blocks() == len(pool.free_block_ids()), "I3: free queue has duplicates"
        assert len(free) + sum(h > 0 for h in holders) == self.num_blocks, "I3: a block leaked"
        for h, b in pool._cached.items():
            assert b.block_hash == h and b.token_ids is not None and len(b.token_ids) == self.block_size, \
                f"I4: cache entry {h} -> block {b.block_id} is not a full block registered under it"
