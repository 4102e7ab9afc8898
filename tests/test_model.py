"""The model and generation on small random-weight configs (fast, no real model)."""
import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig
from minillm.kv_cache import KVCache, cached_attention, kv_cache_append
from minillm.layers import cpu_linear
from minillm.model import apply_rope, rope_cos_sin

CONFIGS = {
    "gqa": ModelConfig.tiny(),
    "mha": ModelConfig.tiny(num_kv_heads=4),
    "mqa": ModelConfig.tiny(num_kv_heads=1),
    "deep": ModelConfig.tiny(num_layers=4, num_heads=6, num_kv_heads=3, head_dim=8,
                             hidden_size=48),
}


def make(name, seed=0):
    return LlamaModel(CONFIGS[name]).init_random_weights(seed=seed).eval()


def prompt(seed, n, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_param_count_matches_module(tiny_model):
    assert tiny_model.config.num_params() == sum(p.numel() for p in tiny_model.parameters())


def test_smollm2_preset_param_count():
    assert ModelConfig.smollm2_135m().num_params() == 134_515_008


def test_forward_shape_and_causality(tiny_model):
    ids = torch.tensor([prompt(0, 12), prompt(1, 12)])
    logits = tiny_model(ids)
    assert logits.shape == (2, 12, 128)
    # Changing a later token must not change earlier logits.
    ids2 = ids.clone()
    ids2[:, 8] = (ids2[:, 8] + 1) % 128
    logits2 = tiny_model(ids2)
    torch.testing.assert_close(logits[:, :8], logits2[:, :8])
    assert not torch.allclose(logits[:, 8:], logits2[:, 8:])


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_equals_uncached(name, seed):
    model = make(name, seed)
    ids = prompt(seed, 5 + 7 * seed)
    cached = minillm.generate(model, ids, 24, ignore_eos=True)
    uncached = minillm.generate(model, ids, 24, ignore_eos=True, use_cache=False)
    assert cached == uncached
    assert len(cached) == 24
    assert len(set(cached)) > 5, "degenerate output would make this comparison trivial"


def test_rope_is_a_rotation_and_relative():
    cos, sin = rope_cos_sin(16, 64, 10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 2, 16, generator=g), torch.randn(1, 1, 2, 16, generator=g)
    at = lambda x, p: apply_rope(x, cos[p][None, None], sin[p][None, None])
    torch.testing.assert_close(at(q, 5).norm(dim=-1), q.norm(dim=-1))
    # <R(m)q, R(n)k> depends only on m - n.
    d1 = (at(q, 7) * at(k, 3)).sum(-1)
    d2 = (at(q, 20) * at(k, 16)).sum(-1)
    torch.testing.assert_close(d1, d2, atol=1e-5, rtol=1e-5)


def test_kv_cache_append_writes_positions_and_validates():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(2, 8, 2, 4), torch.zeros(2, 8, 2, 4)
    k, v = torch.randn(2, 3, 2, 4, generator=g), torch.randn(2, 3, 2, 4, generator=g)
    kv_cache_append(k_cache, v_cache, k, v, 4)
    torch.testing.assert_close(k_cache[:, 4:7], k)
    torch.testing.assert_close(v_cache[:, 4:7], v)
    assert k_cache[:, :4].abs().sum() == 0 and k_cache[:, 7:].abs().sum() == 0
    before = k_cache.clone()
    with pytest.raises(ValueError, match="cannot write 3 tokens at position 6"):
        kv_cache_append(k_cache, v_cache, k, v, 6)
    with pytest.raises(ValueError, match="position -1"):
        kv_cache_append(k_cache, v_cache, k, v, -1)
    torch.testing.assert_close(k_cache, before)  # failed writes change nothing


def test_cached_attention_matches_full_attention():
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D = 2, 9, 6, 2, 8
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, T, Hkv, D, generator=g)
    v = torch.randn(B, T, Hkv, D, generator=g)
    full = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True).transpose(1, 2)
    k_cache, v_cache = torch.zeros(B, 16, Hkv, D), torch.zeros(B, 16, Hkv, D)
    kv_cache_append(k_cache, v_cache, k[:, :5], v[:, :5], 0)
    first = cached_attention(q[:, :5], k_cache, v_cache, 0)
    outs = [first]
    for t in range(5, T):  # then one token at a time
        kv_cache_append(k_cache, v_cache, k[:, t:t + 1], v[:, t:t + 1], t)
        outs.append(cached_attention(q[:, t:t + 1], k_cache, v_cache, t))
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_static_batch_equals_one_at_a_time(name):
    model = make(name, 3)
    prompts = [prompt(10, 3), prompt(11, 11), prompt(12, 7), prompt(13, 1)]
    limits = [9, 4, 12, 6]
    batched = minillm.generate_batch(model, prompts, limits, ignore_eos=True)
    alone = [minillm.generate(model, p, n, ignore_eos=True) for p, n in zip(prompts, limits)]
    assert batched == alone
    uncached = minillm.generate_batch(model, prompts, limits, ignore_eos=True, use_cache=False)
    assert uncached == alone


