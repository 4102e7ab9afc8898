"""LLMEngine == `minillm.generate` run alone on each prompt, token for token.

The oracle is the single-request reference: whatever the engine does (continuous batching,
chunked prefill down to 1-token budgets, prefix caching, preemption by recompute, n > 1
samples with copy-on-write, the Triton backend), every request's tokens must be the ones
`generate` gives for that prompt alone. The workload is 32 requests of mixed lengths, some
sharing prefixes so that prefix-cache hits really happen, on a tiny random-weight model
(block_size 4 so that requests span many blocks). After every step the block manager's
invariants hold, and once the engine drains every block is free.
"""
import dataclasses
import random

import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig
from minillm.engine import LLMEngine, SamplingParams
from minillm.attention import (PagedAttentionContext, PagedAttentionMetadata,
                               paged_decode_attention_ref, paged_prefill_attention_ref)
from minillm.paged import PagedKVCache

BS = 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are all per-op overhead; a second thread only adds contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()


def make_workload(n=32, seed=0):
    """Mixed prompt lengths (1..~70), three shared prefixes, mixed sampling params."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 128) for _ in range(k)] for k in (8, 13, 32)]
    prompts, params = [], []
    for i in range(n):
        own = [rng.randrange(3, 128) for _ in range(rng.randint(1, 40))]
        prompts.append((prefixes[i % 4] if i % 4 < 3 else []) + own)
        stops = (rng.randrange(3, 128), rng.randrange(3, 128)) if i % 5 == 0 else None
        params.append(SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=i % 2 == 0,
                                     stop_token_ids=stops))
    return prompts, params


def reference(model, prompts, params, seed_offset=0):
    return [minillm.generate(model, p, sp.max_tokens, sp.temperature, sp.top_k, sp.top_p,
                             None if sp.seed is None else sp.seed + seed_offset,
                             sp.stop_token_ids, sp.ignore_eos) for p, sp in zip(prompts, params)]


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = make_workload()
    return prompts, params, reference(model, prompts, params)


def run(engine, prompts, params, check_every_step=True):
    """Drive step() by hand; check invariants each step; return tokens per request."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    tokens, reasons, seen = {}, {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            assert out.token_ids == tokens[(out.request_id, out.index)]
            seen.append((out, list(out.token_ids)))
            if out.finished:
                reasons[(out.request_id, out.index)] = out.finish_reason
        if check_every_step:
            engine.block_manager.check_invariants()
    # An output's token_ids share the request's list: they must still read as when returned.
    assert all(out.token_ids == then for out, then in seen), "an earlier output changed"
    assert engine.num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"
    engine.block_manager.check_invariants()
    assert len(reasons) == sum(sp.n for sp in params), "a request never reported finished"
    engine.reasons = reasons
    return [tokens[(f"r{i}", 0)] for i in range(len(prompts))]


@pytest.mark.parametrize("budget", [1, 3, 16, 1000])
def test_chunked_prefill_matches_generate(model, workload, budget):
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=400, block_size=BS, max_num_batched_tokens=budget,
                       max_num_seqs=8)
    assert run(engine, prompts, params, check_every_step=budget > 1) == ref
    s = engine.stats()
    assert s["num_batched_tokens"] <= budget * s["num_steps"]
    assert set(engine.reasons.values()) == {"stop", "length"}


def test_without_chunked_prefill_matches_generate(model, workload):
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=400, block_size=BS, max_num_batched_tokens=128,
                       chunked_prefill=False)
    assert run(engine, prompts, params) == ref


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_matches_generate(model, workload, caching):
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=400, block_size=BS, max_num_batched_tokens=24,
                       enable_prefix_caching=caching)
    assert run(engine, prompts, params) == ref
    if caching:
        assert engine.prefix_cache_hit_rate() > 0.1, "shared prefixes should hit the cache"
    else:
        assert engine.prefix_cache_hit_rate() == 0.0


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_matches_generate(model, workload, caching):
    prompts, params, ref = workload
    # 24 blocks of 4 tokens: the longest request (72 + 19 tokens) barely fits alone.
    engine = LLMEngine(model, num_blocks=24, block_size=BS, max_num_batched_tokens=64,
                       enable_prefix_caching=caching)
    assert run(engine, prompts, params) == ref
    assert engine.stats()["num_preemptions"] > 0, "the pool should have been too small"


