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


def test_decode_tables_are_made_once_per_step_and_follow_the_length():
    # dense at T == 1 keeps the block table and lengths it hands the paged kernel for the
    # last (B, S): the layers of one step share them, the next step's S gets its own.
    from minillm.attention.backends import TorchBackend, TritonBackend
    from minillm.kernels import paged_decode_attention
    backend, g = TritonBackend(), torch.Generator().manual_seed(0)
    B, Hq, Hkv, D = 2, 6, 2, 16

    def step(S):
        q = torch.randn(B, Hq, 1, D, generator=g).to(DEVICE)
        k, v = (torch.randn(B, Hkv, S, D, generator=g).to(DEVICE) for _ in range(2))
        out = backend.dense(q, k, v)
        # The uncached reference: tables made afresh, as dense made them before.
        fresh = paged_decode_attention(
            q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2),
            torch.arange(B, dtype=torch.int32, device=DEVICE)[:, None],
            torch.full((B,), S, dtype=torch.int32, device=DEVICE))[:, :, None]
        assert torch.equal(out, fresh)
        torch.testing.assert_close(out, TorchBackend().dense(q, k, v), atol=2e-5, rtol=2e-5)
        return backend._last_tables

    first = step(20)
    again = step(20)  # same shapes: the same tensors
    assert again[1] is first[1] and again[2] is first[2]
    for S in (33, 20, 1):  # another length: its own lengths, the kernel's outputs checked
        key, tables, lens = step(S)
        assert key == (B, S, torch.empty(0, device=DEVICE).device)  # "cuda" is cuda:0 there
        assert tables.tolist() == [[0], [1]] and lens.tolist() == [S, S]  # never written


def test_decode_tables_under_torch_compile_are_made_afresh():
    # A trace neither reads nor keeps them: S may be symbolic, and a kept tensor would
    # specialize the graph on one length.
    from minillm.attention.backends import TritonBackend
    backend = TritonBackend()
    backend._decode_tables(2, 7, torch.device("cpu"))
    kept = backend._last_tables
    tables = torch.compile(lambda S: backend._decode_tables(2, S, torch.device("cpu")),
                           backend="eager", fullgraph=True, dynamic=True)
    for S in (7, 9):
        block_tables, lens = tables(S)
        assert block_tables.tolist() == [[0], [1]] and lens.tolist() == [S, S]
    assert backend._last_tables is kept