def test_sampling_is_seeded_and_reproducible(tiny_model):
    ids = prompt(5, 6)
    kw = dict(temperature=1.0, top_k=20, top_p=0.9, ignore_eos=True)
    a = minillm.generate(tiny_model, ids, 30, seed=7, **kw)
    b = minillm.generate(tiny_model, ids, 30, seed=7, **kw)
    c = minillm.generate(tiny_model, ids, 30, seed=8, **kw)
    assert a == b and a != c
    batched = minillm.generate_batch(tiny_model, [ids, ids], 30, seed=7, **kw)
    assert batched[0] == a and batched[1] == minillm.generate(tiny_model, ids, 30, seed=8, **kw)


def test_top_k_1_is_greedy(tiny_model):
    ids = prompt(6, 6)
    greedy = minillm.generate(tiny_model, ids, 20, ignore_eos=True)
    assert minillm.generate(tiny_model, ids, 20, temperature=0.7, top_k=1, seed=0,
                            ignore_eos=True) == greedy


def test_top_p_keeps_the_nucleus():
    from minillm.sampling import filter_logits
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(logits, None, 0.7).isfinite().tolist()
    assert kept == [True, True, False, False]
    kept = filter_logits(logits, None, 0.8).isfinite().tolist()
    assert kept == [True, True, False, False]
    kept = filter_logits(logits, None, 0.81).isfinite().tolist()
    assert kept == [True, True, True, False]
    assert filter_logits(logits, 3, None).isfinite().tolist() == [True, True, True, False]


def test_stops_at_eos_and_stop_tokens(tiny_model):
    ids = prompt(7, 5)
    free = minillm.generate(tiny_model, ids, 20, ignore_eos=True)
    stop = free[4]
    out = minillm.generate(tiny_model, ids, 20, stop_token_ids=[stop], ignore_eos=True)
    assert out == free[:free.index(stop) + 1]
    # EOS stops generation unless ignore_eos is set.
    eos_model = LlamaModel(ModelConfig.tiny(eos_token_id=free[2])).init_random_weights(0).eval()
    assert minillm.generate(eos_model, ids, 20) == free[:free.index(free[2]) + 1]


def test_streaming_yields_the_same_tokens(tiny_model):
    ids = prompt(8, 4)
    assert list(minillm.generate_stream(tiny_model, ids, 15, ignore_eos=True)) == \
        minillm.generate(tiny_model, ids, 15, ignore_eos=True)