@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_both_cpu_decode_paths_match_generate(model, workload, path):
    """The C++ kernel (the CPU default) and the PyTorch gather path give generate's tokens."""
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=400, block_size=BS, max_num_batched_tokens=24,
                       decode_path=path)
    assert engine.config.decode_path == path
    assert run(engine, prompts, params) == ref


def test_cpu_engine_defaults_to_the_kernel(model):
    assert LLMEngine(model, num_blocks=8, block_size=BS).config.decode_path == "kernel"
    with pytest.raises(ValueError, match="decode_path must be None"):
        LLMEngine(model, num_blocks=8, block_size=BS, decode_path="fast")


def test_static_scheduling_matches_generate(model, workload):
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=400, block_size=BS, max_num_seqs=8,
                       scheduling="static")
    assert run(engine, prompts, params) == ref


def test_generate_convenience_and_metrics(model, workload):
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=400, block_size=BS)
    assert engine.generate(prompts[:6], params[:6]) == ref[:6]
    m = engine.finished_metrics[("generate-1-0", 0)]
    assert 0 <= m.queue_time <= m.ttft <= m.e2e
    assert len(m.itl) == len(ref[0]) - 1 and all(x >= 0 for x in m.itl)
    assert m.e2e == pytest.approx(m.ttft + sum(m.itl))
    s = engine.stats()
    assert s["num_generated_tokens"] == sum(len(r) for r in ref[:6])
    assert s["num_running"] == s["num_waiting"] == s["num_used_blocks"] == 0


def test_finished_metrics_keep_only_the_most_recent(model, workload):
    """A long-running server must not keep every request's metrics forever."""
    prompts, params, _ = workload
    engine = LLMEngine(model, num_blocks=400, block_size=BS)
    engine.max_finished_metrics = 3
    for i in range(6):
        engine.add_request(f"r{i}", prompts[i], params[i])
    finish_order = []
    while engine.has_unfinished_requests():
        finish_order += [(o.request_id, o.index) for o in engine.step() if o.finished]
    assert len(finish_order) == 6
    assert list(engine.finished_metrics) == finish_order[-3:]


@pytest.mark.parametrize("num_blocks", [64, 6])  # 6: the samples preempt each other
def test_parallel_sampling_forks_with_copy_on_write(model, num_blocks):
    prompt = [5, 9, 14, 3, 77, 21]  # 6 tokens: the last block is half full, so it is shared
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=123, n=3,
                        ignore_eos=True)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=BS)
    samples = engine.generate([prompt, [8, 8]], [sp, SamplingParams(max_tokens=3)])
    expected = [minillm.generate(model, prompt, 12, 0.9, 40, None, 123 + i, ignore_eos=True)
                for i in range(3)]
    assert samples[:3] == expected
    assert len({tuple(s) for s in samples[:3]}) > 1, "different seeds should differ"
    assert engine.stats()["num_cow_copies"] >= 2
    assert (engine.stats()["num_preemptions"] > 0) == (num_blocks == 6)
    assert engine.num_free_blocks() == num_blocks
    engine.block_manager.check_invariants()


def test_abort_frees_blocks_at_once(model, workload):
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=100, block_size=BS)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompts[i], sp)
    engine.step()
    engine.step()
    held = len(engine.block_manager.get_block_table(("r1", 0)))
    free_before = engine.num_free_blocks()
    engine.abort_request("r1")
    assert engine.num_free_blocks() == free_before + held  # all of r1's blocks, at once
    engine.block_manager.check_invariants()
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "r1"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks() == 100
    engine.abort_request("r0")  # finished or unknown: a no-op


