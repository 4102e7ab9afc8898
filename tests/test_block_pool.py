"""Block pool tests: a toy pool of 10 blocks of 4 tokens, exact block ids, CPU only.

Scripted scenarios first (allocation order, LRU eviction, prefix hits, fork and
copy-on-write, failures), then a hypothesis state machine that runs random
allocate / compute / append / fork / free / evict sequences against a shadow copy of
the KV contents and checks the pool's invariants after every step.
"""
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.paged import block_pool
from minillm.paged.block_manager import BlockManager
from minillm.paged.block_pool import OutOfBlocksError

NUM_BLOCKS, BS = 10, 4


def make(**kw) -> BlockManager:
    return BlockManager(num_blocks=NUM_BLOCKS, block_size=BS, **kw)


def ref_cnts(mgr: BlockManager) -> list[int]:
    return [b.ref_cnt for b in mgr.pool.blocks]


def cached_ids(mgr: BlockManager) -> set[int]:
    return set(mgr.pool.cached_blocks().values())


def snapshot(mgr: BlockManager):
    """Everything a failed call must leave untouched."""
    blocks = [(b.ref_cnt, b.content_id, b.block_hash, b.token_ids, b.parent_content_id)
              for b in mgr.pool.blocks]
    tables = {s: (list(q.block_table), q.num_tokens, list(q.block_hashes))
              for s, q in mgr._seqs.items()}
    return (mgr.pool.free_block_ids(), blocks, mgr.pool.cached_blocks(), tables,
            mgr.num_queried_tokens, mgr.num_hit_tokens)


def test_fresh_pool_hands_out_blocks_in_id_order():
    mgr = make()
    assert mgr.allocate("a", range(10)) == 0
    assert mgr.get_block_table("a") == [0, 1, 2]
    assert mgr.allocate("b", range(100, 105)) == 0
    assert mgr.get_block_table("b") == [3, 4]
    assert ref_cnts(mgr) == [1] * 5 + [0] * 5
    assert mgr.num_free_blocks() == 5 and mgr.pool.free_block_ids() == [5, 6, 7, 8, 9]
    mgr.check_invariants()


def test_free_returns_blocks_tail_first_so_prefix_is_evicted_last():
    mgr = make()
    mgr.allocate("a", range(10))
    mgr.free("a")
    assert mgr.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert "a" not in mgr and ref_cnts(mgr) == [0] * 10
    mgr.check_invariants()


def test_slot_mapping_uses_the_block_table():
    mgr = make()
    mgr.allocate("a", range(6))      # blocks [0, 1]
    mgr.allocate("b", range(50, 55))  # blocks [2, 3]
    assert mgr.slot_mapping("b", 0, 5) == [8, 9, 10, 11, 12]
    assert mgr.slot_mapping("a", 3, 6) == [3, 4, 5]
    assert mgr.slot_mapping("a", 2, 2) == []
    with pytest.raises(ValueError, match="outside the 6 reserved slots"):
        mgr.slot_mapping("a", 4, 7)


def test_prefix_hit_shares_blocks_and_never_covers_the_whole_prompt():
    mgr = make()
    prompt = list(range(12))                                  # exactly 3 full blocks
    assert mgr.allocate("a", prompt) == 0                     # [0, 1, 2]
    assert mgr.cache_blocks("a", prompt, 12) == 3
    assert cached_ids(mgr) == {0, 1, 2}
    assert mgr.allocate("b", prompt + [99]) == 12             # all 3 blocks hit
    assert mgr.get_block_table("b") == [0, 1, 2, 3]
    assert mgr.allocate("c", prompt) == 8                     # whole prompt cached: recompute
    assert mgr.get_block_table("c") == [0, 1, 4]              # its last block in a new block
    assert ref_cnts(mgr)[:5] == [3, 3, 2, 1, 1]
    # c's recomputed last block holds the same tokens as block 2: the first copy stays cached
    assert mgr.cache_blocks("c", prompt, 12) == 0
    assert cached_ids(mgr) == {0, 1, 2}
    assert mgr.prefix_cache_hit_rate() == pytest.approx((12 + 8) / (12 + 13 + 12))
    mgr.check_invariants()