@pytest.mark.parametrize("bad, error, match", [
    (dict(prompt_ids=[]), ValueError, "empty"),
    (dict(prompt_ids="hello"), TypeError, "list of ints"),
    (dict(prompt_ids=[1, 999]), ValueError, r"\[0, 128\)"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    (dict(prompt_ids=[5] * 250, max_new_tokens=10), ValueError, "context length of 256"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=0), ValueError, "top_k"),
])
def test_bad_requests_raise_clear_errors(tiny_model, bad, error, match):
    kwargs = dict(prompt_ids=[5, 6, 7], max_new_tokens=4) | bad
    with pytest.raises(error, match=match):
        minillm.generate(tiny_model, **kwargs)


def test_positions_beyond_context_raise(tiny_model):
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 256\)"):
        tiny_model(torch.tensor([[1, 2]]), torch.tensor([[255, 256]]))
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        KVCache(tiny_model.config, 1, 300)


def test_input_ids_on_another_device_get_a_clear_error(tiny_model):
    """A CPU tensor fed to a CUDA model failed deep in the embedding (Lab 02 did that on a
    GPU); "meta" stands in for the other device here."""
    with pytest.raises(ValueError, match=r"input_ids are on meta but the model is on cpu: "
                                         r"create them there"):
        tiny_model(torch.tensor([[1, 2]], device="meta"))


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.tiny(hidden_size=0)


def test_rope_matches_the_half_split_formula():
    # apply_rope's three-op form against the textbook pairwise rotation.
    D = 16
    cos, sin = rope_cos_sin(D, 64, 10000.0)
    x = torch.randn(2, 3, 4, D, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 5, 63], [1, 2, 3]])
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = (pos[..., None].double() * inv_freq)[:, :, None, :]
    x1, x2 = x[..., :D // 2].double(), x[..., D // 2:].double()
    want = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    torch.testing.assert_close(apply_rope(x, cos[pos], sin[pos]).double(), want,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["0", "default"])
def test_matvec_layout_keeps_values_and_outputs(monkeypatch, kernel):
    # MINILLM_CPU_KERNEL=0: BLAS's matvec, which wants the longer side contiguous; with the
    # C++ small-M kernel (when built), every weight [out, in] contiguous.
    monkeypatch.setenv("MINILLM_CPU_KERNEL", kernel)
    with_kernel = cpu_linear.load_kernel() is not None
    model = make("deep", seed=4)
    ids = torch.tensor([prompt(4, 9)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logits = model(ids)
    model.use_matvec_layout()
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)
        if p.dim() == 2 and with_kernel:
            assert p.is_contiguous(), name
        elif p.dim() == 2:  # the longer side is the contiguous one
            rows_contiguous = p.shape[0] >= p.shape[1]
            assert p.t().is_contiguous() == rows_contiguous, name
    torch.testing.assert_close(model(ids), logits, rtol=1e-5, atol=1e-5)


def test_compiled_decode_equals_eager():
    model = make("gqa", seed=5)
    for n, length in ((24, 9), (30, 4)):  # a second cache size reuses the same graph
        ids = prompt(5 + n, length)
        eager = minillm.generate(model, ids, n, ignore_eos=True)
        assert minillm.generate(model, ids, n, ignore_eos=True, compile=True) == eager
    with pytest.raises(ValueError, match="compile=True needs use_cache=True"):
        minillm.generate(model, ids, 4, use_cache=False, compile=True)


@pytest.mark.parametrize("num_kv_heads", [2, 6])  # GQA (3 query heads per KV head), MHA
@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_matches_sdpa(masked, num_kv_heads):
    from minillm.attention import decode_attention
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 6, 16, generator=g)                    # 6 query heads
    k, v = torch.randn(2, 3, num_kv_heads, 11, 16, generator=g)  # 11 keys
    mask = torch.rand(3, 11, generator=g) > 0.3 if masked else None
    if masked:
        mask[:, 0] = True  # every row sees at least one key
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, enable_gqa=True,
        attn_mask=None if mask is None else mask[:, None, None, :])[:, :, 0]
    torch.testing.assert_close(decode_attention(q, k, v, mask), want)