def test_admission_errors(model):
    engine = LLMEngine(model, num_blocks=8, block_size=BS)
    engine.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("a", [4, 5])
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("long", [3] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="could never run"):
        engine.add_request("big", [3] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [])
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.add_request("v", [500])
    no_chunks = LLMEngine(model, num_blocks=64, block_size=BS, chunked_prefill=False,
                          max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="chunked prefill"):
        no_chunks.add_request("x", [3] * 14, SamplingParams(max_tokens=8))


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(n=0), "n "),
    (dict(seed=-3), "seed"), (dict(stop_token_ids=["x"]), "stop_token_ids")])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_default_pool_is_sized_from_a_budget(model):
    per_block = PagedKVCache.block_bytes(2, BS, 2, 16, torch.float32)
    engine = LLMEngine(model, block_size=BS, kv_cache_memory_bytes=10 * per_block + 5)
    assert engine.block_manager.num_blocks == 10
    engine = LLMEngine(model, block_size=BS, max_num_seqs=2)  # capped: 2 full-length seqs
    assert engine.block_manager.num_blocks == 2 * 256 // BS


def test_the_token_budget_defaults_by_device(model):
    """None resolves to 512 tokens a step on a CPU (compute-bound there) and 8192 on CUDA
    (host-bound eager steps: fewer, larger chunks); a given budget is kept on either."""
    from types import SimpleNamespace

    cuda_model = SimpleNamespace(config=model.config, device=torch.device("cuda"),
                                 dtype=model.dtype)
    for m, want in ((model, 512), (cuda_model, 8192)):
        resolved = LLMEngine._resolve_sizes(minillm.EngineConfig(num_blocks=8), m)
        assert resolved.max_num_batched_tokens == want
        kept = LLMEngine._resolve_sizes(
            minillm.EngineConfig(num_blocks=8, max_num_batched_tokens=96), m)
        assert kept.max_num_batched_tokens == 96


