"""Speculative sampling's acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

A draft proposed tokens d_1..d_k, drawn from its distributions q_1..q_k. The target scored
them in one pass and gives p_1..p_{k+1} (p_i is its distribution for position i, given the
context and d_1..d_{i-1}). For i = 1..k:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection, emit one token from norm(max(0, p_i - q_i)) and stop.

If all k are accepted, emit a bonus token from p_{k+1}. Each emitted token is then
distributed exactly as the target alone would have sampled it: lossless, whatever the
draft. (Why: a token t comes out at step i either accepted, with probability
q(t)·min(1, p(t)/q(t)) = min(q(t), p(t)), or resampled after a rejection, with probability
sum_x max(0, q(x) - p(x)) · max(0, p(t) - q(t)) / sum_x max(0, p(x) - q(x)) = max(0, p(t) -
q(t)), the two sums being equal; together p(t).)

A draft without probabilities (n-gram lookup) proposes deterministically: its q_i is
one-hot on d_i, so d_i is accepted with probability p_i(d_i) and the residual is p_i with
d_i removed.

Invariant: 1 <= len(result) <= k + 1, and result[:-1] == draft_tokens[:len(result) - 1].
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling import draw


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_tokens: Sequence[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """target_probs [k+1, V], draft_probs [k, V] or None (a draft without probabilities),
    draft_tokens of length k -> the emitted tokens (1 .. k+1 of them)."""
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k+1, V] = [{k + 1}, V] for {k} draft tokens, "
                         f"got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {target_probs.shape[1]}] or None, "
                         f"got {tuple(draft_probs.shape)}")
    out: list[int] = []
    for i, token in enumerate(draft_tokens):
        p = target_probs[i].float()
        q = (torch.nn.functional.one_hot(torch.tensor(token, device=p.device), p.shape[0]).float()
             if draft_probs is None else draft_probs[i].float())
        u = float(torch.rand((), generator=generator))
        if u * float(q[token]) < float(p[token]):  # u < p/q, without dividing by q = 0
            out.append(int(token))
            continue
        residual = (p - q).clamp(min=0)
        # A rejection has probability sum(max(0, q - p)) > 0, so the residual has mass too;
        # only rounding can leave it empty, and then p itself is the right fallback.
        out.append(draw(residual if float(residual.sum()) > 0 else p, generator))
        return out
    out.append(draw(target_probs[k].float(), generator))  # all accepted: the bonus token
    return out