def test_freed_cached_block_is_revived_by_a_hit():
    mgr = make()
    prompt = list(range(8))
    mgr.allocate("a", prompt)
    mgr.cache_blocks("a", prompt, 8)
    mgr.free("a")
    assert mgr.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert cached_ids(mgr) == {0, 1}                          # freed blocks keep their hash
    assert mgr.allocate("b", prompt + [8]) == 8
    assert mgr.get_block_table("b") == [0, 1, 2]
    assert mgr.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]  # 0 and 1 left the free queue
    assert ref_cnts(mgr)[:3] == [1, 1, 1]
    mgr.check_invariants()


def test_eviction_is_lru_and_drops_the_hash():
    mgr = make()
    A, B = [1] * 4 + [2] * 4, [3] * 4 + [4] * 4
    for sid, toks in (("a", A), ("b", B)):
        mgr.allocate(sid, toks)
        mgr.cache_blocks(sid, toks, 8)
        mgr.free(sid)
    assert mgr.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 1, 0, 3, 2]
    mgr.allocate("c", range(100, 128))    # 7 blocks: the 6 never-used ones, then block 1
    assert mgr.get_block_table("c") == [4, 5, 6, 7, 8, 9, 1]
    assert cached_ids(mgr) == {0, 2, 3}   # A's second block was evicted, its prefix was not
    assert mgr.allocate("d", A + [5]) == 4  # A's first block still hits, its second does not
    assert mgr.get_block_table("d") == [0, 3, 2]  # new blocks from the head: evicts B
    assert cached_ids(mgr) == {0}
    mgr.check_invariants()


def test_block_filled_during_decode_becomes_cacheable():
    mgr = make()
    toks = [7, 7, 7]
    mgr.allocate("a", toks)                                   # block 0, 3 tokens
    toks.append(8)
    assert mgr.append_slots("a", toks, 1) == []               # fills block 0 ...
    assert cached_ids(mgr) == set()                           # ... but its last KV isn't computed
    toks.append(9)
    assert mgr.append_slots("a", toks, 1) == []               # token 8 is computed by now
    assert mgr.get_block_table("a") == [0, 1] and cached_ids(mgr) == {0}
    assert mgr.allocate("b", [7, 7, 7, 8, 1]) == 4
    assert mgr.get_block_table("b") == [0, 2]
    mgr.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block():
    mgr = make()
    toks = list(range(6))
    mgr.allocate("a", toks)                                   # [0, 1]; block 1 holds 2 tokens
    mgr.fork("a", "b")
    assert mgr.get_block_table("b") == [0, 1] and ref_cnts(mgr)[:2] == [2, 2]
    assert mgr.append_slots("b", toks + [50], 1) == [(1, 2)]  # b copies block 1 into block 2
    assert mgr.get_block_table("b") == [0, 2]
    assert ref_cnts(mgr)[:3] == [2, 1, 1]
    assert mgr.append_slots("a", toks + [60], 1) == []        # a owns block 1 alone now
    assert mgr.get_block_table("a") == [0, 1]
    mgr.free("b")
    assert ref_cnts(mgr)[:3] == [1, 1, 0] and mgr.pool.free_block_ids()[-1] == 2
    mgr.check_invariants()


