"""Speculative decoding: expected tokens per target pass, speedup, best draft length k,
and the acceptance rule ``min(1, p / q)``.

α is the per-token acceptance rate, assumed independent from token to token, except in
``spec_expected_tokens_by_position``, which takes the acceptance measured at each draft
position given the earlier guesses kept (a copying draft's acceptances come in runs).
"""

from __future__ import annotations

from ._common import _int, _probability, _real


def spec_expected_tokens(alpha, k) -> float:
    """Expected tokens per target pass with k drafted tokens: ``(1 − α^(k+1)) / (1 − α)``.

    α is the per-token acceptance rate (assumed independent). Draft token i survives only if
    all before it were accepted, and the pass always adds one token of its own (the
    correction or a bonus token), so E = 1 + α + α² + … + α^k. α = 1 gives k + 1.
    """
    a = _probability("alpha", alpha)
    kk = _int("k", k, minimum=0)
    if a == 1:
        return float(kk + 1)
    return (1 - a ** (kk + 1)) / (1 - a)


def spec_expected_tokens_by_position(alphas) -> float:
    """Expected tokens per target pass when guess j is kept with probability ``alphas[j-1]``
    given that guesses 1..j−1 were kept: ``1 + α₁ + α₁α₂ + … + α₁⋯α_k`` (k = len(alphas)).

    With every αⱼ = α it is ``spec_expected_tokens(α, k)``. A draft whose acceptances come
    in runs (prompt lookup: once it copies a span, it keeps copying) has αⱼ rising with j;
    one α (accepted ÷ guessed) then misstates the tokens per pass, and this does not: passes
    that keep all k guesses or none, half of each, measure α = 0.5 (1.94 tokens per pass at
    k = 4 by the single-α formula) but yield 3, which αⱼ = (0.5, 1, 1, 1) gives.
    """
    total, reach = 1.0, 1.0
    for j, a in enumerate(alphas, 1):
        reach *= _probability(f"alphas[{j - 1}]", a)
        total += reach
    return total


def spec_expected_tokens_naive(alpha, k) -> float:
    """The textbook shortcut ``k · α + 1``: it treats draft tokens as accepted independently
    of one another, ignoring that the first rejection discards the rest, so it overestimates
    (α = 0.8, k = 5: 5.0 against the true 3.69)."""
    return _int("k", k, minimum=0) * _probability("alpha", alpha) + 1


def spec_speedup(alpha, k, cost_ratio, verify_cost=1.0) -> float:
    """Speedup over plain decoding: ``expected_tokens / (verify_cost + k · r)``.

    ``r`` = cost of one draft step ÷ cost of one target step. One round costs k draft steps
    plus one target pass over k + 1 tokens. ``verify_cost`` is that pass ÷ one decode step:
    about 1 while the pass is memory-bound (a GPU reads the weights once for all k + 1
    tokens), but measured at ~2 on a 2-core CPU, where a few rows instead of one take BLAS
    from its matrix-vector path to a small GEMM (`benchmarks/spec.py` measures it).
    k = 0 is plain decoding (speedup 1).
    """
    return spec_speedup_from_tokens(spec_expected_tokens(alpha, k), k, cost_ratio, verify_cost)


def spec_speedup_from_tokens(expected_tokens, k, cost_ratio, verify_cost=1.0) -> float:
    """``spec_speedup`` for a round that yields ``expected_tokens`` per target pass, however
    they were predicted (one α: ``spec_expected_tokens``; α at each draft position:
    ``spec_expected_tokens_by_position``): ``E / (verify_cost + k · r)``; k = 0 costs one
    plain step."""
    e = _real("expected_tokens", expected_tokens)
    r = _real("cost_ratio", cost_ratio, allow_zero=True)
    kk = _int("k", k, minimum=0)
    c = _real("verify_cost", verify_cost)
    return e / ((c if kk else 1.0) + kk * r)


def spec_optimal_k(alpha, cost_ratio, k_max=16, verify_cost=1.0) -> int:
    """The k in 0..k_max with the highest ``spec_speedup`` (the smallest one on ties).

    0 means speculation does not pay. α = 0.8, r = 0.05 gives k = 8 (speedup 3.09); the curve
    is flat there: every k from 6 to 10 is within 2% of it. ``verify_cost`` is passed on to
    ``spec_speedup`` (a verify pass that costs more than a decode step favours fewer passes,
    so a larger k, or none at all).
    """
    kmax = _int("k_max", k_max)
    return max(range(kmax + 1),
               key=lambda kk: (spec_speedup(alpha, kk, cost_ratio, verify_cost), -kk))


def spec_acceptance_probability(p, q) -> float:
    """Probability of accepting a drafted token: ``min(1, p / q)``.

    p = target model's probability of the token, q = draft model's (q > 0, since the draft
    sampled it). p = 0.3, q = 0.6 → 0.5. On rejection, resample from norm(max(0, p − q)).
    """
    p_ = _probability("p", p)
    q_ = _probability("q", q, allow_zero=False)
    return min(1.0, p_ / q_)
