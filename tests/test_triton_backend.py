"""The Triton attention backend inside the model gives the reference backend's tokens.

On CPU the kernels run through the Triton interpreter (slow), so the tiny-model tests keep
sizes small and the real-model test is marked slow. With CUDA the tiny models run there
(compiled kernels take CUDA tensors only), still in fp32: the kernels multiply fp32 in
true fp32 on a GPU too (``minillm.kernels._dot``), so the same tolerances hold.
"""
import pytest
import torch

import minillm
from minillm import LlamaModel, ModelConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(head_dim=16),
                                 ModelConfig.tiny(num_heads=6, num_kv_heads=2, head_dim=16,
                                                  hidden_size=96)])
def test_tiny_model_triton_generation_equals_torch(cfg):
    model = LlamaModel(cfg).init_random_weights(seed=1).eval().to(DEVICE)
    prompt = [7, 19, 33, 50, 5, 77, 21, 40, 99, 3, 64, 12, 17, 88, 90, 31, 45]  # 17 > one tile
    reference = minillm.generate(model, prompt, 12, ignore_eos=True)
    model.set_attn_backend("triton")
    assert minillm.generate(model, prompt, 12, ignore_eos=True) == reference
    assert len(set(reference)) > 3


def test_triton_logits_match_torch(tiny_model):
    tiny_model = tiny_model.to(DEVICE)
    ids = torch.tensor([[5, 9, 33, 2, 70, 71, 72, 90, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]],
                       device=DEVICE)
    ref = tiny_model(ids)
    tiny_model.set_attn_backend("triton")
    torch.testing.assert_close(tiny_model(ids), ref, atol=2e-5, rtol=2e-5)


def test_compiling_interpreted_kernels_is_a_clear_error(tiny_model):
    """On a CPU the kernels run in Triton's interpreter, which torch.compile cannot trace
    (it failed deep inside dynamo with a fake-tensor KeyError); on CUDA this compiles."""
    from minillm.kernels import interpreter_enabled
    if not interpreter_enabled():
        pytest.skip("CUDA: the Triton backend compiles (benchmarks/gpu_check.py times it)")
    tiny_model.set_attn_backend("triton")
    with pytest.raises(ValueError, match="cannot trace Triton kernels.*set_attn_backend"):
        minillm.generate(tiny_model, [5, 9, 33], 2, compile=True)


def test_unknown_backend_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'.*triton"):
        tiny_model.set_attn_backend("cuda")


@pytest.mark.slow
def test_smollm2_greedy_32_tokens_triton_equals_torch(smollm):
    model, tok = smollm
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}])
    reference = minillm.generate(model, ids, 32)
    try:
        model.set_attn_backend("triton")
        assert minillm.generate(model, ids, 32) == reference
    finally:
        model.set_attn_backend("torch")
    assert len(reference) == 32