def test_block_table_versions_change_with_the_table_only():
    mgr = make()
    toks = list(range(6))
    mgr.allocate("a", toks)
    v = mgr.block_table_version("a")
    mgr.append_slots("a", toks + [1], 1)          # room in block 1: the table is unchanged
    assert mgr.block_table_version("a") == v
    mgr.append_slots("a", toks + [1, 2, 3], 2)     # a new block
    assert mgr.block_table_version("a") != v
    mgr.fork("a", "b")
    versions = {mgr.block_table_version("a"), mgr.block_table_version("b")}
    mgr.append_slots("b", toks + [1, 2, 3, 4], 1)  # copy-on-write of the shared last block
    assert len(versions | {mgr.block_table_version("b")}) == 3
    old = mgr.block_table_version("a")
    mgr.free("a")
    mgr.allocate("a", toks)                        # the same id again: another version
    assert mgr.block_table_version("a") not in versions | {old}


def test_fork_at_a_block_boundary_needs_no_copy():
    mgr = make()
    toks = list(range(8))
    mgr.allocate("a", toks)
    mgr.fork("a", "b")
    assert mgr.append_slots("b", toks + [1], 1) == []
    assert mgr.get_block_table("b") == [0, 1, 2] and ref_cnts(mgr)[:3] == [2, 2, 1]
    mgr.check_invariants()


def test_hash_collision_is_never_a_hit(monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, toks: 42)
    mgr = make()
    mgr.allocate("a", [1, 2, 3, 4, 5])
    assert mgr.cache_blocks("a", [1, 2, 3, 4, 5], 5) == 1     # block 0 cached under 42
    assert mgr.allocate("b", [9, 9, 9, 9, 5]) == 0            # same hash, other tokens: miss
    assert mgr.get_block_table("b") == [2, 3]
    mgr.check_invariants()


def test_same_block_tokens_under_another_prefix_are_not_a_hit(monkeypatch):
    # A hash that ignores the parent: block (2,2,2,2) gets the same key after any prefix.
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, toks: hash(toks))
    mgr = make()
    P, X, Q = [1] * 4, [2] * 4, [3] * 4
    mgr.allocate("a", P + X + [0])
    mgr.cache_blocks("a", P + X + [0], 9)                     # caches P, X (parent P)
    mgr.allocate("d", Q + [0])
    mgr.cache_blocks("d", Q + [0], 5)                         # caches Q
    assert mgr.allocate("e", Q + X + [0]) == 4                # Q hits; X's parent differs
    mgr.check_invariants()


def test_a_reused_parent_block_does_not_vouch_for_its_old_children():
    # Pool level: the manager never evicts a parent before its child, but a hit must not
    # rely on that. Block ids stay the same when a block is reused; content ids do not.
    pool = block_pool.BlockPool(4, block_size=2)
    parent, child = pool.get_new_blocks(2)
    pool.cache_block(parent, 10, (1, 1), None)
    pool.cache_block(child, 11, (2, 2), parent)
    assert pool.lookup(11, (2, 2), parent) is child
    pool.free_blocks([parent])
    assert pool.get_new_blocks(3)[-1] is parent               # evicted and handed out again
    assert pool.cached_blocks() == {11: 1}
    pool.cache_block(parent, 10, (1, 1), None)                # same id, same tokens, new KV
    assert pool.lookup(10, (1, 1), None) is parent
    assert pool.lookup(11, (2, 2), parent) is None


def test_prefix_caching_can_be_disabled():
    mgr = make(enable_prefix_caching=False)
    mgr.allocate("a", range(8))
    assert mgr.cache_blocks("a", list(range(8)), 8) == 0
    assert mgr.allocate("b", list(range(8)) + [1]) == 0
    assert mgr.pool.cached_blocks() == {} and mgr.prefix_cache_hit_rate() == 0.0


def test_reset_prefix_cache_forgets_all_hashes():
    mgr = make()
    mgr.allocate("a", range(9))
    mgr.cache_blocks("a", list(range(9)), 9)
    mgr.allocate("b", range(4))
    mgr.free("b")
    assert mgr.reset_prefix_cache() == 2 and mgr.pool.cached_blocks() == {}
    assert mgr.allocate("c", list(range(8)) + [0]) == 0
    mgr.check_invariants()


