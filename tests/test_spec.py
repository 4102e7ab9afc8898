"""Speculative decoding is lossless.

Greedy: `speculative_generate` gives `minillm.generate`'s tokens, for every draft and k, on
the real model too, with drafts that are always right, always wrong and in between, and
when EOS falls inside a draft window.

Sampled: the acceptance rule's emitted tokens follow the target's distribution, checked by
a chi-square test (p > 0.001) over tens of thousands of seeded trials: random p and q, q = p
(all accepted), disjoint supports (all rejected), a draft without probabilities, the second
token given the first, and end to end on a tiny model against the exact distribution of
plain sampling.
"""
import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig, calc, spec

V, K = 10, 3


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs. Cells expected below 5 are
    pooled into one, as the test's approximation needs."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    assert torch.all(obs[~keep] == 0), "a token with probability 0 was emitted"
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def random_dist(g, rows, support=None):
    logits = torch.randn(rows, V, generator=g) * 1.5
    if support is not None:
        mask = torch.full((V,), float("-inf"))
        mask[support] = 0
        logits = logits + mask
    return logits.softmax(-1)


def run_trials(p, q, trials, seed=0, fixed_draft=None):
    """Draft tokens drawn from q (or fixed), then rejection_sample; returns the outputs."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(trials):
        if fixed_draft is not None:
            d = fixed_draft
        else:
            d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(K)]
        outs.append(spec.rejection_sample(p, q, d, g))
    return outs


def first_token_counts(outs):
    return torch.bincount(torch.tensor([o[0] for o in outs]), minlength=V)


def test_the_acceptance_rule_by_hand():
    # p = 0.3, q = 0.6 for the draft token: accepted with probability 0.5.
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]])
    q = torch.tensor([[0.6, 0.4]])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    accepted = sum(len(spec.rejection_sample(p, q, [0], g)) == 2 for _ in range(n))
    assert abs(accepted / n - 0.5) < 0.015
    assert calc.spec_acceptance_probability(0.3, 0.6) == pytest.approx(0.5)


@pytest.mark.slow
def test_first_token_follows_the_target_with_random_p_and_q():
    g = torch.Generator().manual_seed(1)
    p, q = random_dist(g, K + 1), random_dist(g, K)
    outs = run_trials(p, q, 50_000, seed=2)
    assert all(1 <= len(o) <= K + 1 for o in outs)
    assert chi2_pvalue(first_token_counts(outs), p[0]) > 1e-3
    lengths = torch.bincount(torch.tensor([len(o) for o in outs]))
    assert lengths[1] > 0 and lengths[K + 1] > 0, "both rejections and full acceptances happen"


@pytest.mark.slow
def test_second_token_given_the_first_follows_the_target():
    g = torch.Generator().manual_seed(3)
    p, q = random_dist(g, K + 1), random_dist(g, K)
    outs = run_trials(p, q, 60_000, seed=4)
    # The first token most often accepted; given it came out first, token two ~ p[1].
    t0 = int(first_token_counts([o for o in outs if len(o) >= 2]).argmax())
    second = [o[1] for o in outs if len(o) >= 2 and o[0] == t0]
    assert len(second) > 2_000
    counts = torch.bincount(torch.tensor(second), minlength=V)
    assert chi2_pvalue(counts, p[1]) > 1e-3


@pytest.mark.slow
def test_q_equal_to_p_accepts_everything_and_the_bonus_follows_the_last_row():
    g = torch.Generator().manual_seed(5)
    p = random_dist(g, K + 1)
    outs = run_trials(p, p[:K].clone(), 50_000, seed=6)
    assert all(len(o) == K + 1 for o in outs)
    assert chi2_pvalue(first_token_counts(outs), p[0]) > 1e-3
    bonus = torch.bincount(torch.tensor([o[-1] for o in outs]), minlength=V)
    assert chi2_pvalue(bonus, p[K]) > 1e-3


@pytest.mark.slow
def test_disjoint_supports_reject_everything():
    g = torch.Generator().manual_seed(7)
    p = random_dist(g, K + 1, support=[0, 1, 2, 3, 4])
    q = random_dist(g, K, support=[5, 6, 7, 8, 9])
    outs = run_trials(p, q, 50_000, seed=8)
    assert all(len(o) == 1 for o in outs)
    assert chi2_pvalue(first_token_counts(outs), p[0]) > 1e-3


@pytest.mark.slow
def test_a_draft_without_probabilities_is_one_hot():
    g = torch.Generator().manual_seed(9)
    p = random_dist(g, K + 1)
    draft = [int(p[0].argmax()), 4, 2]  # the likeliest token first: often accepted
    outs = run_trials(p, None, 50_000, seed=10, fixed_draft=draft)
    assert chi2_pvalue(first_token_counts(outs), p[0]) > 1e-3
    assert any(len(o) > 1 for o in outs) and any(len(o) == 1 for o in outs)


def test_bad_shapes_are_refused():
    p = torch.full((3, V), 1 / V)
    with pytest.raises(ValueError, match=r"target_probs must be \[k\+1, V\] = \[4, V\]"):
        spec.rejection_sample(p, None, [1, 2, 3])
    with pytest.raises(ValueError, match=r"draft_probs must be \[k, V\] = \[2, 10\]"):
        spec.rejection_sample(p, torch.full((3, V), 0.1), [1, 2])


# ---- speculative_generate on a tiny model ---------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()


class Always:
    """A test draft that proposes one fixed token (no probabilities)."""

    def __init__(self, token, vocab_size=128):
        self.token, self.vocab_size = token, vocab_size

    def reset(self, max_len, temperature, generator):
        pass

    def propose(self, context_ids, k):
        return [self.token] * k, None

    def rollback(self, num_tokens):
        pass


def drafts_for(model):
    return {"ngram": spec.NgramDraft(), "layer-skip-1": spec.LayerSkipDraft(model, 1),
            "itself": spec.ModelDraft(model), "always-wrong": Always(0)}


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_equals_generate_on_a_tiny_model(tiny, k):
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [100, 3, 44], [9]]
    for prompt in prompts:
        ref = minillm.generate(tiny, prompt, 30, ignore_eos=True)
        for name, draft in drafts_for(tiny).items():
            out = spec.speculative_generate(tiny, draft, prompt, 30, k=k, ignore_eos=True)
            assert out.tokens == ref, f"draft {name}, k={k}, prompt {prompt}"
            assert out.num_accepted <= out.num_draft_tokens
            assert out.num_target_passes == len(out.accepted_per_pass)
            assert len(ref) == sum(a + 1 for a in out.accepted_per_pass)
    itself = spec.speculative_generate(tiny, spec.ModelDraft(tiny), prompts[0], 30, k=k,
                                       ignore_eos=True)
    assert itself.acceptance_rate == 1.0 and itself.num_target_passes == -(-30 // (k + 1))
    wrong = spec.speculative_generate(tiny, Always(0), prompts[0], 30, k=k, ignore_eos=True)
    assert wrong.acceptance_rate == 0.0 and wrong.num_target_passes == 30


def test_stops_inside_a_draft_window_and_never_runs_past_max_new_tokens(tiny):
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    free = minillm.generate(tiny, prompt, 30, ignore_eos=True)
    stop = free[9]  # a stop token that first appears at index >= 9
    first = free.index(stop)
    ref = minillm.generate(tiny, prompt, 30, stop_token_ids=[stop], ignore_eos=True)
    assert ref == free[:first + 1]
    for k in (4, 7):
        out = spec.speculative_generate(tiny, spec.ModelDraft(tiny), prompt, 30, k=k,
                                        stop_token_ids=[stop], ignore_eos=True)
        assert out.tokens == ref
    for n in (1, 5, 11):
        out = spec.speculative_generate(tiny, spec.ModelDraft(tiny), prompt, n, k=7,
                                        ignore_eos=True)
        assert out.tokens == free[:n]


def test_bad_arguments_get_clear_errors(tiny):
    with pytest.raises(ValueError, match=r"k \(draft tokens per target pass\) must be an int >= 1"):
        spec.speculative_generate(tiny, spec.NgramDraft(), [5, 6], 4, k=0)
    other = LlamaModel(ModelConfig.tiny(vocab_size=64)).init_random_weights(seed=1).eval()
    with pytest.raises(ValueError, match="vocabulary has 64 tokens, the target's 128"):
        spec.speculative_generate(tiny, spec.ModelDraft(other), [5, 6], 4)
    with pytest.raises(ValueError, match="context length of 256"):
        spec.speculative_generate(tiny, spec.NgramDraft(), [5] * 250, 10)
    with pytest.raises(ValueError, match=r"num_layers must be an int in \[1, 2\]"):
        spec.LayerSkipDraft(tiny, 3)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        spec.NgramDraft(max_ngram=1, min_ngram=2)


def test_ngram_draft_proposes_what_followed_the_latest_match():
    d = spec.NgramDraft(max_ngram=3)
    assert d.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == ([4, 5, 9], None)   # "2 3" seen before
    assert d.propose([1, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2) == ([8, 2], None)  # the latest one
    assert d.propose([1, 2, 3], 4) == ([], None)                          # no match


@pytest.mark.slow
def test_sampled_speculative_decoding_matches_plain_sampling_end_to_end():
    """First two tokens of speculative_generate at temperature 1 (a 1-layer draft that
    samples its guesses) against the exact distribution of plain sampling."""
    torch.set_num_threads(1)
    model = LlamaModel(ModelConfig.tiny(vocab_size=16)).init_random_weights(seed=3, std=0.1).eval()
    prompt = [3, 7, 1]
    with torch.inference_mode():
        p1 = model(torch.tensor([prompt]))[0, -1].softmax(-1)
        rows = torch.tensor([prompt + [t] for t in range(16)])
        p2 = model(rows)[:, -1].softmax(-1)                     # [t1, t2]
    exact = (p1[:, None] * p2).flatten()
    draft = spec.LayerSkipDraft(model, 1)
    counts = torch.zeros(256, dtype=torch.long)
    accepted = 0
    for seed in range(20_000):
        out = spec.speculative_generate(model, draft, prompt, 2, k=2, temperature=1.0,
                                        seed=seed, ignore_eos=True)
        counts[out.tokens[0] * 16 + out.tokens[1]] += 1
        accepted += out.num_accepted
    assert accepted > 2_000, "the draft should be right often enough to exercise acceptance"
    assert chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.slow
def test_greedy_equals_generate_on_the_real_model(smollm):
    """Every draft, k in {1, 2, 4, 7}: a chat answer that ends in EOS (inside a draft window
    for the draft that is always right), and an input-grounded task where n-grams repeat."""
    model, tok = smollm
    passage = ("The river rose overnight and the town council closed the old bridge. "
               "The old bridge will stay closed until engineers inspect it.")
    prompts = [tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
               tok.apply_chat_template([{"role": "user", "content": "Repeat this text exactly: " + passage}])]
    drafts = {"ngram": spec.NgramDraft(), "layer-skip-8": spec.LayerSkipDraft(model, 8),
              "itself (always right)": spec.ModelDraft(model),
              "always wrong": Always(0, model.config.vocab_size)}
    eos = model.config.eos_token_id
    for prompt, n in zip(prompts, (40, 24)):
        ref = minillm.generate(model, prompt, n)
        for k in (1, 2, 4, 7):
            for name, draft in drafts.items():
                out = spec.speculative_generate(model, draft, prompt, n, k=k)
                assert out.tokens == ref, f"draft {name}, k={k}"
        if n == 40:
            assert ref[-1] == eos and len(ref) < 40, "the chat answer should end in EOS"


def test_layer_skip_default_depth_is_the_measured_fraction(tiny):
    from minillm.spec.drafts import DEFAULT_LAYER_FRACTION, default_num_layers
    assert spec.LayerSkipDraft(tiny).num_layers == default_num_layers(tiny) == 1
    deep = LlamaModel(ModelConfig.smollm2_135m())
    assert default_num_layers(deep) == round(DEFAULT_LAYER_FRACTION * 30) >= 1
