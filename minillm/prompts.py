"""Checks on what a caller asks for, shared by `minillm.generate` and `LLMEngine`: one
prompt check, one context-length check, one set of stop tokens.

Each raises before any work is done, with a message that says what was wrong, what is
allowed and what to do.
"""
from __future__ import annotations

import torch


def check_prompt(prompt_ids, vocab_size: int) -> list[int]:
    """Token ids (a list/tuple of ints or a tensor) -> list[int], each in [0, vocab_size)."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    if not isinstance(prompt_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
        raise TypeError("prompt_ids must be a list of ints (token ids); encode text with "
                        "tokenizer.encode(...) first")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got {bad[:5]}")
    return list(prompt_ids)


def check_context_length(num_prompt_tokens: int, num_new_tokens: int, limit: int,
                         new_name: str = "max_new_tokens") -> None:
    """A prompt plus the tokens to generate must fit the context of `limit` tokens."""
    if num_prompt_tokens + num_new_tokens > limit:
        raise ValueError(f"prompt of {num_prompt_tokens} tokens + {new_name}={num_new_tokens} "
                         f"exceeds the context length of {limit} tokens; shorten the prompt "
                         f"or ask for at most {max(limit - num_prompt_tokens, 0)} new tokens")


def check_generation(model, prompt_ids, max_new_tokens) -> list[int]:
    """What `generate` and `speculative_generate` check: the prompt, max_new_tokens (an
    int >= 0) and that both fit the model's context. Returns the prompt as list[int]."""
    prompt = check_prompt(prompt_ids, model.config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_context_length(len(prompt), max_new_tokens, model.config.max_position_embeddings)
    return prompt


def stop_token_set(stop_token_ids, eos_token_id: int | None, ignore_eos: bool) -> frozenset[int]:
    """The ids that end generation: the caller's stop tokens, plus EOS unless ignored."""
    stops = set(stop_token_ids or ())
    if not ignore_eos and eos_token_id is not None:
        stops.add(eos_token_id)
    return frozenset(stops)
