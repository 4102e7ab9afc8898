"""The Triton glue (`minillm.kernels.glue`) against the plain PyTorch glue, and a decode step
through it.

Oracle: the plain expressions of `minillm.layers.fused` (`rms_norm_ref`, `silu_mul_ref`,
`model.apply_rope`, `KVWrite.store`), on fresh random inputs (never zeros; the caches are
filled with noise so a stray write shows). Each kernel output is rounded to the dtype where
the plain path rounds, so they agree to about one unit in the last place of the dtype.

On a CPU the kernels run in Triton's interpreter (fp32, fp16), switched on by
`fused.TRITON_ON_CPU` (the model's CPU path never takes them otherwise); at model level a
tiny fp32 model's decode steps, through `DecodeGraph`'s static cache and the engine's paged
cache with padded rows (trash slot), give the plain path's tokens and logits. With CUDA the
same tests run the compiled kernels in bf16, fp16 and fp32, and the CUDA-only tests at the
end count the kernels of a SmolLM2-shaped decode step and replay it as a graph. The compile
test builds every kernel for sm_90 in bf16 without a GPU.
"""
from __future__ import annotations

import contextlib
import zlib

import pytest
import torch
from compile_utils import assert_compiles

import minillm.kernels  # noqa: F401  (chooses the interpreter before triton is imported)
from minillm import LlamaModel, ModelConfig, decode_graph
from minillm.engine import LLMEngine, SamplingParams
from minillm.kernels import decode_gemv, glue
from minillm.layers import fused
from minillm.model import apply_rope, rope_cos_sin

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32,
                                                                     torch.float16]
# Two ulps of the dtype, relative (1 ulp from rounding after fp32 math that differs in its
# last bits - the order of the mean's sum, exp, rsqrt -, one more where a rounded value is
# rounded again: the normalized row times the weight, silu(gate) times up).
TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.float16: dict(rtol=2e-3, atol=1e-5),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-4)}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: counts the kernels of a "
                                "real decode step and replays a captured graph")


@pytest.fixture(autouse=True)
def triton_glue(monkeypatch):
    """The model's glue goes through the Triton kernels (on a CPU: the interpreter)."""
    monkeypatch.setattr(fused, "TRITON_ON_CPU", True)


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


