"""`LookaheadDraft`: guesses taken from the target's own earlier verify passes, no draft model
and no text to copy. The idea of lookahead decoding (Fu et al. 2024), reduced to what one
causal pass of `speculative_generate` can carry.

A verify pass over ``[last_token] + guesses`` returns the target's greedy prediction after
every fed token (``best``). Only the predictions up to the first rejected guess are used for
the text; the rest are predictions made after a wrong token, but most of the context is
right, so they are often what the target will say next anyway. This draft keeps them:

- **Jacobi window**: the predictions past the rejection become the next pass's guesses for
  the positions after the target's correction (one step of Jacobi iteration: a guessed future
  is refined by one parallel pass, and whatever matches greedy decoding is kept). It is kept
  k long: missing guesses are filled with the context's last tokens, Jacobi's arbitrary
  starting point;
- **n-gram pool**: every pass adds, for each fed token, the target's predictions that followed
  it (``ngram - 1`` tokens). When the context ends with a token the pool knows, the draft
  proposes that n-gram instead of the window (lookahead decoding's verification branch).

The original runs a 2-D window of Jacobi iterations and verifies several n-grams in the same
pass, with an attention mask of its own; this engine's passes are causal, so one candidate
per pass is verified. Lossless like every draft: the target verifies each guess, so the text
is plain greedy decoding's. Greedy only: `speculative_generate` calls `observe` after a
greedy pass; with sampling the draft proposes nothing.

Invariant: ``observe(fed, best, accepted)`` sees the tokens fed to the pass, the target's
argmax after each, and how many guesses were kept; the window then holds guesses for the
positions right after the tokens the pass emitted.
"""
from __future__ import annotations

from collections.abc import Sequence


class LookaheadDraft:
    """Guesses from the target's own earlier passes: an n-gram pool keyed by a token, and
    the Jacobi window of predictions past the last rejection (see the module doc)."""

    def __init__(self, ngram: int = 4, max_pool: int = 4096):
        if not (isinstance(ngram, int) and ngram >= 2):
            raise ValueError(f"ngram must be an int >= 2 (a key token and at least one token "
                             f"after it), got {ngram!r}")
        if not (isinstance(max_pool, int) and max_pool >= 1):
            raise ValueError(f"max_pool must be an int >= 1, got {max_pool!r}")
        self.ngram, self.max_pool = ngram, max_pool
        self.pool: dict[int, list[int]] = {}  # token -> what the target predicted after it
        self.window: list[int] = []
        self.greedy = True
        self.proposed_from = {"pool": 0, "window": 0}  # passes whose guesses came from each

    def reset(self, max_len: int, temperature: float, generator) -> None:
        self.pool, self.window = {}, []
        self.greedy = temperature == 0
        self.proposed_from = {"pool": 0, "window": 0}

    def propose(self, context_ids: Sequence[int], k: int):
        if not self.greedy or k <= 0:
            return [], None
        gram = self.pool.get(int(context_ids[-1]))
        if gram:
            self.proposed_from["pool"] += 1
            return list(gram[:k]), None
        self.proposed_from["window"] += 1
        guesses = self.window[:k]
        if len(guesses) < k:  # Jacobi iteration starts from any guess: the context's last tokens
            guesses += [int(t) for t in context_ids[-(k - len(guesses)):]]
        return guesses, None

    def observe(self, fed: Sequence[int], best: Sequence[int], accepted: int) -> None:
        """After a greedy pass: ``fed`` = [last_token] + guesses, ``best[i]`` the target's
        argmax after fed[:i + 1], ``accepted`` guesses kept (a prefix)."""
        fed, best = [int(t) for t in fed], [int(t) for t in best]
        span = self.ngram - 1
        for i, token in enumerate(fed):
            after = best[i:i + span]
            if len(after) == span or token not in self.pool:
                self.pool.pop(token, None)  # re-insert: the most recent n-gram wins, and ages last
                self.pool[token] = after
        while len(self.pool) > self.max_pool:
            self.pool.pop(next(iter(self.pool)))
        self.window = best[accepted + 1:]  # predictions past the correction: the next guesses

    def rollback(self, num_tokens: int) -> None:
        pass  # the pool and the window hold guesses only; nothing is tied to positions
