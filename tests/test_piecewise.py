"""Prefill and mixed steps through piecewise CUDA graphs (`minillm.engine.piecewise`) give
exactly the unpadded eager step's tokens, and the padded rows change nothing.

The oracle is eager: the engine with `piecewise_graphs=False`, and `generate`. On a CPU the
pieces run uncaptured (`piecewise_graphs=True` there runs the padded forward with attention
inline, through the same static buffers), so these tests cover the token buckets, the
padding, the static slot_mapping and the buffers between pieces; the capture and replay
order is checked with stand-in graphs that log what they are asked to do. On CUDA the same
tests run the captured pieces (Triton attention eager between them), and the CUDA-only
tests at the end check that every bucket was captured as num_layers + 1 graphs and
replayed. Tiny random-weight model (block_size 4).
"""
import random

import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig
from minillm.engine import LLMEngine, SamplingParams
from minillm.engine import piecewise
from minillm.engine.piecewise import PiecewiseGraphs, token_buckets
from minillm.layers import fused

BS = 4
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BACKEND = "triton" if CUDA else "torch"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: on a CPU nothing is "
                                "captured (the pieces run inline in the tests above)")


@pytest.fixture(scope="module")
def model():
    m = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval().to(DEVICE)
    return m.set_attn_backend(BACKEND)


@pytest.fixture(scope="module")
def workload(model):
    """Prompts of 1-40 tokens, some sharing a prefix, and outputs of 1-20 tokens: with a
    small token budget, steps mix decodes with prompt chunks of every size."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 128) for _ in range(9)]
    prompts = [(prefix if i % 3 == 0 else []) + [rng.randrange(3, 128)
                                                 for _ in range(rng.randint(1, 31))]
               for i in range(16)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    ref = [minillm.generate(model, p, sp.max_tokens, ignore_eos=True, cuda_graph=False)
           for p, sp in zip(prompts, params)]
    return prompts, params, ref


def engine(model, **kw):
    kw = {"num_blocks": 400, "block_size": BS, "max_num_batched_tokens": 48, **kw}
    return LLMEngine(model, **kw)


def serve(e, prompts, params, aborts=None):
    """Each request's tokens; `aborts[step]`: request ids aborted before that step."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        e.add_request(f"r{i}", p, sp)
    tokens, step = {}, 0
    while e.has_unfinished_requests():
        for rid in (aborts or {}).get(step, []):
            e.abort_request(rid)
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        e.block_manager.check_invariants()
        step += 1
    assert e.num_free_blocks() == e.block_manager.num_blocks, "blocks leaked"
    return [tokens.get(f"r{i}", []) for i in range(len(prompts))]


def test_token_buckets():
    assert token_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert token_buckets(48) == [16, 32, 48] and token_buckets(512)[-2:] == [256, 512]
    assert token_buckets(16) == [16] and token_buckets(5) == [5]


def test_piecewise_graphs_resolve_with_the_decode_graphs(model):
    e = engine(model)
    assert e.config.piecewise_graphs is CUDA  # None: on with CUDA graphs on a GPU
    assert (e.runner.pieces is None) is (not CUDA)
    assert engine(model, enforce_eager=True).config.piecewise_graphs is False
    assert engine(model, piecewise_graphs=True).runner.pieces.sizes == [16, 32, 48]
    off = engine(model, piecewise_graphs=False)
    assert off.runner.pieces is None and off.config.piecewise_graphs is False
    on = engine(model, piecewise_graphs=True)
    pieces = on.runner.pieces
    on.set_decode_path(None)  # a rebuilt runner keeps what was asked for, and the pieces
    assert on.config.piecewise_graphs is True and on.runner.pieces is pieces
    with pytest.raises(ValueError, match="piecewise_graphs must be None"):
        minillm.EngineConfig(piecewise_graphs=1)


@pytest.mark.parametrize("budget", [16, 48, 512])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_padded_steps_match_eager(model, workload, budget, enforce_eager):
    """enforce_eager=True: every step (decodes too) is padded to a token bucket; False:
    decode-only steps take the decode graphs' path and the rest the pieces'."""
    prompts, params, ref = workload
    pieces = engine(model, max_num_batched_tokens=budget, enforce_eager=enforce_eager,
                    piecewise_graphs=True)
    eager = engine(model, max_num_batched_tokens=budget, enforce_eager=True,
                   piecewise_graphs=False)
    assert serve(pieces, prompts, params) == serve(eager, prompts, params) == ref
    runner = pieces.runner
    assert runner.pieces.num_steps > 0, "no step took the padded pieces"
    if not enforce_eager:
        assert runner.graphs.num_padded_steps > 0
        assert runner.pieces.num_steps + runner.graphs.num_padded_steps == pieces.num_steps