@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_paged_context_matches_reference(path):
    """Decodes (C++ kernel / torch gather path) and prefill chunks vs the reference."""
    g = torch.Generator().manual_seed(0)
    num_blocks, hq, hkv, d = 80, 4, 2, 16
    cache = PagedKVCache(1, num_blocks, BS, hkv, d)
    cache.k_caches[0].copy_(torch.randn(cache.k_caches[0].shape, generator=g))
    cache.v_caches[0].copy_(torch.randn(cache.v_caches[0].shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # (start, query_len): decodes sorted by length (two length groups), then prefill
    # chunks with and without a cached prefix.
    decodes = [(s, 1) for s in (0, 2, 5, 6, 9, 12, 17, 20, 30, 45, 50)]
    shapes = decodes + [(0, 9), (8, 5), (3, 2)]
    tables, used = [], 0
    for start, qlen in shapes:
        n = -(-(start + qlen) // BS)
        tables.append(perm[used:used + n])
        used += n
    meta = PagedAttentionMetadata.build([(t, s, q) for t, (s, q) in zip(tables, shapes)], BS)
    assert [(i, j) for i, j, _, _ in meta.decode_groups] == [(0, 8), (8, 11)]
    N = sum(q for _, q in shapes)
    q = torch.randn(1, N, hq, d, generator=g)
    k, v = torch.randn(1, N, hkv, d, generator=g), torch.randn(1, N, hkv, d, generator=g)
    out = PagedAttentionContext(minillm.attention.TorchBackend(), cache, meta,
                                path).attend(0, q, k, v)
    bt = torch.zeros(len(shapes), 16, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    ctx = torch.tensor([s + ql for s, ql in shapes], dtype=torch.int32)
    starts = torch.tensor([0] + [ql for _, ql in shapes]).cumsum(0).int()
    expected = paged_prefill_attention_ref(q[0], cache.k_caches[0], cache.v_caches[0], bt,
                                           starts, ctx)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    nd = len(decodes)
    decode = paged_decode_attention_ref(q[0, :nd], cache.k_caches[0], cache.v_caches[0],
                                        bt[:nd], ctx[:nd])
    torch.testing.assert_close(out[0, :nd], decode, atol=1e-5, rtol=1e-5)
    # The torch backend splits the prefill rows by the host copy of cu_seqlens: reading the
    # device tensors back would sync once per layer on CUDA. Without them: the same output.
    assert meta.cu_seqlens_host == (tuple(meta.cu_seqlens_q.tolist()),
                                    tuple(meta.cu_seqlens_k.tolist()))
    host_only = dataclasses.replace(meta, cu_seqlens_q=None, cu_seqlens_k=None)
    again = PagedAttentionContext(minillm.attention.TorchBackend(), cache, host_only,
                                  path).attend(0, q, k, v)
    assert torch.equal(again, out)


def test_triton_backend_matches_torch_backend(model):
    """Tiny workload only: the Triton interpreter takes ~0.1-0.4 s per kernel call."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [7, 7, 7, 7, 7]]
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    torch_out = LLMEngine(model, num_blocks=32, block_size=BS).generate(prompts, sp)
    triton_model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()
    triton_model.set_attn_backend("triton")
    triton_out = LLMEngine(triton_model, num_blocks=32, block_size=BS).generate(prompts, sp)
    assert triton_out == torch_out
    assert torch_out == reference(model, prompts, [sp] * 3)
    # The engine's own backend (EngineConfig.attn_backend) over a torch-backend model: the
    # same tokens, and the model keeps its backend.
    engine = LLMEngine(model, num_blocks=32, block_size=BS, attn_backend="triton")
    assert engine.config.attn_backend == "triton" and engine.runner.backend.name == "triton"
    assert engine.generate(prompts, sp) == torch_out and model.attn_backend.name == "torch"


def test_on_cuda_the_engine_attends_with_triton_whatever_the_model_has(model):
    """With the torch backend every decode step would run eagerly on CUDA (its gather
    cannot be captured) and be launch-bound; the engine takes Triton there unless asked
    otherwise. A CUDA model is pretended: only its device and backend are asked."""
    from minillm.engine.llm_engine import engine_attn_backend

    class OnCuda:
        device, attn_backend = torch.device("cuda", 0), model.attn_backend

    assert engine_attn_backend(None, OnCuda()).name == "triton"
    assert engine_attn_backend("torch", OnCuda()).name == "torch"
    assert engine_attn_backend(None, model) is model.attn_backend  # a CPU: the model's own
    with pytest.raises(ValueError, match="EngineConfig.attn_backend must be None"):
        minillm.EngineConfig(attn_backend="flash")


@pytest.mark.slow
def test_real_model_matches_generate(smollm):
    model, tokenizer = smollm
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain why the sky is blue.", "List three prime numbers.",
                 "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
                 "What is 17 times 3?", "Describe a cat in one sentence."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in questions]
    params = [SamplingParams(max_tokens=12 + 2 * i) for i in range(8)]
    ref = reference(model, prompts, params)
    engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=48)
    assert run(engine, prompts, params, check_every_step=False) == ref
    assert engine.prefix_cache_hit_rate() > 0  # the chat template's common start


# ---- prefix caching for requests admitted together; blocks reserved per chunk ----------
def shared_prefix_prompts(n=6, prefix_len=80, seed=3):
    """One 80-token "system prompt", then a short question of each request's own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 128) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 128) for _ in range(rng.randint(3, 12))]
            for _ in range(n)]


def test_requests_admitted_together_share_their_prefix(model):
    prompts = shared_prefix_prompts()
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = reference(model, prompts, [sp] * len(prompts))
    computed = {}
    for caching in (True, False):
        engine = LLMEngine(model, num_blocks=200, block_size=16, enable_prefix_caching=caching)
        assert engine.generate(prompts, sp) == ref
        s = engine.stats()
        computed[caching] = s["num_computed_prompt_tokens"]
        if caching:
            # All six are admitted in the first step; the first computes the prefix, the
            # other five hit its 5 full blocks in that same step.
            assert engine.num_steps == 8
            assert engine.prefix_cache_hit_rate() > 0.5
            assert s["num_computed_prompt_tokens"] == sum(map(len, prompts)) - 5 * 80
        assert engine.num_free_blocks() == 200
        engine.block_manager.check_invariants()
    assert computed[False] == sum(map(len, prompts))
    assert computed[True] < computed[False]


def test_blocks_are_reserved_per_chunk(model):
    engine = LLMEngine(model, num_blocks=64, block_size=BS, max_num_batched_tokens=16)
    engine.add_request("a", list(range(3, 43)), SamplingParams(max_tokens=2))  # 40 tokens
    engine.step()  # the first 16-token chunk: 4 blocks, not the prompt's 10
    assert len(engine.block_manager.get_block_table(("a", 0))) == 4
    assert engine.stats()["num_kv_tokens"] == 16
    engine.step()
    assert len(engine.block_manager.get_block_table(("a", 0))) == 8
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks() == 64


@pytest.mark.parametrize("num_blocks", [24, 30])
def test_per_chunk_allocation_under_a_tiny_pool(model, workload, num_blocks):
    """Chunks and decodes compete for a pool far too small for the workload: requests are
    preempted mid-prefill and mid-decode, and every output is still exact."""
    prompts, params, ref = workload
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=12,
                       max_num_seqs=6)
    assert run(engine, prompts, params) == ref
    assert engine.stats()["num_preemptions"] > 0
    assert engine.num_free_blocks() == num_blocks


def test_admission_keeps_the_watermark_free(model):
    engine = LLMEngine(model, num_blocks=100, block_size=BS, watermark=0.2)  # keep 20 free
    assert engine.config.watermark_blocks() == 20
    engine.add_request("a", [5] * 200, SamplingParams(max_tokens=4))  # 50 blocks
    engine.add_request("b", [6] * 160, SamplingParams(max_tokens=1))  # 40 blocks
    engine.step()
    # a is admitted (nothing was running); b would leave 10 < 20 free, so it waits.
    assert [r.request_id for r in engine.scheduler.running] == ["a"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks() == 100


def test_a_failed_forward_pass_loses_nothing(model, monkeypatch):
    """If the model raises mid-step (a KeyboardInterrupt in a notebook), the step is undone:
    its requests wait again, its blocks are free, and no block whose KV was never written
    stays in the prefix cache. The engine then finishes with exact outputs."""
    prompts = shared_prefix_prompts(n=3, prefix_len=24)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = reference(model, prompts, [sp] * 3)
    engine = LLMEngine(model, num_blocks=64, block_size=BS)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    real = engine.runner.execute

    def broken(out):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.num_free_blocks() == 64
    assert engine.block_manager.pool.cached_blocks() == {}
    assert [r.request_id for r in engine.scheduler.waiting] == ["r0", "r1", "r2"]
    engine.block_manager.check_invariants()
    monkeypatch.setattr(engine.runner, "execute", real)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(3)] == ref


def test_engine_config_is_the_one_source_of_options(model):
    config = minillm.EngineConfig(block_size=8, num_blocks=40, max_num_seqs=4,
                                  max_num_batched_tokens=32, enable_prefix_caching=False)
    engine = LLMEngine(model, config=config)
    assert engine.config.block_size == engine.block_manager.block_size == 8
    assert engine.kv_cache.block_size == 8 and engine.scheduler.max_num_seqs == 4
    assert engine.config.max_model_len == model.config.max_position_embeddings  # resolved
    assert engine.config.decode_path == engine.runner.config.decode_path == "kernel"
    # The keyword form builds the same config.
    assert LLMEngine(model, block_size=8, num_blocks=40, max_num_seqs=4,
                     max_num_batched_tokens=32, enable_prefix_caching=False).config == engine.config
    with pytest.raises(TypeError, match="either config"):
        LLMEngine(model, config=config, block_size=4)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLMEngine(model, num_block=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), r"block_size must be an int >= 1"),
    (dict(num_blocks=-2), r"num_blocks must be an int >= 1 or None"),
    (dict(max_num_seqs=2.5), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False"),
    (dict(scheduling="fifo"), r"scheduling \(the batching policy\) must be one of"),
    (dict(decode_path="fast"), "decode_path must be None"),
    (dict(watermark=1.5), r"watermark must be a fraction of the pool in \[0, 1\)"),
    (dict(max_model_len=0), "max_model_len"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        minillm.EngineConfig(**kwargs)


def test_token_prefix_reads_the_tokens_in_place():
    """`Request.token_prefix(end)`: what the scheduler hands the block manager instead of a
    copy of every token: the same values as all_token_ids[:end], by index and by slice."""
    from minillm.engine.request import Request

    r = Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    r.output_token_ids += [10, 11]
    full = r.all_token_ids
    for end in range(len(full) + 1):
        p = r.token_prefix(end)
        assert len(p) == end and list(p) == full[:end]
        for a in range(-end - 1, end + 2):
            for b in range(-end - 1, end + 2):
                assert p[a:b] == full[:end][a:b]
        assert p[::2] == full[:end][::2]
        for i in range(-end, end):
            assert p[i] == full[:end][i]
        for i in (end, -end - 1):
            with pytest.raises(IndexError):
                p[i]