@contextlib.contextmanager
def plain():
    """Every glue kernel switched off: the plain PyTorch expressions."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "triton_applies", lambda *tensors: False)
        mp.setattr(fused, "load_kernel", lambda: None)
        yield


# ---------------------------------------------------------------------------- each kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 576), (7, 576), (33, 40), (4, 1000)])
def test_norms_match_the_plain_expressions(gen, dtype, rows, width):
    x, d = randn(gen, rows, width, dtype=dtype), randn(gen, rows, width, dtype=dtype)
    w = (1 + randn(gen, width, scale=0.2)).to(dtype)
    out = fused.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, fused.rms_norm_ref(x, w, 1e-5), **TOL[dtype])
    s, h = fused.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d), "the residual add must round exactly as x + delta does"
    torch.testing.assert_close(h, fused.rms_norm_ref(x + d, w, 1e-5), **TOL[dtype])
    # Leading dims are kept: [B, T, width], as the model passes it.
    torch.testing.assert_close(glue.rms_norm(x[None], w, 1e-5)[0], out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 40), (3, 1100)])
def test_silu_mul_matches_the_plain_expression(gen, dtype, rows, inter):
    gate_up = randn(gen, rows, 2 * inter, dtype=dtype, scale=4.0)
    gate_up[0, :6] = torch.tensor([-60.0, -20.0, -1e-3, 0.0, 1e-3, 20.0], dtype=dtype)
    out = fused.silu_mul(gate_up)
    assert out.shape == (rows, inter) and torch.isfinite(out).all()
    torch.testing.assert_close(out, fused.silu_mul_ref(gate_up), **TOL[dtype])


def _rope_case(g, dtype, n, num_q, num_kv, dim, num_slots):
    heads = randn(g, n, num_q + 2 * num_kv, dim, dtype=dtype)
    cos, sin = (t.to(DEVICE) for t in rope_cos_sin(dim, 2048, 1e5))
    # Positions near the end of the table, and a few anywhere.
    pos = torch.cat([torch.arange(2047, 2047 - min(n, 3), -1),
                     torch.randint(0, 2048, (max(0, n - 3),), generator=g)]).to(DEVICE)
    caches = randn(g, num_slots, num_kv, dim, dtype=dtype), randn(g, num_slots, num_kv, dim,
                                                                dtype=dtype)
    return heads, cos[pos], sin[pos], caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, num_q, num_kv, dim", [(1, 9, 3, 64), (6, 9, 3, 32), (13, 4, 2, 64),
                                                   (3, 3, 3, 32)])
def test_rope_and_the_kv_store_match_the_plain_path(gen, dtype, n, num_q, num_kv, dim):
    """Paged slots, shuffled, the last rows on the trash slot (the row past the last block,
    as the engine's padded rows): q|k rotated in place as `apply_rope`, v left alone, k and v
    stored at their slots, no other row touched."""
    heads, cos, sin, (kc, vc) = _rope_case(gen, dtype, n, num_q, num_kv, dim, num_slots=41)
    trash = kc.shape[0] - 1
    real = max(1, n - 2)
    slots = torch.cat([torch.randperm(trash, generator=gen)[:real],
                       torch.full((n - real,), trash)]).to(DEVICE)
    want = apply_rope(heads[None, :, :num_q + num_kv], cos[None], sin[None])[0]
    want_k, want_v = kc.clone(), vc.clone()
    fused.KVWrite(want_k, want_v, slots[:real]).store(want[:real, num_q:],
                                                       heads[:real, num_q + num_kv:])
    got, got_k, got_v = heads.clone(), kc.clone(), vc.clone()
    assert fused.rope_(got[None], num_q + num_kv, cos[None], sin[None],
                       fused.KVWrite(got_k, got_v, slots)) is not None
    torch.testing.assert_close(got[:, :num_q + num_kv], want, **TOL[dtype])
    assert torch.equal(got[:, num_q + num_kv:], heads[:, num_q + num_kv:]), "v must stay"
    # The cache rows hold exactly what the layer's k / v heads hold (the same rounding).
    assert torch.equal(got_k[slots[:real]], got[:real, num_q:num_q + num_kv])
    assert torch.equal(got_v[slots[:real]], heads[:real, num_q + num_kv:])
    torch.testing.assert_close(got_k[:trash], want_k[:trash], **TOL[dtype])
    untouched = torch.ones(kc.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got_k[untouched], kc[untouched]) and torch.equal(got_v[untouched],
                                                                        vc[untouched])
    # Without a store target: the same rotation, the cache left alone.
    again = heads.clone()
    glue.rope_kv(again, num_q, num_kv, cos, sin)
    assert torch.equal(again, got)
    # Tables in the heads' dtype (a model cast whole with .to(dtype)): x * cos is rounded.
    c, s = cos.to(dtype), sin.to(dtype)
    again = glue.rope_kv(heads.clone(), num_q, num_kv, c, s)
    rotated = apply_rope(heads[None, :, :num_q + num_kv], c[None], s[None])[0]
    torch.testing.assert_close(again[:, :num_q + num_kv], rotated, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_into_a_static_cache_at_its_last_position(gen, dtype):
    """DecodeGraph's cache [B, capacity, Hkv, D] viewed as rows: slot = b * capacity + pos."""
    B, cap, num_q, num_kv, dim = 3, 16, 9, 3, 64
    heads, cos, sin, _ = _rope_case(gen, dtype, B, num_q, num_kv, dim, num_slots=1)
    kc, vc = randn(gen, B, cap, num_kv, dim, dtype=dtype), randn(gen, B, cap, num_kv, dim,
                                                                dtype=dtype)
    pos = torch.tensor([cap - 1, cap - 2, 0], device=DEVICE)
    rows = torch.arange(B, device=DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    rotated = apply_rope(heads[None, :, :num_q + num_kv], cos[None], sin[None])[0]
    want_k[rows, pos], want_v[rows, pos] = rotated[:, num_q:], heads[:, num_q + num_kv:]
    slots = torch.add(pos, rows, alpha=cap)
    glue.rope_kv(heads, num_q, num_kv, cos, sin, (kc.flatten(0, 1), vc.flatten(0, 1), slots))
    torch.testing.assert_close(kc, want_k, **TOL[dtype])
    assert torch.equal(vc, want_v)


def test_bad_arguments_get_clear_errors():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \[64\]"):
        glue.rms_norm(x, torch.ones(32, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        glue.silu_mul(torch.randn(64, 2, device=DEVICE).t())
    heads, cos = torch.randn(2, 15, 64, device=DEVICE), torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"heads must be \[N, num_q \+ 2 \* num_kv = 14, D\]"):
        glue.rope_kv(heads, 8, 3, cos, cos)
    with pytest.raises(ValueError, match=r"slot_mapping must be an integer \[2\]"):
        cache = torch.zeros(9, 3, 64, device=DEVICE)
        glue.rope_kv(heads, 9, 3, cos, cos, (cache, cache, torch.zeros(3, device=DEVICE)))


def test_where_the_kernels_apply(monkeypatch):
    x = torch.randn(2, 8, device=DEVICE)
    assert fused.triton_applies(x) and fused.stores_kv(x)
    with monkeypatch.context() as mp:
        mp.setattr(fused, "TRITON_GLUE", False)  # MINILLM_TRITON_GLUE=0
        assert not fused.triton_applies(x) and not fused.stores_kv(x)
    assert not fused.triton_applies(x, torch.ones(8, device=DEVICE, dtype=torch.float16))
    assert not fused.triton_applies(x.double())
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    assert not fused.triton_applies(x, w)  # autograd: the plain ops, which it can trace
    with torch.no_grad():
        assert fused.triton_applies(x, w)
    if not CUDA:
        assert not fused.triton_applies(x.bfloat16()), "the interpreter has no bf16"


# ---------------------------------------------------------------------- the model's steps


@pytest.fixture(scope="module")
def model():
    m = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=3).eval().to(DEVICE)
    return m.set_attn_backend("triton" if CUDA else "torch")


@pytest.fixture
def spy(monkeypatch):
    """Keep the slot_mapping of every K/V store RoPE does, in its own kernel or in q|k|v's
    decode GEMV (the tensor: reading it here would be a host sync, which CUDA-graph capture
    forbids)."""
    stores, real, real_gemv = [], glue.rope_kv, decode_gemv.norm_linear

    def rope_kv(heads, num_q, num_kv, cos, sin, kv=None):
        if kv is not None:
            stores.append(kv[2])
        return real(heads, num_q, num_kv, cos, sin, kv)

    def norm_linear(x, delta, norm_weight, eps, weight, rope=None):
        if rope is not None and rope.kv is not None:
            stores.append(rope.kv[2])
        return real_gemv(x, delta, norm_weight, eps, weight, rope)

    monkeypatch.setattr(glue, "rope_kv", rope_kv)
    monkeypatch.setattr(decode_gemv, "norm_linear", norm_linear)
    return stores


def static_steps(model, prompt, n):
    """Greedy decode of n tokens through a DecodeGraph (its static step; captured on CUDA):
    the tokens and every step's logits."""
    g = decode_graph.DecodeGraph(model, 1, 256)
    with torch.inference_mode():
        logits = [g.prefill(torch.tensor([prompt], device=DEVICE)).float().cpu()]
        tokens = []
        for i in range(n):
            tokens.append(int(logits[-1][0, -1].argmax()))
            logits.append(g.decode(tokens[-1], len(prompt) + i).float().cpu())
    return tokens, torch.cat(logits)


def test_static_decode_step_through_the_glue_equals_the_plain_path(model, spy):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    tokens, logits = static_steps(model, prompt, 8)
    assert spy, "the decode step should store K/V in RoPE's pass"
    if not CUDA:  # on CUDA the steps are replays: the spy saw the warm-up and the capture
        assert spy[0].tolist() == [len(prompt)]
    with plain():
        want_tokens, want = static_steps(model, prompt, 8)
    assert tokens == want_tokens
    # fp32 either way; on CUDA the Triton norm sums a row in another order than ATen's, and
    # two random layers (std 0.2 weights) amplify that rounding to ~2e-4 (seen on an H100)
    tol = 1e-3 if CUDA else 1e-4
    torch.testing.assert_close(logits, want, rtol=tol, atol=tol)


def test_paged_decode_with_padded_rows_through_the_glue_equals_the_plain_path(model, spy):
    """3 sequences in a bucket of 4 (buckets 1, 2, 4): the padded row stores its K/V in the
    trash slot; prefill chunks store through the same kernel."""
    prompts = [[5, 6, 7, 8, 9], [40, 41], [7, 7, 7, 7, 7, 7, 7]]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)

    def serve():
        e = LLMEngine(model, num_blocks=32, block_size=4, max_num_seqs=4, enforce_eager=False)
        return e.generate(prompts, sp), e

    tokens, engine = serve()
    trash = engine.kv_cache.trash_slot
    assert any(int(s[-1]) == trash for s in spy), "a padded step should store into the trash slot"
    with plain():
        want, _ = serve()
    assert tokens == want


# ----------------------------------------------------------------- compiled for a real GPU


def test_glue_kernels_compile_for_cuda_sm90_without_a_gpu():
    """The interpreter accepts programs the compiler rejects: build each kernel for H100
    (sm_90) in bf16, as a CUDA launch would (ahead of time, Triton's bundled ptxas)."""
    code = """
        import torch
        torch.cuda.is_available = lambda: True  # define the kernels as compiled, not interpreted
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from minillm.kernels import decode_gemv, glue

        def build(fn, types, consts, num_warps):
            sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
            triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps))

        bf = "*bf16"
        for has_delta in (False, True):
            build(glue._rms_norm_kernel, dict(X=bf, Delta=bf, W=bf, Out=bf, Sum=bf, eps="fp32"),
                  dict(HAS_DELTA=has_delta, BLOCK=1024), 4)
        for write, slots, table in ((True, "*i64", "*fp32"), (True, "*i32", bf),
                                    (False, bf, "*fp32")):
            build(glue._rope_kv_kernel, dict(Heads=bf, Cos=table, Sin=table, KC=bf, VC=bf,
                  Slots=slots), dict(WRITE_KV=write, ROUND_PRODUCT=table == bf, BLOCK_H=16,
                  BLOCK_HALF=32), 2)
        build(glue._silu_mul_kernel, dict(GateUp=bf, Out=bf), dict(BLOCK=1024), 4)
        print("compiled")
    """
    assert_compiles(code, timeout=300)


# ---------------------------------------------------------------------------- CUDA only


def cuda_kernels(fn) -> int:
    """How many kernels (and copies) fn runs on the GPU, by torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == DeviceType.CUDA for e in prof.events())


@needs_cuda
def test_a_decode_step_runs_about_five_kernels_per_layer(monkeypatch):
    """SmolLM2's shapes (random weights, bf16, Triton attention): the glue cuts a layer from
    ~22 kernels to ~9 (add+norm, qkv, rope+store, attention, o_proj, add+norm, gate_up,
    silu_mul, down; the residual add is the next layer's norm), the decode GEMV to ~6
    (each norm and SiLU·up inside the product that reads it) and its RoPE epilogue to ~5
    (rope+store inside q|k|v's: exactly one a layer fewer), plus ~10 per step
    (embedding, RoPE tables, slots, lengths, final add + norm, LM head). The replay's count is
    printed (the profiler sees a graph's kernels one by one), not asserted."""
    config = ModelConfig.smollm2_135m()
    model = LlamaModel(config).init_random_weights(seed=0, std=0.02).eval()
    model = model.to(device=DEVICE, dtype=torch.bfloat16).set_attn_backend("triton")
    g = decode_graph.DecodeGraph(model, 1, 256)  # captured with the glue and the GEMV
    g.decode(1, 9)
    with torch.inference_mode():
        fused_gemv = cuda_kernels(g.step)
        replayed = cuda_kernels(g.graph.replay)
        monkeypatch.setattr(fused, "FUSED_ROPE", False)
        rope_apart = cuda_kernels(g.step)
        monkeypatch.setattr(fused, "FUSED_GEMV", False)
        glued = cuda_kernels(g.step)
        with plain():
            unglued = cuda_kernels(g.step)
    per_layer = fused_gemv / config.num_layers
    print(f"kernels per decode step: {fused_gemv} with the decode GEMV ({per_layer:.1f} per "
          f"layer), {rope_apart} with rope_kv apart ({rope_apart / config.num_layers:.1f}), "
          f"{glued} with the Triton glue alone ({glued / config.num_layers:.1f}), "
          f"{unglued} with the plain ops ({unglued / config.num_layers:.1f}), {replayed} in "
          "the graph replay")
    assert per_layer <= 7, f"{fused_gemv} kernels for {config.num_layers} layers"
    assert rope_apart - fused_gemv == config.num_layers, "RoPE's kernel is still there"
    assert fused_gemv < rope_apart < glued < unglued


@needs_cuda
def test_replayed_glue_step_equals_the_eager_glue_step():
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=5).eval()
    model = model.to(device=DEVICE, dtype=torch.bfloat16).set_attn_backend("triton")
    g = decode_graph.DecodeGraph(model, 2, 256)
    with torch.inference_mode():
        g.prefill(torch.tensor([[5, 6, 7], [8, 9, 10]], device=DEVICE))
        replayed = g.decode([11, 12], 3).clone()
        # The replay fed its argmax back (input_ids, positions + 1): set the same inputs again,
        # then the eager step rewrites the same K/V and must give the same logits.
        g.input_ids.copy_(torch.tensor([[11], [12]], device=DEVICE))
        g.positions.fill_(3)
        eager = g.step()
    torch.testing.assert_close(replayed, eager)  # bf16 tolerance: cuBLAS may differ in capture
