"""Decode steps through CUDA graphs (`minillm.engine.cuda_graph`, `minillm.decode_graph`)
give exactly eager's tokens, and the padded rows change nothing.

The oracle is eager: the engine with `enforce_eager=True` and `generate(cuda_graph=False)`.
On a CPU the padded static path runs without capture (that is what `enforce_eager=False`
and `cuda_graph=True` do there), so these tests cover the bucketing, the padding and the
static buffers; on CUDA the same tests run the captured graphs (Triton attention: the
paged-decode kernel inside the graph), and the CUDA-only tests at the end check that graphs
were really captured and replayed, that a step makes no host sync, and that a compiled
step with Triton attention compiles. Tiny random-weight model (block_size 4), except where
equality on the real SmolLM2 is the point.
"""
import random
import warnings

import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig, decode_graph
from minillm.engine import LLMEngine, SamplingParams
from minillm.engine.cuda_graph import capture_sizes

BS = 4
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Graphs need a graph-safe decode path: Triton on CUDA; on a CPU the torch backend's C++
# kernel runs the padded path fast (Triton's interpreter would take minutes).
BACKEND = "triton" if CUDA else "torch"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: on a CPU nothing is "
                                "captured (the padded path runs uncaptured in the tests above)")


@pytest.fixture(scope="module")
def model():
    m = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval().to(DEVICE)
    return m.set_attn_backend(BACKEND)


def make_workload(n=40, seed=0):
    """Mixed prompt lengths, three shared prefixes, max_tokens spread so that the decode
    batch shrinks across the bucket edges as requests finish."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 128) for _ in range(k)] for k in (8, 13, 5)]
    prompts = [(prefixes[i % 4] if i % 4 < 3 else []) + [rng.randrange(3, 128) for _ in
                                                         range(rng.randint(1, 12))]
               for i in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = make_workload()
    ref = [minillm.generate(model, p, sp.max_tokens, ignore_eos=True, cuda_graph=False)
           for p, sp in zip(prompts, params)]
    return prompts, params, ref


def engine(model, **kw):
    kw = {"num_blocks": 400, "block_size": BS, **kw}
    return LLMEngine(model, **kw)


def drive(engines, prompts, params, aborts=None):
    """Run engines in lockstep on the same requests (aborting `aborts[step]` ids before that
    step); after every step their block pools agree and hold their invariants. Returns each
    engine's tokens per request (aborted ones: what they had)."""
    aborts = aborts or {}
    for e in engines:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            e.add_request(f"r{i}", p, sp)
    tokens = [{} for _ in engines]
    step = 0
    while engines[0].has_unfinished_requests():
        for e, toks in zip(engines, tokens):
            for rid in aborts.get(step, []):
                e.abort_request(rid)
            for out in e.step():
                toks.setdefault(out.request_id, []).extend(out.new_token_ids)
            e.block_manager.check_invariants()
        assert len({e.num_free_blocks() for e in engines}) == 1, "the pools diverged"
        step += 1
    for e in engines:
        assert not e.has_unfinished_requests()
        assert e.num_free_blocks() == e.block_manager.num_blocks, "blocks leaked"
    return [[toks.get(f"r{i}", []) for i in range(len(prompts))] for toks in tokens]


def test_capture_sizes():
    assert capture_sizes(64, 512) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40, 512) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(3, 512) == [1, 2, 3] and capture_sizes(1, 512) == [1]
    assert capture_sizes(600, 512)[-3:] == [480, 496, 512]


@pytest.mark.parametrize("n", [1, 3, 17, 40])
def test_padded_decode_matches_eager_across_bucket_edges(model, workload, n):
    prompts, params, ref = workload
    padded = engine(model, max_num_seqs=n, enforce_eager=False)
    assert padded.config.enforce_eager is False and padded.runner.graphs is not None
    eager = engine(model, max_num_seqs=n, enforce_eager=True)
    got, want = drive([padded, eager], prompts[:n], params[:n])
    assert got == want == ref[:n]
    graphs = padded.runner.graphs
    assert graphs.num_padded_steps > 0, "no decode-only step took the padded path"
    assert graphs.num_padded_steps < padded.num_steps  # prefill steps stayed eager


