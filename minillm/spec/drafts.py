"""Drafts for speculative decoding: cheap guesses of the target's next k tokens.

Every draft has the same two methods:

    reset(max_len, temperature, generator)       a new generation of at most max_len tokens
    propose(context_ids, k) -> (tokens, probs)   up to k guesses after context_ids; probs
                                                 [len(tokens), V] (what they were drawn
                                                 from), or None for a deterministic draft
    rollback(num_tokens)                         only context_ids[:num_tokens] stay valid

- `NgramDraft`: prompt lookup, no model. The longest suffix n-gram of the context that
  occurred earlier in it predicts what followed it then. It pays on input-grounded tasks
  (summarize or edit a given text), where the output copies spans of the input.
- `ModelDraft`: a small model with the target's vocabulary and its own KV cache.
- `LayerSkipDraft`: the target's own first L layers plus its final norm and LM head (the
  weights are shared, nothing is copied), with a KV cache of its own for those L layers.

Sampling: with temperature 0 a model draft proposes argmaxes (and returns probs None: greedy
verification only compares argmaxes); otherwise it samples each guess from its own
distribution at the same temperature and returns those distributions for the acceptance
rule (`minillm.spec.rejection`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..attention import ContiguousCacheContext
from ..kv_cache import KVCache
from ..sampling import draw, sampling_probs


def cached_logits(model, cache: KVCache, ids: list[int], start: int, last_only: bool = False,
                  num_layers: int | None = None) -> torch.Tensor:
    """Run ids at positions start.. over `cache` (their K/V are written into it) and return
    fp32 logits [len(ids), V], or [1, V] for the last token only (the LM head is the
    largest matrix: a draft needs one row). num_layers: the first layers only."""
    x = torch.tensor([ids], device=model.device)
    pos = torch.arange(start, start + len(ids), device=model.device)[None]
    ctx = ContiguousCacheContext(model.attn_backend, cache, start)
    h = model.hidden_states(x, pos, ctx, num_layers=num_layers)[0]
    return model.compute_logits(h[-1:] if last_only else h).float()


class NgramDraft:
    """Prompt lookup: match the context's last n tokens (n = max_ngram down to min_ngram)
    at their most recent earlier occurrence and propose the k tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int)
                and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need ints 1 <= min_ngram <= max_ngram, got min_ngram="
                             f"{min_ngram!r}, max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context_ids: Sequence[int], k: int):
        ctx = list(context_ids)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # most recent occurrence first
                if ctx[start:start + n] == suffix:
                    return ctx[start + n:start + n + k], None
        return [], None  # no match: the step is a plain decode

    def reset(self, max_len: int, temperature: float, generator) -> None:
        pass  # no state

    def rollback(self, num_tokens: int) -> None:
        pass


class ModelDraft:
    """A small model with the target's vocabulary: proposes autoregressively from its own
    KV cache. `num_layers` runs only the first layers of `model` (see LayerSkipDraft)."""

    def __init__(self, model, num_layers: int | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None):
        cfg = model.config
        if num_layers is not None and not (isinstance(num_layers, int)
                                           and 1 <= num_layers <= cfg.num_layers):
            raise ValueError(f"num_layers must be an int in [1, {cfg.num_layers}] (the "
                             f"model's layers), got {num_layers!r}")
        self.model, self.num_layers = model, num_layers
        self.temperature, self.generator = temperature, generator
        self.cache: KVCache | None = None
        self.num_cached = 0  # context tokens whose K/V the cache holds

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def reset(self, max_len: int, temperature: float, generator) -> None:
        """Start a new generation of at most `max_len` tokens (called by the decoder)."""
        cfg = self.model.config
        if self.num_layers is not None:  # a cache for the layers the draft runs
            cfg = replace(cfg, num_layers=self.num_layers)
        self.cache = KVCache(cfg, 1, max_len, self.model.dtype, self.model.device)
        self.num_cached, self.temperature, self.generator = 0, temperature, generator

    @torch.inference_mode()
    def propose(self, context_ids: Sequence[int], k: int):
        if self.cache is None or len(context_ids) + k > self.cache.max_seq_len:
            raise ValueError(f"the draft's cache holds {0 if self.cache is None else self.cache.max_seq_len} "
                             f"tokens, {len(context_ids) + k} needed: call reset(max_len, ...) first")
        new = list(context_ids[self.num_cached:])  # tokens the cache has not seen yet
        tokens, probs = [], []
        for _ in range(k):
            logits = self._forward(new, self.num_cached)
            self.num_cached += len(new)
            if self.temperature == 0:
                token = int(logits.argmax())
            else:
                q = sampling_probs(logits, self.temperature)
                token = draw(q, self.generator)
                probs.append(q)
            tokens.append(token)
            new = [token]
        return tokens, (torch.stack(probs) if probs else None)

    def rollback(self, num_tokens: int) -> None:
        self.num_cached = min(self.num_cached, num_tokens)

    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits [V] after ids, written into the cache at positions start.."""
        return cached_logits(self.model, self.cache, ids, start, last_only=True,
                             num_layers=self.num_layers)[0]


class LayerSkipDraft(ModelDraft):
    """The target's first `num_layers` layers, its final norm and its LM head: a draft
    that costs about num_layers / L of a target pass (plus the LM head) and needs no
    second model.

    `num_layers=None` takes `default_num_layers(target)`, chosen by measurement
    (`python benchmarks/spec.py --layer-sweep`, recorded in BENCHMARKS.md): on SmolLM2
    the first layers' hidden state, read by the final norm and LM head it was not trained
    for, agrees with the full model on about a tenth of the tokens or fewer until L is
    about 16 of 30 (a third at 24, under a half at 27), while the cost grows with every
    layer, so the cheapest draft, L = 1, came out ahead (L = 2 within noise). No L makes it
    pay without a trained early exit; it is here as the baseline a trained draft must beat.
    """

    def __init__(self, target, num_layers: int | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None):
        if num_layers is None:
            num_layers = default_num_layers(target)
        super().__init__(target, num_layers, temperature, generator)


# The measured best L over the input-grounded prompt sets (1 of SmolLM2's 30), as a fraction
# of the layers, so that a deeper model gets a proportionate default.
DEFAULT_LAYER_FRACTION = 1 / 30


def default_num_layers(target) -> int:
    """`LayerSkipDraft`'s default L for `target`: DEFAULT_LAYER_FRACTION of its layers."""
    return max(1, round(DEFAULT_LAYER_FRACTION * target.config.num_layers))