def test_padded_rows_leave_the_cache_as_eager(model, workload):
    """Every block of the cache holds the unpadded run's K/V: the padding went nowhere but
    the trash row."""
    prompts, params, ref = workload
    # enforce_eager=True: no decode graphs, whose padded rows write the trash row too.
    kw = dict(enforce_eager=True, enable_prefix_caching=False)
    pieces = engine(model, piecewise_graphs=True, **kw)
    eager = engine(model, piecewise_graphs=False, **kw)
    for e in (pieces, eager):
        for i, (p, sp) in enumerate(zip(prompts[:6], params[:6])):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(3):  # prompts in flight, nothing freed yet
            e.step()
    for layer in range(model.config.num_layers):
        for a, b in ((pieces.kv_cache.k_caches[layer], eager.kv_cache.k_caches[layer]),
                     (pieces.kv_cache.v_caches[layer], eager.kv_cache.v_caches[layer])):
            if CUDA:  # cuBLAS may sum a 37-row and a 48-row product in different orders
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            else:  # the CPU's products and fused glue are batch-invariant: the same bits
                assert torch.equal(a, b), f"layer {layer}: a padded row wrote into a block"
    # Padded K/V reach the cache only through the glue's store (static slot_mapping: the
    # trash row); where attention stores K/V itself it stores the real rows only.
    trash = pieces.kv_cache.trash_slot
    written = bool(pieces.kv_cache._k_flat[0][trash].abs().sum() > 0)
    assert written is pieces.runner.pieces.glue_stores_kv
    assert eager.kv_cache._k_flat[0][trash].abs().sum() == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pieces_under_preemption_and_aborts(model, workload, async_scheduling):
    """A pool too small for the batch (preemption and recompute), aborts, and async
    scheduling's pending input ids, which a mixed step gathers into the padded ids."""
    prompts, params, ref = workload
    kw = dict(num_blocks=24, max_num_seqs=16, async_scheduling=async_scheduling)
    pieces = engine(model, piecewise_graphs=True, enforce_eager=False, **kw)
    assert serve(pieces, prompts, params) == ref
    assert pieces.stats()["num_preemptions"] > 0, "the pool should have been too small"
    aborts = {2: ["r0", "r4"], 5: ["r7"]}
    got = serve(engine(model, piecewise_graphs=True, **kw), prompts, params, aborts)
    want = serve(engine(model, piecewise_graphs=False, **kw), prompts, params, aborts)
    assert got == want


def test_seeded_sampling_through_the_pieces(model):
    prompts = [[5, 6, 7], [9, 9], list(range(3, 40))]
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, n=2)
    got = engine(model, piecewise_graphs=True).generate(prompts, sp)
    assert got == engine(model, piecewise_graphs=False).generate(prompts, sp)
    assert len(set(map(tuple, got))) > 1  # the samples differ: real sampling


def test_pieces_store_kv_through_the_static_slot_mapping(model, workload, monkeypatch):
    """Where the Triton glue stores K/V in RoPE's pass (CUDA; here the interpreter), the
    pieces hand it the static, padded slot_mapping: the padded rows go to the trash slot."""
    if not CUDA:
        monkeypatch.setattr(fused, "TRITON_ON_CPU", True)
    prompts, params, _ = workload
    pieces = engine(model, piecewise_graphs=True, enforce_eager=True)  # no decode graphs
    assert pieces.runner.pieces.glue_stores_kv
    got = serve(pieces, prompts[:4], params[:4])
    assert got == serve(engine(model, enforce_eager=True), prompts[:4], params[:4])
    trash = pieces.kv_cache.trash_slot
    assert pieces.kv_cache._k_flat[0][trash].abs().sum() > 0, "padding writes the trash row"


