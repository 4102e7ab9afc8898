"""minillm.spec.distill: a tiny draft shares the target's embedding and head, learns (its KL
to the target falls), leaves the target untouched, and speculates losslessly."""
import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig, spec
from minillm.spec.distill import distill, make_draft, trainable_parameters


@pytest.fixture
def target():
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval().requires_grad_(False)


def text(n=600, seed=1):
    # A repetitive token stream: learnable in a few steps.
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 128, (23,), generator=g).tolist()
    return (phrase * (n // len(phrase) + 1))[:n]


def test_the_draft_shares_embedding_and_head_and_copies_layers(target):
    draft = make_draft(target, (0, -1))
    assert draft.config.num_layers == 2
    assert draft.embed_tokens.weight is target.embed_tokens.weight
    assert draft.lm_head.weight is target.embed_tokens.weight
    last = target.config.num_layers - 1
    for dst, i in zip(draft.layers, (0, last)):
        for (name, a), b in zip(dst.state_dict().items(), target.layers[i].state_dict().values()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name  # a copy
    own = {id(p) for p in trainable_parameters(draft)}
    assert id(draft.embed_tokens.weight) not in own


def test_distillation_lowers_the_kl_and_leaves_the_target_alone(target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft = make_draft(target, (0,))
    losses = distill(draft, target, text(), seq_len=32, batch_size=4, lr=3e-3, steps=30,
                     log=None)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(p.requires_grad for p in draft.parameters())  # back to inference
    # A trained draft is one more ModelDraft: greedy output stays the target's.
    prompt = text(20, seed=2)
    out = spec.speculative_generate(target, spec.ModelDraft(draft), prompt, 16, k=3)
    assert out.tokens == minillm.generate(target, prompt, 16)


def test_bad_arguments_get_clear_errors(target):
    with pytest.raises(ValueError, match="give a budget"):
        distill(make_draft(target), target, text(), log=None)
    with pytest.raises(ValueError, match="more than seq_len=128 tokens"):
        distill(make_draft(target), target, text(50), steps=1, log=None)
    with pytest.raises(ValueError, match="indices into the target's 2 layers"):
        make_draft(target, (0, 5))
    with pytest.raises(ValueError, match="indices into the target's"):
        make_draft(target, ())