@pytest.mark.parametrize("n", [1, 3, 17, 40])
def test_async_scheduling_on_the_padded_path(model, workload, n):
    """Async scheduling (`minillm.engine.overlap`): a padded decode step's pending input
    ids are gathered from the step in flight's ids on the device, after the copy and
    before the replay. Same tokens as eager, across the bucket edges."""
    prompts, params, ref = workload
    e = engine(model, max_num_seqs=n, enforce_eager=False, async_scheduling=True)
    graphs = e.runner.graphs
    fills, fill = [], graphs._fill_pending  # which gathers ran: the steady state's copy ...

    def spy(rows, ids, sources):
        fills.append(sources == list(range(rows)))
        fill(rows, ids, sources)
    graphs._fill_pending = spy
    for i in range(n):
        e.add_request(f"r{i}", prompts[i], params[i])
    tokens = {}
    while e.has_unfinished_requests():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        e.block_manager.check_invariants()
    assert [tokens[f"r{i}"] for i in range(n)] == ref[:n]
    assert graphs.num_padded_steps > 0, "no decode-only step took the padded path"
    assert True in fills  # ... and, once a request finished before the others, the gather
    assert (False in fills) == (n > 1)
    assert e.num_free_blocks() == e.block_manager.num_blocks


def test_padded_rows_leave_the_cache_as_eager(model, workload):
    """11 sequences (buckets 16, 8, 4, 2, 1 as they finish): every block of the cache holds
    the same K/V bits as after the eager run, and only the trash row took the padding."""
    prompts, params, ref = workload
    padded = engine(model, max_num_seqs=11, enforce_eager=False, enable_prefix_caching=False)
    eager = engine(model, max_num_seqs=11, enforce_eager=True, enable_prefix_caching=False)
    got, want = drive([padded, eager], prompts[:11], params[:11])
    assert got == want == ref[:11]
    for layer in range(model.config.num_layers):
        for a, b in ((padded.kv_cache.k_caches[layer], eager.kv_cache.k_caches[layer]),
                     (padded.kv_cache.v_caches[layer], eager.kv_cache.v_caches[layer])):
            if CUDA:  # cuBLAS may sum an 11-row and a 16-row product in different orders
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            else:  # the CPU's small-M kernel and fused glue are batch-invariant: same bits
                assert torch.equal(a, b), f"layer {layer}: a padded row wrote into a block"
    trash = padded.kv_cache._k_flat[0][padded.kv_cache.trash_slot]
    assert trash.abs().sum() > 0, "the padded rows should have written the trash row"
    assert eager.kv_cache._k_flat[0][eager.kv_cache.trash_slot].abs().sum() == 0


@pytest.mark.parametrize("caching", [True, False])
def test_padded_decode_under_preemption(model, workload, caching):
    prompts, params, ref = workload
    # 20 blocks of 4 tokens for up to 24 sequences: the running ones preempt each other.
    kw = dict(num_blocks=20, max_num_seqs=24, enable_prefix_caching=caching)
    padded = engine(model, enforce_eager=False, **kw)
    eager = engine(model, enforce_eager=True, **kw)
    got, want = drive([padded, eager], prompts[:24], params[:24])
    assert got == want == ref[:24]
    assert padded.stats()["num_preemptions"] > 0, "the pool should have been too small"
    assert padded.runner.graphs.num_padded_steps > 0


def test_padded_decode_with_prefix_caching(model, workload):
    prompts, params, ref = workload
    padded = engine(model, max_num_seqs=32, enforce_eager=False, max_num_batched_tokens=32)
    got = drive([padded], prompts[:32], params[:32])[0]
    assert got == ref[:32]
    assert padded.prefix_cache_hit_rate() > 0.1, "shared prefixes should hit the cache"


def test_padded_decode_with_aborts(model, workload):
    prompts, params, _ = workload
    aborts = {3: ["r0", "r5"], 6: ["r2", "r11", "r12"], 9: ["r7"]}
    padded = engine(model, max_num_seqs=16, enforce_eager=False)
    eager = engine(model, max_num_seqs=16, enforce_eager=True)
    got, want = drive([padded, eager], prompts[:16], params[:16], aborts)
    assert got == want


def test_more_sequences_than_the_largest_bucket_run_eagerly(model, workload):
    prompts, params, ref = workload
    with pytest.warns(UserWarning, match=r"max_num_seqs=17 is above the largest CUDA-graph "
                                         r"batch \(max_cudagraph_capture_size=8\)"):
        padded = engine(model, max_num_seqs=17, enforce_eager=False, max_cudagraph_capture_size=8)
    assert padded.runner.graphs.sizes == [1, 2, 4, 8]
    assert drive([padded], prompts[:17], params[:17])[0] == ref[:17]
    assert 0 < padded.runner.graphs.num_padded_steps