class LoggedGraph:
    """Stands in for torch.cuda.CUDAGraph: logs capture and replay, runs nothing (the ops
    between capture_begin and capture_end simply run). `at_end` is called at each
    capture_end: what the piece left in the buffers then is what a graph would hold."""

    log: list = []
    at_end = None

    def __init__(self):
        self.index = sum(1 for e in self.log if e[0] == "begin")

    def capture_begin(self, pool=None):
        self.log.append(("begin", self.index))

    def capture_end(self):
        self.log.append(("end", self.index))
        if LoggedGraph.at_end is not None:
            LoggedGraph.at_end(self.index)

    def replay(self):
        self.log.append(("replay", self.index))


def test_capture_cuts_the_forward_at_every_attention_and_replay_interleaves(model,
                                                                            monkeypatch):
    """The choreography that only a GPU runs for real: a bucket's forward is captured as
    num_layers + 1 pieces, each ended at a layer's attention (after the copies of its
    inputs) and the next begun at once; a step replays piece i, then layer i's attention
    over the real rows, and the last piece after the last attention."""
    e = engine(model, piecewise_graphs=True)
    pg, layers = e.runner.pieces, model.config.num_layers
    monkeypatch.setattr(torch.cuda, "CUDAGraph", LoggedGraph)
    monkeypatch.setattr(LoggedGraph, "log", [])
    log, seen = LoggedGraph.log, []
    # What each piece has written into the static buffers when it ends: attention's
    # inputs (q) must be among its last kernels, before capture_end, not after.
    monkeypatch.setattr(LoggedGraph, "at_end", lambda i: seen.append(pg.q[:, :16].clone()))
    pg.q.zero_()
    boundary = piecewise._Boundary(pg, 16, "capture")
    boundary.begin()
    with torch.inference_mode():
        pg._forward(boundary)
    boundary.end()
    boundary.end()  # a second end does nothing (the failure path may call it again)
    assert log == [(kind, i) for i in range(layers + 1) for kind in ("begin", "end")]
    assert boundary.calls == [(i, pg.glue_stores_kv) for i in range(layers)]
    assert all(q.abs().sum() > 0 for q in seen[:layers]), "q copied after the piece ended"
    assert not torch.equal(seen[0], seen[1])  # each layer's own q
    pg.graphs[16], pg.calls[16] = boundary.graphs, boundary.calls

    attended = []

    class Ctx:  # attention's output: the layer's number in every element
        def attend(self, layer_idx, q, k, v, kv_stored):
            log.append(("attend", layer_idx))
            attended.append((q.shape, q.data_ptr() == pg.q.data_ptr()))
            return torch.full_like(q, layer_idx + 1.0)

    log.clear()
    inputs = torch.zeros((3, 16), dtype=torch.long, device=DEVICE)
    pg.run(inputs, Ctx(), n=5)
    want = [e for i in range(layers) for e in (("replay", i), ("attend", i))]
    assert log == want + [("replay", layers)]
    assert attended == [(torch.Size([1, 5, 4, 16]), True)] * layers  # real rows, static q
    assert bool((pg.attn[:, :5] == layers).all()), "attention's output is what piece i+1 reads"
    assert pg.num_replays == 1


# ----------------------------------------------------------------------------- CUDA only


@needs_cuda
def test_engine_captures_every_bucket_as_pieces_and_replays(model, workload):
    prompts, params, ref = workload
    e = engine(model)  # the CUDA default: decode graphs and pieces
    pg = e.runner.pieces
    assert sorted(pg.graphs) == pg.sizes == [16, 32, 48]
    assert all(len(g) == model.config.num_layers + 1 for g in pg.graphs.values())
    assert serve(e, prompts, params) == ref
    assert pg.num_replays == pg.num_steps > 0


@needs_cuda
def test_a_failed_capture_warns_and_the_steps_run_eagerly(model, workload, monkeypatch):
    """An op that breaks the capture (here: an error raised at layer 1's attention while
    capturing) turns the pieces off with one warning naming that error; the stream has
    left capture mode and the engine serves eager's tokens."""
    prompts, params, ref = workload
    real = piecewise._Boundary.attend

    def attend(self, layer_idx, *args, **kw):
        if self.mode == "capture" and layer_idx == 1:
            raise RuntimeError("broken on purpose")
        return real(self, layer_idx, *args, **kw)

    monkeypatch.setattr(piecewise._Boundary, "attend", attend)
    with pytest.warns(UserWarning, match=r"piecewise CUDA graphs are off: capturing them "
                                         r"failed \(RuntimeError: broken on purpose\)"):
        e = engine(model)
    assert e.runner.pieces is None and not torch.cuda.is_current_stream_capturing()
    assert serve(e, prompts, params) == ref
