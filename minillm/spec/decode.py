"""`speculative_generate`: batch-1 decoding where a draft guesses and the target verifies.

One step:
  1. the draft proposes up to k tokens after the context;
  2. the target scores the context's last token plus the k guesses in ONE forward pass over
     its KV cache: k + 1 distributions for the price of reading the weights once;
  3. the acceptance rule keeps a prefix of the guesses and adds one token of the target's
     own (`rejection_sample`; with temperature 0: keep guesses while they equal the
     target's argmax, then the target's argmax);
  4. both caches roll back to the accepted length.

A draft with an ``observe(fed, best, accepted)`` method is shown each greedy pass: the
tokens fed, the target's argmax after each, and how many guesses were kept.

Invariants between steps: the target's cache holds the K/V of every context token but the
last one, which the next verification pass feeds first; rolling back is just moving that
boundary (entries past it are overwritten before they are read). A step emits 1..k+1
tokens, never more than max_new_tokens in all, and stops right after a stop token.

Lossless: with temperature 0 the tokens equal `minillm.generate`'s; with temperature > 0
every token is distributed as plain sampling's (the target's top-k / top-p filtering is
applied to p before the acceptance test, so no token outside the nucleus is ever emitted).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv_cache import KVCache
from ..prompts import check_generation, stop_token_set
from ..sampling import make_generator, sampling_probs, validate_sampling
from .drafts import cached_logits
from .rejection import rejection_sample


@dataclass
class SpecOutput:
    tokens: list[int] = field(default_factory=list)  # the new token ids
    num_target_passes: int = 0      # target forward passes after the prompt's
    num_draft_tokens: int = 0       # guesses the target verified
    num_accepted: int = 0           # ... of which it kept
    accepted_per_pass: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """alpha, measured: accepted guesses / verified guesses (0.0 if none)."""
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0


@torch.inference_mode()
def speculative_generate(target, draft, prompt_ids, max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, top_k: int | None = None,
                         top_p: float | None = None, seed: int | None = None,
                         stop_token_ids=None, ignore_eos: bool = False) -> SpecOutput:
    """Generate up to max_new_tokens with `draft` guessing k tokens per target pass."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (draft tokens per target pass) must be an int >= 1, got {k!r}")
    vocab = getattr(draft, "vocab_size", None)
    if vocab is not None and vocab != target.config.vocab_size:
        raise ValueError(f"the draft's vocabulary has {vocab} tokens, the target's "
                         f"{target.config.vocab_size}: a draft must share the target's "
                         f"tokenizer")
    prompt = check_generation(target, prompt_ids, max_new_tokens)
    validate_sampling(temperature, top_k, top_p)
    out = SpecOutput()
    if max_new_tokens == 0:
        return out
    stops = stop_token_set(stop_token_ids, target.config.eos_token_id, ignore_eos)
    generator = make_generator(seed)
    max_len = len(prompt) + max_new_tokens
    draft.reset(max_len, temperature, generator)
    cache = KVCache(target.config, 1, max_len, target.dtype, target.device)

    # The prompt but its last token fills the cache; the first step feeds that token.
    if len(prompt) > 1:
        cached_logits(target, cache, prompt[:-1], 0, last_only=True)
    context = list(prompt)
    while len(out.tokens) < max_new_tokens:
        room = max_new_tokens - len(out.tokens) - 1  # guesses beyond it could never be kept
        guesses, q = draft.propose(context, min(k, room)) if room > 0 else ([], None)
        guesses = list(guesses)
        logits = cached_logits(target, cache, [context[-1]] + guesses, len(context) - 1)
        out.num_target_passes += 1
        if temperature == 0:
            best = logits.argmax(-1).tolist()
            n = 0
            while n < len(guesses) and guesses[n] == best[n]:
                n += 1
            emitted = guesses[:n] + [best[n]]
            observe = getattr(draft, "observe", None)
            if observe is not None:  # a draft that learns from the pass (LookaheadDraft)
                observe([context[-1]] + guesses, best, n)
        else:
            p = sampling_probs(logits, temperature, top_k, top_p)
            emitted = rejection_sample(p, q, guesses, generator)
        accepted = len(emitted) - 1
        out.num_draft_tokens += len(guesses)
        out.num_accepted += accepted
        out.accepted_per_pass.append(accepted)
        for i, token in enumerate(emitted):
            if token in stops:  # stop right after it: later tokens are not emitted
                emitted = emitted[:i + 1]
                break
        out.tokens += emitted
        context += emitted
        draft.rollback(len(context) - 1)  # valid: up to the last accepted guess
        if emitted[-1] in stops:
            break
    return out