def test_failed_allocate_leaves_the_pool_unchanged():
    mgr = make()
    A = list(range(8))
    mgr.allocate("a", A)
    mgr.cache_blocks("a", A, 8)
    mgr.free("a")                                             # 0, 1 free but cached
    mgr.allocate("x", range(100, 124))                        # [2..7]; free queue [8, 9, 1, 0]
    before = snapshot(mgr)
    # 2 hits (both in the free queue: reviving them uses them up) + 3 new > 4 free
    assert mgr.can_allocate(20) is False
    with pytest.raises(OutOfBlocksError, match="needs 5 free blocks, 4 are free"):
        mgr.allocate("y", A + list(range(200, 212)))
    assert snapshot(mgr) == before and "y" not in mgr
    mgr.check_invariants()


def test_failed_append_leaves_the_pool_unchanged():
    mgr = make()
    mgr.allocate("a", range(6))
    mgr.fork("a", "b")
    mgr.allocate("x", range(100, 132))                        # the 8 remaining blocks
    before = snapshot(mgr)
    assert mgr.can_append("b", 1) is False                    # copy-on-write needs a block
    with pytest.raises(OutOfBlocksError):
        mgr.append_slots("b", list(range(6)) + [1], 1)
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_misuse_raises_clear_errors():
    mgr = make()
    mgr.allocate("a", range(5))
    with pytest.raises(ValueError, match="already has blocks"):
        mgr.allocate("a", range(5))
    with pytest.raises(ValueError, match="unknown sequence 'zz'"):
        mgr.free("zz")
    with pytest.raises(ValueError, match="needs 11 blocks of 4 but the pool only has 10"):
        mgr.allocate("big", range(41))
    with pytest.raises(ValueError, match="empty prompt"):
        mgr.allocate("e", [])
    with pytest.raises(ValueError, match="already exists"):
        mgr.fork("a", "a")
    with pytest.raises(ValueError, match="plus the 1 new tokens, got 5"):
        mgr.append_slots("a", range(5), 1)
    with pytest.raises(ValueError, match="reserved slots"):
        mgr.cache_blocks("a", list(range(9)), 9)
    assert "big" not in mgr and mgr.num_free_blocks() == 8
    mgr.check_invariants()


# ---- random operation sequences ------------------------------------------------------------

