"""Async scheduling (`minillm.engine.overlap`) == the synchronous engine, token for token.

The oracle is the synchronous engine and `minillm.generate`: with the next step launched
before the last one's ids are read back (forced on here: on a CPU the same bookkeeping
runs without real overlap), every request's tokens, finish reasons and the prefix-cache
hits must be the same, the block pool must hold its invariants after every step and end
clean, and no placeholder may reach anything that needs a token's value (the block
manager refuses to hash one; the runner refuses one it has no device id for). A spy checks
that the overlap really happens: step N+1 runs before step N's ids are read back.
"""
import random

import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig
from minillm.engine import LLMEngine, SamplingParams
from minillm.engine.request import PENDING
from minillm.paged.block_manager import BlockManager
from test_engine import (BS, model, one_thread, reference, run,  # noqa: F401 (fixtures)
                         workload)


def both(model, prompts, params, **kw):
    """Run the workload on a sync and an async engine; return both engines and tokens."""
    runs = []
    for overlap in (False, True):
        engine = LLMEngine(model, block_size=BS, async_scheduling=overlap, **kw)
        assert engine.config.async_scheduling is overlap
        runs.append((engine, run(engine, prompts, params)))
    return runs


@pytest.mark.parametrize("kw", [
    dict(num_blocks=400, max_num_batched_tokens=3, max_num_seqs=8),     # chunked prefill
    dict(num_blocks=400, max_num_batched_tokens=16, max_num_seqs=8),
    dict(num_blocks=400, max_num_batched_tokens=128, chunked_prefill=False),
    dict(num_blocks=400, max_num_batched_tokens=24, enable_prefix_caching=False),
    dict(num_blocks=400, max_num_batched_tokens=64, scheduling="static"),
], ids=["budget3", "budget16", "whole-prompts", "no-caching", "static"])
def test_matches_the_sync_engine_and_generate(model, workload, kw):
    prompts, params, ref = workload
    (sync, want), (overlap, got) = both(model, prompts, params, **kw)
    assert got == want == ref
    assert overlap.reasons == sync.reasons  # "stop" (value) and "length" alike


def test_prefix_caching_hits_as_often(model, workload):
    """Blocks completed by a placeholder are offered one step later (by append_slots), but
    every prompt block is offered at schedule time as before: the same hits."""
    prompts, params, ref = workload
    (sync, want), (overlap, got) = both(model, prompts, params, num_blocks=400,
                                        max_num_batched_tokens=24)
    assert got == want == ref
    assert overlap.prefix_cache_hit_rate() == sync.prefix_cache_hit_rate() > 0.1


def test_a_block_completed_by_a_placeholder_is_cached_one_step_later(model):
    """A's decode input at position 11 (its 6th generated token) completes block 2 while
    that token is still on the device: the block is cached by A's next append_slots, and
    B, whose prompt is A's prompt + 8 generated tokens, hits all 3 blocks, as in sync."""
    a = [5, 9, 14, 3, 77, 21]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    hits = []
    for overlap in (False, True):
        engine = LLMEngine(model, num_blocks=32, block_size=BS, async_scheduling=overlap)
        out_a = engine.generate([a], sp)[0]
        engine.generate([a + out_a[:8]], SamplingParams(max_tokens=2))
        hits.append(engine.block_manager.num_hit_tokens)
    assert hits == [12, 12]


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_with_a_token_in_flight(model, workload, caching, monkeypatch):
    """A tiny pool preempts requests whose last token is still a placeholder: they are
    re-admitted only at a later schedule, once it resolved (`_admit` asserts it)."""
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=24, block_size=BS, max_num_batched_tokens=64,
                       enable_prefix_caching=caching, async_scheduling=True)
    pending_at_preemption = []
    preempt = engine.scheduler._preempt

    def spy(req):
        pending_at_preemption.append(req.num_pending_tokens)
        preempt(req)

    monkeypatch.setattr(engine.scheduler, "_preempt", spy)
    assert run(engine, prompts, params) == ref
    assert any(pending_at_preemption), "no request was preempted with a token in flight"