def test_seeded_sampling_through_the_padded_path(model):
    prompts = [[5, 6, 7], [9, 9], [40, 41, 42, 43]]
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, n=2)
    padded = engine(model, enforce_eager=False).generate(prompts, sp)
    assert padded == engine(model, enforce_eager=True).generate(prompts, sp)
    assert len(set(map(tuple, padded))) > 1  # the samples differ: real sampling


def test_enforce_eager_resolves_once_and_config_follows(model):
    e = engine(model)
    assert e.config.enforce_eager is (not CUDA)  # None -> graphs on CUDA, eager on a CPU
    assert (e.runner.graphs is None) == e.config.enforce_eager
    assert e.runner.config is e.config
    if not CUDA:
        with pytest.raises(ValueError, match="cannot serve decode_path='gather'"):
            engine(model, enforce_eager=False, decode_path="gather")
        e.set_decode_path("gather")
        assert e.config.decode_path == e.runner.config.decode_path == "gather"
        assert e.config.enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be None"):
        minillm.EngineConfig(enforce_eager="yes")


# ----------------------------------------------------------------------------- generate


def test_generate_graph_step_matches_eager(model):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for n in (1, 40, 200):  # 200: a second, larger static cache (tiny's 256-token context)
        eager = minillm.generate(model, prompt, n, ignore_eos=True, cuda_graph=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = minillm.generate(model, prompt, n, ignore_eos=True, cuda_graph=True)
        assert graph == eager, n
    seeded = dict(temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (minillm.generate(model, prompt, 30, cuda_graph=True, **seeded)
                == minillm.generate(model, prompt, 30, cuda_graph=False, **seeded))


def test_greedy_graph_decoding_stops_where_eager_stops(model):
    """Greedy graph decoding reads its tokens one step behind the device (DecodeGraph.greedy):
    a stop token mid-sequence, and 1 or 2 new tokens, end exactly where eager ends."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    full = minillm.generate(model, prompt, 30, ignore_eos=True, cuda_graph=False)
    stop = full[12]
    expected = full[:full.index(stop) + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert minillm.generate(model, prompt, 30, stop_token_ids=[stop], ignore_eos=True,
                                cuda_graph=True) == expected
        for n in (1, 2):
            assert minillm.generate(model, prompt, n, ignore_eos=True, cuda_graph=True) == full[:n]
        stream = minillm.generate_stream(model, prompt, 30, ignore_eos=True, cuda_graph=True)
        assert [next(stream) for _ in range(5)] == full[:5]
        stream.close()  # a consumer that leaves early: the next call starts clean
        assert minillm.generate(model, prompt, 30, ignore_eos=True, cuda_graph=True) == full


@pytest.mark.skipif(CUDA, reason="the CPU's message: on CUDA cuda_graph=True captures")
def test_cuda_graph_on_a_cpu_warns_once_and_runs_uncaptured(model, monkeypatch):
    monkeypatch.setattr(decode_graph, "_WARNED", set())
    with pytest.warns(UserWarning, match="without capturing it: the same tokens, no speed-up"):
        minillm.generate(model, [5, 6], 3, cuda_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second call is silent
        minillm.generate(model, [5, 6], 3, cuda_graph=True)
    graph = model._decode_graphs[(1, False)]
    assert graph.graph is None and graph.num_replays == 0
    assert minillm.generate(model, [5, 6], 3) == minillm.generate(model, [5, 6], 3,
                                                                  cuda_graph=False)


def test_cuda_graph_needs_the_default_cache_functions(model):
    with pytest.raises(ValueError, match="cuda_graph=True needs use_cache=True"):
        minillm.generate(model, [5, 6], 3, cuda_graph=True, use_cache=False)


@pytest.mark.slow
def test_real_model_graph_paths_match_eager(smollm):
    model, tok = smollm
    prompt = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    eager = minillm.generate(model, prompt, 24, ignore_eos=True, cuda_graph=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert minillm.generate(model, prompt, 24, ignore_eos=True, cuda_graph=True) == eager
    prompts = [prompt, prompt[:9], prompt[3:20]]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    padded = LLMEngine(model, num_blocks=64, enforce_eager=False).generate(prompts, sp)
    assert padded == LLMEngine(model, num_blocks=64).generate(prompts, sp)
    assert padded[0] == eager[:12]


# ----------------------------------------------------------------------------- CUDA only


@needs_cuda
def test_engine_captures_one_graph_per_bucket_and_replays(model, workload):
    prompts, params, ref = workload
    e = engine(model, max_num_seqs=40)  # the CUDA default: graphs
    graphs = e.runner.graphs
    assert sorted(graphs.graphs) == graphs.sizes == [1, 2, 4, 8, 16, 32, 40]
    assert drive([e], prompts, params)[0] == ref
    assert graphs.num_replays == graphs.num_padded_steps > 0


@needs_cuda
def test_a_step_makes_no_host_sync(model, workload):
    """Inside execute (inputs up, forward, logits) nothing waits for the GPU; the one read
    back is the sampled ids, after it."""
    prompts, params, _ = workload
    e = engine(model, max_num_seqs=8, enable_prefix_caching=False)
    drive([e], prompts[:8], params[:8])  # first: Triton's autotuning synchronizes
    real = e.runner.execute

    def checked(out, prev=None):  # prev: async scheduling's step in flight (the default)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(out, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    e.runner.execute = checked
    drive([e], prompts[:8], params[:8])  # the same shapes again: nothing left to autotune
    assert e.runner.graphs.num_replays > 0 and e.runner.staging.num_copies > 0


@needs_cuda
def test_async_scheduling_matches_sync_on_the_device(model, workload):
    """The CUDA defaults (decode graphs, piecewise graphs) with and without async
    scheduling: the same tokens and finish reasons, with stops found by value (the step
    after a stop is computed and dropped) and seeded sampling of forks."""
    prompts, params, _ = workload
    firsts = [minillm.generate(model, p, 3, ignore_eos=True)[-1] for p in prompts[:3]]
    sps = [SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True, stop_token_ids=firsts)
           for sp in params[:20]]
    sps += [SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=i, n=2)
            for i in range(4)]
    outs = []
    for overlap in (False, True):
        e = engine(model, max_num_seqs=16, async_scheduling=overlap)
        assert e.config.async_scheduling is overlap
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            e.add_request(f"r{i}", p, sp)
        done = {}
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    done[o.request_id, o.index] = (o.token_ids, o.finish_reason)
        outs.append(done)
    assert outs[0] == outs[1] and len(outs[0]) == 20 + 4 * 2
    assert {reason for _, reason in outs[0].values()} == {"stop", "length"}


@needs_cuda
def test_a_whole_async_step_makes_no_host_sync(model, workload):
    """All of step() with async scheduling (the CUDA default): the inputs, copy-on-write
    for forked samples (n = 2), the forward through decode graphs or piecewise graphs,
    greedy sampling on the device, and the read-back of the step before through its own
    event (an event's wait is not a stream or device sync, so the debug mode allows it)."""
    prompts, params, _ = workload
    sps = [SamplingParams(max_tokens=sp.max_tokens + 4, ignore_eos=True, n=2)
           for sp in params[:8]]
    e = engine(model, max_num_seqs=16)
    assert e.config.async_scheduling and e.runner.pieces is not None
    drive([e], prompts[:8], sps)  # first: Triton compiles, the first copy into pinned memory
    for i, (p, sp) in enumerate(zip(prompts[:8], sps)):
        e.add_request(f"again{i}", p, sp)
    cow = e.num_cow_copies
    torch.cuda.set_sync_debug_mode("error")
    try:
        while e.has_unfinished_requests():
            e.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert e.num_cow_copies > cow, "the forks should have copied a shared last block"
    assert e.num_free_blocks() == e.block_manager.num_blocks


@needs_cuda
@pytest.mark.parametrize("compile", [False, True])
def test_generate_replays_the_captured_step(model, compile):
    """compile=True: the torch.compile'd step with Triton attention (Inductor compiles the
    paged-decode kernel: it failed on the H100 before the fp32 scale fix), captured."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    eager = minillm.generate(model, prompt, 40, ignore_eos=True, cuda_graph=False)
    graph_tokens = minillm.generate(model, prompt, 40, ignore_eos=True, cuda_graph=True,
                                    compile=compile)
    assert graph_tokens == eager
    g = model._decode_graphs[(1, compile)]
    assert g.graph is not None and g.num_replays >= 39