TOKENS = st.integers(0, 2)
# Prompts glued from a few whole blocks plus a ragged tail share prefixes often, so the
# prefix cache gets hits (and near misses: the same block after another prefix).
PIECES = st.sampled_from([(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 2, 0), (2, 2, 0, 0)])
PROMPTS = st.builds(lambda blocks, tail: [t for b in blocks for t in b] + tail,
                    st.lists(PIECES, max_size=7), st.lists(TOKENS, max_size=6)).map(lambda p: p or [0])


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockManager like an engine would, with a shadow of the KV cache. The KV of
    the token at position p depends on all tokens 0..p, so `content[slot]` is that whole
    prefix, as last written to the slot. A sequence must always read its own prefixes back,
    and a cached block must hold the tokens it claims."""

    def __init__(self):
        super().__init__()
        self.mgr = make()
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.content: dict[int, tuple[int, ...]] = {}
        self.tables: dict[int, list[int]] = {}  # block table version -> the table it named
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _compute(self, sid: int, upto: int) -> None:
        """Run the model on positions computed..upto-1: write their KV, then cache."""
        start = self.computed[sid]
        for pos, slot in zip(range(start, upto), self.mgr.slot_mapping(sid, start, upto)):
            self.content[slot] = tuple(self.tokens[sid][:pos + 1])
        self.computed[sid] = upto
        self.mgr.cache_blocks(sid, self.tokens[sid], upto)

    @rule(prompt=PROMPTS)
    def allocate(self, prompt):
        sid, before = self._new_id(), snapshot(self.mgr)
        try:
            num_cached = self.mgr.allocate(sid, prompt)
        except ValueError:
            assert -(-len(prompt) // BS) > NUM_BLOCKS and snapshot(self.mgr) == before
            return
        except OutOfBlocksError:
            assert snapshot(self.mgr) == before
            return
        assert num_cached % BS == 0 and 0 <= num_cached < len(prompt)
        self.tokens[sid], self.computed[sid] = list(prompt), num_cached

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        upto = data.draw(st.integers(self.computed[sid], len(self.tokens[sid])))
        self._compute(sid, upto)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(TOKENS, min_size=1, max_size=6))
    def append(self, data, new):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._compute(sid, len(self.tokens[sid]))  # append's contract: all earlier KV written
        can, before = self.mgr.can_append(sid, len(new)), snapshot(self.mgr)
        try:
            copies = self.mgr.append_slots(sid, self.tokens[sid] + new, len(new))
        except OutOfBlocksError:
            assert not can and snapshot(self.mgr) == before
            return
        assert can
        for src, dst in copies:  # what PagedKVCache.copy_blocks does to the real tensors
            for off in range(BS):
                if src * BS + off in self.content:
                    self.content[dst * BS + off] = self.content[src * BS + off]
        self.tokens[sid] = self.tokens[sid] + new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = data.draw(st.sampled_from(sorted(self.tokens))), self._new_id()
        self.mgr.fork(parent, child)
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(sid)
        del self.tokens[sid], self.computed[sid]

    @rule()
    def evict_all(self):
        self.mgr.reset_prefix_cache()

    @invariant()
    def pool_is_consistent(self):
        mgr, pool = self.mgr, self.mgr.pool
        free = pool.free_block_ids()
        assert len(free) == len(set(free)) == mgr.num_free_blocks(), "free queue count is off"
        holders = [0] * NUM_BLOCKS
        for sid in self.tokens:
            for b in mgr.get_block_table(sid):
                holders[b] += 1
        for b in pool.blocks:
            assert (b.block_id in free) != (b.ref_cnt > 0), f"block {b.block_id} free and used"
            assert b.ref_cnt == holders[b.block_id], f"block {b.block_id} ref_cnt is wrong"
        assert len(free) + sum(h > 0 for h in holders) == NUM_BLOCKS, "a block leaked"
        for h, bid in pool.cached_blocks().items():
            blk = pool.blocks[bid]
            assert blk.block_hash == h and len(blk.token_ids) == BS
            held = [self.content.get(bid * BS + off) for off in range(BS)]
            assert None not in held and tuple(p[-1] for p in held) == blk.token_ids, \
                f"cached block {bid} claims tokens it does not hold"
        for sid, toks in self.tokens.items():  # every sequence reads back its own KV
            n = self.computed[sid]
            got = [self.content.get(s) for s in mgr.slot_mapping(sid, 0, n)]
            assert got == [tuple(toks[:p + 1]) for p in range(n)], \
                f"sequence {sid} reads KV of other tokens or another prefix"
        mgr.check_invariants()

    @invariant()
    def equal_versions_mean_equal_tables(self):
        """What the CUDA-graph runner relies on to skip rewriting a row's table: a version
        names one table for good (a free and a reallocation get a new one)."""
        for sid in self.tokens:
            table = self.mgr.get_block_table(sid)
            assert self.tables.setdefault(self.mgr.block_table_version(sid), table) == table, \
                f"sequence {sid}'s table changed under the same version"


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_block_pool_random_operations = BlockPoolMachine.TestCase


class WeakHashMachine(BlockPoolMachine):
    """The same machine with a hash that ignores the parent and has 5 values, so it collides
    all the time: hits must still be exact, because lookups compare the tokens and the
    parent block."""

    def __init__(self):
        self._patch = mock.patch.object(block_pool, "hash_block_tokens",
                                        lambda parent, toks: sum(toks) % 5)
        self._patch.start()
        super().__init__()

    def teardown(self):
        self._patch.stop()


WeakHashMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_block_pool_random_operations_weak_hash = WeakHashMachine.TestCase