@pytest.mark.parametrize("num_blocks", [64, 6])  # 6: the samples preempt each other
def test_parallel_sampling_and_seeds(model, num_blocks):
    """n > 1 forks (copy-on-write) and seeded temperature sampling: each request's
    generator is drawn in the same order for its own rows, so the same tokens."""
    prompt = [5, 9, 14, 3, 77, 21]
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=123, n=3,
                        ignore_eos=True)
    other = SamplingParams(max_tokens=7, temperature=1.1, top_p=0.9, seed=7)
    results = []
    for overlap in (False, True):
        engine = LLMEngine(model, num_blocks=num_blocks, block_size=BS,
                           async_scheduling=overlap)
        results.append(engine.generate([prompt, [8, 8, 40]], [sp, other]))
        assert engine.num_free_blocks() == num_blocks
        engine.block_manager.check_invariants()
    expected = [minillm.generate(model, prompt, 12, 0.9, 40, None, 123 + i, ignore_eos=True)
                for i in range(3)]
    assert results[1] == results[0] and results[1][:3] == expected


def test_value_stops_drop_the_extra_step(model, monkeypatch):
    """A request that ends on a stop token is already in the next step when its stop is
    read back: that row is computed and dropped; the output ends at the stop token."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(2, 20))] for _ in range(8)]
    free_runs = reference(model, prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * 8)
    # Stop each request on its own 4th greedy token: a value-based stop mid-run.
    params = [SamplingParams(max_tokens=12, stop_token_ids=(r[3],)) for r in free_runs]
    ref = reference(model, prompts, params)
    engine = LLMEngine(model, num_blocks=100, block_size=BS, async_scheduling=True)
    dropped = []
    resolve = engine.scheduler.resolve_tokens

    def spy(rows, now):
        kept = resolve(rows, now)
        dropped.append(len(rows) - len(kept))
        return kept

    monkeypatch.setattr(engine.scheduler, "resolve_tokens", spy)
    assert run(engine, prompts, params) == ref
    assert set(engine.reasons.values()) == {"stop"}
    assert all(len(r) <= 4 and r[-1] == sp.stop_token_ids[0] for r, sp in zip(ref, params))
    assert sum(dropped) == 8, "each stop should drop exactly its request's next row"


def test_aborts_drop_the_token_in_flight(model, workload):
    prompts, params, ref = workload
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = LLMEngine(model, num_blocks=100, block_size=BS, async_scheduling=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompts[i], sp)
    tokens = {}
    for _ in range(4):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    r1 = engine.requests["r1"][0]
    assert r1.num_pending_tokens == 1 and r1.output_token_ids[-1] == PENDING
    held = len(engine.block_manager.get_block_table(("r1", 0)))
    free_before = engine.num_free_blocks()
    engine.abort_request("r1")
    assert engine.num_free_blocks() == free_before + held  # freed at once, step in flight
    assert PENDING not in r1.output_token_ids
    engine.block_manager.check_invariants()
    outs = engine.step()
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [o.new_token_ids for o in outs if o.request_id == "r1"] == [[]]  # no late token
    aborted = next(o for o in outs if o.request_id == "r1")
    assert aborted.finished and aborted.finish_reason == "abort"
    assert aborted.token_ids == tokens["r1"]
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "r1"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    full = reference(model, prompts[:3], [sp] * 3)
    assert [tokens["r0"], tokens["r2"]] == [full[0], full[2]]
    assert tokens["r1"] == full[1][:len(tokens["r1"])]
    assert engine.num_free_blocks() == 100


def test_the_next_step_runs_before_the_last_is_read_back(model, monkeypatch):
    """The overlap itself: a spy logs the runner's executes and the read-backs."""
    import minillm.engine.overlap as overlap

    log = []
    engine = LLMEngine(model, num_blocks=64, block_size=BS, async_scheduling=True)
    execute = engine.runner.execute

    def spy_execute(out, prev=None):
        log.append(("execute", prev is not None))
        return execute(out, prev)

    class SpyReadBack(overlap.ReadBack):
        def tolist(self):
            log.append(("read", None))
            return super().tolist()

    monkeypatch.setattr(engine.runner, "execute", spy_execute)
    monkeypatch.setattr(overlap, "ReadBack", SpyReadBack)
    engine.generate([[5, 9, 14]], SamplingParams(max_tokens=4, ignore_eos=True))
    # Step 1 (prefill) has nothing in flight; steps 2..4 launch with the one before in
    # flight and are read back after the next launch; the last is read back alone.
    assert log == [("execute", False), ("execute", True), ("read", None),
                   ("execute", True), ("read", None), ("execute", True), ("read", None),
                   ("read", None)]


