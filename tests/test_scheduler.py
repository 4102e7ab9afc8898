"""The scheduler alone, with a fake model runner: exact token counts, orders and victims.

`step()` below plays the engine without a model: schedule, mark the scheduled tokens
computed, and "sample" token 7 for every request whose last token was computed. Pools are
tiny (a handful of 4-token blocks) so block counts are easy to follow by hand.
"""
import random

import pytest

from minillm.engine.request import Request, RequestStatus, SamplingParams
from minillm.engine.scheduler import Scheduler
from minillm.paged import BlockManager

BS = 4


def make(num_blocks=32, **kw):
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=False), **kw)


def req(rid, prompt_len, max_tokens=8):
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def step(sched):
    out = sched.schedule()
    sched.advance(out)
    sched.append_tokens([(s.request, 7) for s in out.seqs if s.samples], now=0.0)
    return [(s.request.request_id, s.num_new_tokens) for s in out.seqs], out


def test_chunk_sizes_follow_the_budget():
    sched = make(max_num_batched_tokens=16)
    sched.add(req("a", 40, max_tokens=3))
    steps = [step(sched)[0] for _ in range(5)]
    assert steps == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)], [("a", 1)]]
    assert not sched.has_unfinished()


def test_budget_of_one_token():
    sched = make(max_num_batched_tokens=1)
    sched.add(req("a", 3, max_tokens=2))
    sched.add(req("b", 2, max_tokens=1))
    seen = [step(sched)[0] for _ in range(6)]
    # a's prompt one token at a time, then a decodes first while b waits its turn.
    assert seen == [[("a", 1)], [("a", 1)], [("a", 1)], [("a", 1)], [("b", 1)], [("b", 1)]]
    assert not sched.has_unfinished()


def test_decodes_come_before_prefill_chunks():
    sched = make(max_num_batched_tokens=64)
    sched.add(req("a", 4))
    sched.add(req("b", 5))
    step(sched)  # both prompts at once; both sampled a token
    sched.max_num_batched_tokens = 6
    sched.add(req("c", 30))
    seen, out = step(sched)
    assert seen == [("a", 1), ("b", 1), ("c", 4)]  # decodes first, c gets the rest
    sched.max_num_batched_tokens = 2
    assert step(sched)[0] == [("a", 1), ("b", 1)]  # no budget left for c's chunk
    sched.max_num_batched_tokens = 3
    assert step(sched)[0] == [("a", 1), ("b", 1), ("c", 1)]


def test_budget_and_max_num_seqs_are_respected():
    rng = random.Random(0)
    sched = make(num_blocks=40, max_num_batched_tokens=10, max_num_seqs=3)
    for i in range(12):
        sched.add(req(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 10)))
    while sched.has_unfinished():
        seen, _ = step(sched)
        assert 0 < sum(n for _, n in seen) <= 10
        assert len(sched.running) <= 3
        sched.block_manager.check_invariants()


def test_admission_is_fifo_and_never_skips_the_head():
    sched = make(num_blocks=6, max_num_batched_tokens=100)
    sched.add(req("a", 12))      # 3 blocks
    sched.add(req("big", 16))    # 4 blocks: does not fit next to a
    sched.add(req("small", 2))   # 1 block: would fit, but must not overtake "big"
    seen, _ = step(sched)
    assert seen == [("a", 12)]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


def test_preemption_picks_the_newest_and_keeps_its_tokens():
    sched = make(num_blocks=5, max_num_batched_tokens=100)
    for rid in ("old", "mid", "new"):
        sched.add(req(rid, 4, max_tokens=8))  # 1 full block each
    step(sched)  # three prompts; each sampled one token and needs a 2nd block next
    seen, out = step(sched)
    # 2 free blocks for 3 decodes: "new" is preempted, the other two decode.
    assert [r.request_id for r in out.preempted] == ["new"]
    assert seen == [("old", 1), ("mid", 1)]
    new = sched.waiting[0]
    assert new.request_id == "new" and new.status is RequestStatus.WAITING
    assert new.num_computed_tokens == 0 and new.output_token_ids == [7]
    assert sched.num_preemptions == 1 and new.metrics.num_preemptions == 1
    while sched.has_unfinished():  # it comes back and recomputes prompt + its token
        step(sched)
        sched.block_manager.check_invariants()
    assert new.output_token_ids == [7] * 8 and new.finish_reason == "length"


def test_request_preempts_itself_when_it_is_the_newest():
    sched = make(num_blocks=3, max_num_batched_tokens=100)
    sched.add(req("a", 4, max_tokens=6))
    sched.add(req("b", 4, max_tokens=6))
    step(sched)
    seen, out = step(sched)  # 1 free block, 2 decodes need one each: b (newest) goes
    assert seen == [("a", 1)] and [r.request_id for r in out.preempted] == ["b"]
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_free_blocks() == 3


def test_without_chunking_a_prompt_is_whole_or_waits():
    sched = make(max_num_batched_tokens=10, chunked_prefill=False)
    sched.add(req("a", 6))
    sched.add(req("b", 6))
    assert step(sched)[0] == [("a", 6)]  # b (6) does not fit the 4 tokens left
    assert step(sched)[0] == [("a", 1), ("b", 6)]


def test_static_policy_admits_only_when_the_batch_is_done():
    sched = make(max_num_batched_tokens=100, max_num_seqs=2, policy="static")
    sched.add(req("a", 3, max_tokens=1))
    sched.add(req("b", 3, max_tokens=4))
    sched.add(req("c", 3, max_tokens=1))
    assert step(sched)[0] == [("a", 3), ("b", 3)]  # a finishes here
    assert step(sched)[0] == [("b", 1)]            # c waits though a slot is free
    step(sched)
    step(sched)
    assert step(sched)[0] == [("c", 3)]


def test_bad_configuration():
    with pytest.raises(ValueError, match="policy"):
        make(policy="fifo")
    with pytest.raises(ValueError, match=">= 1"):
        make(max_num_batched_tokens=0)


@pytest.mark.parametrize("budget", [1, 3, 5, 64])
def test_each_step_offers_exactly_its_full_blocks(budget):
    """The full blocks of a step's tokens are offered to the prefix cache when the step is
    scheduled (the scheduler skips the call when a step completes no block): after every
    schedule(), each scheduled request has offered the full blocks of its first
    start + num_new_tokens tokens, no fewer (a hit missed) and no more (a promise of KV
    never written). Prompts share a prefix so that admissions hit."""
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=budget, max_num_seqs=3)
    rng = random.Random(budget)
    shared = [rng.randrange(50) for _ in range(9)]
    for i in range(6):
        own = [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        sched.add(Request(f"r{i}", shared + own, SamplingParams(max_tokens=rng.randrange(1, 14))))
    offered = 0
    while sched.has_unfinished():
        out = sched.schedule()
        for s in out.seqs:
            hashes = bm._seqs[s.request.seq_id].block_hashes
            assert len(hashes) == (s.start + s.num_new_tokens) // BS, (s.request, s.start)
        offered += len(out.seqs)
        sched.advance(out)
        sched.append_tokens([(s.request, 7) for s in out.seqs if s.samples], now=0.0)
        bm.check_invariants()
    assert offered and bm.prefix_cache_hit_rate() > 0
