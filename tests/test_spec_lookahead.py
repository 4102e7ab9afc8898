"""minillm.spec.LookaheadDraft: guesses from the target's own earlier passes. It is lossless
(plain greedy decoding's tokens, whatever it guesses), its pool and Jacobi window follow
`observe` exactly as documented, and speculative_generate shows it every greedy pass."""
from __future__ import annotations

import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig, spec


@pytest.fixture(scope="module")
def tiny():
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_lookahead_gives_plain_greedy_tokens(tiny, k):
    for prompt in ([5, 6, 7, 8] * 4, list(range(3, 40, 3)), [9] * 6):
        plain = minillm.generate(tiny, prompt, 24)
        draft = spec.LookaheadDraft()
        out = spec.speculative_generate(tiny, draft, prompt, 24, k=k)
        assert out.tokens == plain
        assert out.num_target_passes <= len(plain)
        assert sum(draft.proposed_from.values()) <= out.num_target_passes


def test_every_greedy_pass_is_observed(tiny):
    """observe gets [last_token] + guesses, the target's argmax after each (checked against
    a plain forward over the whole text), and the number of guesses kept."""
    seen = []

    class Spy(spec.LookaheadDraft):
        def observe(self, fed, best, accepted):
            seen.append((list(fed), list(best), accepted))
            super().observe(fed, best, accepted)

    prompt = list(range(3, 15))
    out = spec.speculative_generate(tiny, Spy(), prompt, 16, k=3)
    assert len(seen) == out.num_target_passes
    text = prompt + out.tokens
    with torch.inference_mode():
        argmax = tiny(torch.tensor([text]))[0].argmax(-1).tolist()
    pos = len(prompt) - 1
    for fed, best, accepted in seen:
        assert len(best) == len(fed) and 0 <= accepted < len(fed)
        assert fed[0] == text[pos]
        # up to the correction the fed tokens are the text, so best is plain greedy's argmax there
        assert best[:accepted + 1] == argmax[pos:pos + accepted + 1]
        pos += accepted + 1


def test_observe_fills_pool_and_window():
    d = spec.LookaheadDraft(ngram=3)
    d.reset(100, 0.0, None)
    # fed: last token 10 and guesses 11, 12, 13; the target kept 11 (1 accepted), corrected 12 -> 20
    d.observe([10, 11, 12, 13], [11, 20, 21, 22], accepted=1)
    assert d.window == [21, 22]             # predictions past the correction: the next guesses
    assert d.pool[10] == [11, 20] and d.pool[11] == [20, 21] and d.pool[12] == [21, 22]
    assert d.pool[13] == [22]               # short n-gram kept only for a token not yet known
    assert d.propose([1, 2, 10], 4) == ([11, 20], None)   # pool hit on the last token
    assert d.propose([1, 2, 99], 4) == ([21, 22, 2, 99], None)  # window, filled from the context
    assert d.proposed_from == {"pool": 1, "window": 1}
    d.observe([99, 5], [6, 7], accepted=0)
    assert d.window == [7] and d.pool[99] == [6, 7]


def test_pool_forgets_the_oldest_and_sampling_proposes_nothing():
    d = spec.LookaheadDraft(ngram=2, max_pool=2)
    d.reset(10, 0.0, None)
    d.observe([1, 2, 3], [4, 5, 6], accepted=0)
    assert list(d.pool) == [2, 3]
    d.reset(10, 0.8, None)
    assert d.propose([1, 2, 3], 4) == ([], None) and d.pool == {}


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="ngram must be an int >= 2"):
        spec.LookaheadDraft(ngram=1)
    with pytest.raises(ValueError, match="max_pool must be an int >= 1"):
        spec.LookaheadDraft(max_pool=0)
