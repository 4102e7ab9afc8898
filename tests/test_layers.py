"""The model's seams: every weight product goes through a swappable `Linear`, and
`hidden_states` + `compute_logits` on chosen rows equal the full forward on those rows."""
import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig
from minillm.layers import Linear, cpu_linear


def model_and_ids(seed=0):
    model = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=seed).eval()
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(seed + 1))
    return model, ids


class CountingLinear(Linear):
    """A stand-in for a quantized or sharded linear: same math, counts its calls."""

    def __init__(self, base: Linear):
        super().__init__(base.in_features, base.out_features, base.weight)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def swap_all(model):
    swapped = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is Linear:
                setattr(module, child_name, CountingLinear(child))
                swapped[f"{name}.{child_name}".lstrip(".")] = getattr(module, child_name)
    return swapped


def test_every_weight_product_goes_through_a_swappable_linear():
    model, ids = model_and_ids()
    logits = model(ids)
    tokens = minillm.generate(model, ids[0].tolist(), 12, ignore_eos=True)
    swapped = swap_all(model)
    # Four projections per layer and the LM head, nothing else.
    assert len(swapped) == 4 * model.config.num_layers + 1 and "lm_head" in swapped
    assert swapped["lm_head"].weight is model.embed_tokens.weight, "the head stays tied"
    torch.testing.assert_close(model(ids), logits, rtol=0, atol=0)
    assert all(m.calls == 1 for m in swapped.values())
    assert minillm.generate(model, ids[0].tolist(), 12, ignore_eos=True) == tokens
    engine = minillm.LLMEngine(model, num_blocks=32, block_size=4)
    assert engine.generate([ids[0].tolist()], minillm.SamplingParams(
        max_tokens=12, ignore_eos=True)) == [tokens]


def test_the_tied_lm_head_is_one_tensor_with_the_embedding(monkeypatch):
    # Without the C++ small-M kernel, BLAS's matvec wants [V, d] stored as [d, V].
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "0")
    model, ids = model_and_ids()
    logits = model(ids)
    assert model.lm_head.weight is model.embed_tokens.weight
    model.use_matvec_layout()  # replaces the Parameter: the tie must survive
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.t().is_contiguous()  # [V, d] with V > d: stored [d, V]
    torch.testing.assert_close(model(ids), logits)
    # With the kernel, every weight goes back to [out, in] contiguous, the tie kept.
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "default")
    if cpu_linear.load_kernel() is not None:
        model.use_matvec_layout()
        assert model.lm_head.weight is model.embed_tokens.weight
        assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, Linear))
        torch.testing.assert_close(model(ids), logits)


def test_matvec_layout_leaves_non_float_linears_alone():
    lin = Linear(4, 16)
    lin.weight = torch.nn.Parameter(torch.randint(-8, 8, (16, 4), dtype=torch.int8),
                                    requires_grad=False)
    before = lin.weight
    lin.use_matvec_layout()
    assert lin.weight is before


def test_a_shared_weight_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[out_features, in_features\] = \[8, 4\]"):
        Linear(4, 8, torch.nn.Parameter(torch.zeros(4, 8)))


@pytest.mark.parametrize("rows", [[0], [3, 10], [10, 0, 5]])
def test_compute_logits_on_selected_rows_equals_the_full_forward(rows):
    model, ids = model_and_ids(seed=2)
    full = model(ids)                                  # [2, 11, V]
    h = model.hidden_states(ids)                       # [2, 11, d]
    assert h.shape == (2, 11, model.config.hidden_size)
    picked = model.compute_logits(h[1, rows])          # rows of the second sequence only
    torch.testing.assert_close(picked, full[1, rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(h), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids, last_only=True), full[:, -1:], rtol=1e-5, atol=1e-5)