def test_a_failed_step_with_one_in_flight_loses_nothing(model, monkeypatch):
    """Step 3 raises while step 2 is in flight: step 3 is undone, step 2 resolved (its
    tokens reported by the next step()), and the engine then finishes exactly."""
    prompts = [[5, 9, 14, 3, 77, 21, 8], [40, 41, 42]]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = reference(model, prompts, [sp] * 2)
    engine = LLMEngine(model, num_blocks=64, block_size=BS, async_scheduling=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    tokens = {}
    for _ in range(2):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda out, prev=None: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    assert engine._in_flight is None
    assert all(r.num_pending_tokens == 0 for group in engine.requests.values()
               for r in group)
    assert engine.num_free_blocks() == 64  # both undone: waiting again, nothing held
    engine.block_manager.check_invariants()
    monkeypatch.setattr(engine.runner, "execute", real)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [tokens["r0"], tokens["r1"]] == ref


def test_placeholders_are_never_read_as_tokens(model):
    bm = BlockManager(8, BS)
    bm.allocate("s", [1, 2, 3])
    bm.append_slots("s", [1, 2, 3, PENDING], 1)
    with pytest.raises(ValueError, match="placeholder"):
        bm.cache_blocks("s", [1, 2, 3, PENDING], 4)
    with pytest.raises(ValueError, match="placeholder"):
        bm.allocate("t", [1, PENDING])
    # The runner: a placeholder input with no device id to take it from is an error.
    from minillm.engine.overlap import SampledIds
    with pytest.raises(RuntimeError, match="placeholder"):
        SampledIds(torch.zeros(1, dtype=torch.long), {}).source(("x", 0))


def test_the_default_is_on_for_cuda_only(model):
    from dataclasses import replace

    engine = LLMEngine(model, num_blocks=8, block_size=BS)
    assert engine.config.async_scheduling is False  # CPU: exactly the synchronous engine
    resolve = LLMEngine._resolve_scheduling
    assert resolve(engine._requested, torch.device("cuda")).async_scheduling is True
    assert resolve(engine._requested, torch.device("cpu")).async_scheduling is False
    forced = replace(engine._requested, async_scheduling=False)
    assert resolve(forced, torch.device("cuda")).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        minillm.EngineConfig(async_scheduling="yes")


def test_a_decode_step_after_a_step_that_sampled_nothing(model):
    """On the padded decode path: a 17-token prompt at 16 tokens a step leaves 1 token for
    the second step, a decode-shaped row, while the first step (a prompt chunk that
    sampled nothing) is in flight with no ids at all. No row is a placeholder, so nothing
    is gathered from those ids (a gather from an empty tensor: a device assert on CUDA)."""
    prompt = list(range(3, 20))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    want = minillm.generate(model, prompt, 6, ignore_eos=True, cuda_graph=False)
    for overlap in (False, True):
        engine = LLMEngine(model, block_size=BS, num_blocks=64, max_num_batched_tokens=16,
                           enforce_eager=False, async_scheduling=overlap)
        assert engine.generate([prompt], sp) == [want]
        assert engine.runner.graphs.num_padded_steps > 0
