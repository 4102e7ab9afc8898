"""minillm against Hugging Face transformers loading the same GGUF file."""
import pytest
import torch

import minillm
from minillm.layers import Linear, cpu_linear

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🤖🚀, Ελληνικά, русский.",
    "Digits 0123456789 and 3.14159, 1,000,000 and 2026-11-22.",
    "Whitespace   runs\t\ttabs\n\n\nnewlines   \n  trailing   ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "Mixed <|endoftext|> specials <|im_end|>inside text",
    "  leading spaces and CAPS and camelCase and snake_case_names",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}],
]


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_transformers(smollm, hf_reference, text):
    _, tok = smollm
    _, hf_tok = hf_reference
    ours = tok.encode(text)
    assert ours == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ours) == text


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(smollm, hf_reference, messages):
    _, tok = smollm
    _, hf_tok = hf_reference
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == list(expected)
    assert tok.apply_chat_template(messages, tokenize=False) == hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


def test_special_tokens_are_single_ids(smollm):
    _, tok = smollm
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]


@pytest.mark.parametrize("prompt", [
    "The capital of France is",
    "def quicksort(arr):",
    "In 1969, astronauts first landed on",
])
def test_fp32_logits_match_transformers(smollm, hf_reference, prompt):
    model, tok = smollm
    hf_model, _ = hf_reference
    ids = torch.tensor([tok.encode(prompt)])
    with torch.inference_mode():
        ours = model(ids)
        ref = hf_model(ids).logits
    err = (ours - ref).abs().max().item()
    assert err < 1e-3, f"max |logit difference| {err:.2e} exceeds 1e-3"


def test_greedy_64_tokens_match_transformers_generate(smollm, hf_reference):
    """Up to 64 greedy tokens, both stopping at EOS; the poem runs the full 64."""
    model, tok = smollm
    hf_model, _ = hf_reference
    lengths = []
    for messages in CHATS[:2] + [[{"role": "user", "content": "Write a poem about the sea."}]]:
        ids = tok.apply_chat_template(messages)
        ours = minillm.generate(model, ids, 64)
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                    pad_token_id=2)
        assert ours == out[0, len(ids):].tolist()
        lengths.append(len(ours))
    assert max(lengths) == 64, f"no prompt ran the full 64 tokens: {lengths}"


def test_cached_equals_uncached_on_the_real_model(smollm):
    model, tok = smollm
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}])
    cached = minillm.generate(model, ids, 40, ignore_eos=True)
    uncached = minillm.generate(model, ids, 40, ignore_eos=True, use_cache=False)
    assert cached == uncached


def test_real_model_loads_in_matvec_layout_and_compiled_decode_matches(smollm):
    model, tok = smollm
    # On CPU load_model picks the layout decoding reads fastest (see use_matvec_layout): with
    # the C++ small-M kernel every weight [out, in] contiguous; with BLAS's matvec, the
    # long-output matrices stored as [in, out].
    if cpu_linear.load_kernel() is not None:
        assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, Linear))
    else:
        assert model.embed_tokens.weight.t().is_contiguous()
        assert model.layers[0].mlp.gate_up_proj.weight.t().is_contiguous()
        assert model.layers[0].mlp.down_proj.weight.is_contiguous()
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}])
    eager = minillm.generate(model, ids, 24, ignore_eos=True)
    assert minillm.generate(model, ids, 24, ignore_eos=True, compile=True) == eager
