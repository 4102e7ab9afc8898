"""Lab 10 checks: cost, the numbers behind "check the claim", the design, the verdicts.

    check.dollars_per_million(fn)    # ($/h, tok/s, utilization) -> $ per 1M tokens
    check.kv_cache_gb(fn)            # (layers, kv_heads, head_dim, seq_len, batch, dtype_bytes) -> GB
    check.tokens_per_pass(fn)        # (alpha, k) -> expected tokens per target pass
    check.allreduce_seconds(fn)      # (message_bytes, num_gpus, quoted_link_bytes_per_s) -> s
    check.replicas_needed(fn)        # (rate, e2e_s, batch, seconds_per_request, max_util) -> int
    check.claim_verdicts(fn)         # () -> {claim id: True (right) / False (wrong)}
    check.capstone_deployment(fn, capstone)  # () -> a Deployment within the KL budget

Oracles: ``minillm.calc`` (``cost_per_million_tokens``, ``kv_cache_bytes``,
``spec_expected_tokens``, ``allreduce_time_s`` at half the quoted link bandwidth,
``replicas_needed`` (Little's law) with the utilization bound of ``design_deployment``) and
``quizzes.claims.truth()``. Inputs are random (never round numbers), and each named slip is
computed on the same inputs: a slip is named only when it reproduces the student's value and
the right answer does not.
"""
from __future__ import annotations

import math
import numbers

from .core import Case, _Difference, register

__all__ = ["dollars_per_million", "kv_cache_gb", "tokens_per_pass", "allreduce_seconds",
           "replicas_needed", "claim_verdicts", "capstone_deployment"]


def _number(yours, what: str) -> float:
    if isinstance(yours, bool) or not isinstance(yours, numbers.Real):
        try:  # a 0-d tensor or numpy scalar
            yours = float(yours)
        except (TypeError, ValueError):
            raise _Difference(f"{what}: return a number, got {type(yours).__name__} "
                              f"({yours!r}).") from None
    yours = float(yours)
    if not math.isfinite(yours):
        raise _Difference(f"{what}: got {yours}; return a finite number.")
    return yours


def _judge(yours: float, ref: float, slips, what: str, rtol: float = 1e-6) -> None:
    """Pass if yours is ref (to rtol); else name the first slip that reproduces yours."""
    close = lambda a, b: math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)  # noqa: E731
    if close(yours, ref):
        return
    for value, message in slips:
        if close(yours, value) and not close(value, ref):
            raise _Difference(f"{what}: you give {yours:.6g}, the answer is {ref:.6g}: {message}")
    raise _Difference(f"{what}: you give {yours:.6g}, the answer is {ref:.6g}.")


# --------------------------------------------------------------------------- cost


@register(cases=4)
def dollars_per_million(case: Case, fn) -> None:
    """Your dollars_per_million(dollars_per_hour, tokens_per_s, utilization): the dollars
    that 1M tokens cost on a GPU rented by the hour, busy `utilization` of the time."""
    from minillm import calc

    price = round(0.3 + 4 * float(case.rng.random()), 2)
    tps = case.size(50, 5000)
    util = (1.0, 0.5, round(0.1 + 0.8 * float(case.rng.random()), 2), 0.25)[case.index]
    ref = calc.cost_per_million_tokens(price, tps, util)
    yours = _number(case.call(fn, price, tps, util), "$ per 1M tokens")
    _judge(yours, ref, [
        (ref * 3600, "you divided an hourly price by tokens per SECOND. Tokens per hour = tok/s × 3600."),
        (ref / 1e3, "that is the price of 1,000 tokens; multiply the price per token by 1e6."),
        (ref * util * util, "utilization multiplies the cost per token's denominator: a GPU busy half "
                            "the time serves half the tokens for the same bill. Divide by it."),
        (ref * util, "the utilization is missing: an idle hour is paid too, so divide by the "
                     "fraction of hours spent serving."),
    ], "$ per 1M tokens")


# --------------------------------------------------------------------------- claim tools


@register(cases=4)
def kv_cache_gb(case: Case, fn) -> None:
    """Your kv_cache_gb(num_layers, num_kv_heads, head_dim, seq_len, batch, dtype_bytes): the
    KV cache of `batch` sequences of `seq_len` tokens, in GB (1e9 bytes)."""
    from minillm import calc

    layers, heads = case.size(12, 96), case.choice([1, 2, 4, 8, 12, 32])
    dim, t = case.choice([64, 80, 128]), case.size(500, 9000)
    batch, dt = case.size(2, 32), case.choice([1, 2, 4])
    ref = calc.kv_cache_bytes(layers, heads, dim, t, dt, batch) / calc.GB
    yours = _number(case.call(fn, layers, heads, dim, t, batch, dt), "KV cache (GB)")
    _judge(yours, ref, [
        (ref * calc.GB / calc.GiB, "that is GiB (2³⁰ bytes). The question asks for GB = 1e9 bytes, "
                                   "the unit of datasheets; GiB reads 7% smaller."),
        (ref / 2, "the factor 2 for K and V is missing: every layer stores a key AND a value "
                  "vector per KV head per token."),
        (ref / 2 * calc.GB / calc.GiB, "two slips: the factor 2 for K and V is missing, and the "
                                       "result is in GiB rather than GB (1e9 bytes)."),
        (ref / batch, "that is one sequence; the batch multiplies it."),
        (ref * calc.GB, "that is bytes; divide by 1e9 for GB."),
    ], "KV cache (GB)")


@register(cases=4)
def tokens_per_pass(case: Case, fn) -> None:
    """Your tokens_per_pass(alpha, k): expected tokens per target pass of speculative
    decoding with k guesses accepted independently with probability alpha."""
    from minillm import calc

    alpha = (0.7, round(0.3 + 0.65 * float(case.rng.random()), 3), 0.9, 0.5)[case.index]
    k = (5, case.size(1, 10), case.size(2, 8), 1)[case.index]
    ref = calc.spec_expected_tokens(alpha, k)
    yours = _number(case.call(fn, alpha, k), "tokens per pass")
    _judge(yours, ref, [
        (calc.spec_expected_tokens_naive(alpha, k), "k·α + 1 counts every guess as kept with "
                                                    "probability α on its own. Guess i counts only "
                                                    "if all before it were accepted (α^i): "
                                                    "1 + α + … + α^k = (1 − α^(k+1)) / (1 − α)."),
        (k * alpha, "k·α forgets both that the first rejection discards the rest and the "
                    "target's own token every pass adds."),
        (ref - 1, "the target's own token is missing: every pass adds one (the correction or the "
                  "bonus token), so the sum starts at 1."),
        ((1 - alpha ** k) / (1 - alpha), "one term short: the sum runs to α^k, so the numerator is "
                                         "1 − α^(k+1)."),
    ], f"tokens per pass at α = {alpha}, k = {k}")


@register(cases=4)
def allreduce_seconds(case: Case, fn) -> None:
    """Your allreduce_seconds(message_bytes, num_gpus, quoted_link_bytes_per_s): a ring
    all-reduce's time when the link's spec-sheet figure is quoted bidirectional."""
    from minillm import calc

    msg = case.size(1, 500) * 1e6 + case.size(1, 999) * 1e3
    n = case.choice([2, 4, 8, 3])
    quoted = case.choice([900e9, 600e9, 64e9, 128e9])
    ref = calc.allreduce_time_s(msg, n, quoted / 2)
    yours = _number(case.call(fn, msg, n, quoted), "all-reduce time (s)")
    _judge(yours, ref, [
        (ref / 2, "you used the quoted figure, which counts both directions. A ring step sends "
                  "one way to the next GPU: per-direction bandwidth = quoted / 2."),
        (msg / (quoted / 2), "the ring factor is missing: each GPU sends 2·(N − 1)/N × the message in a ring all-reduce "
                             "(calc.ring_allreduce_bytes), not the message once."),
        (msg / quoted, "two slips: the ring sends 2·(N − 1)/N × the message, and the quoted "
                       "link figure is both directions (per direction = quoted / 2)."),
    ], f"all-reduce of {msg:.4g} bytes on {n} GPUs")


# --------------------------------------------------------------------------- design


@register(cases=5)
def replicas_needed(case: Case, fn) -> None:
    """Your replicas_needed(arrival_rate, e2e_s, batch_size, seconds_per_request,
    max_utilization): enough replicas to hold λ·e2e requests in flight at batch_size each,
    AND to keep each replica's utilization λ·seconds_per_request / replicas at or below
    max_utilization."""
    lam = case.size(5, 300) + 0.5
    e2e = round(1 + 9 * float(case.rng.random()), 3)
    batch = case.choice([8, 16, 32, 64, 128, 256])
    rho = case.choice([0.7, 0.8, 0.9])
    # Case 0 is bound by Little's law, case 1 by utilization, the rest fall where they fall.
    work = {0: e2e / batch * 0.5, 1: e2e / batch * 3}.get(case.index,
                                                         e2e / batch * (0.3 + 3 * float(case.rng.random())))
    little = math.ceil(lam * e2e / batch)
    stable = math.ceil(lam * work / rho)
    ref = max(little, stable)
    got = case.call(fn, lam, e2e, batch, work, rho)
    yours = _number(got, "replicas")
    case.expect(float(yours).is_integer(), f"replicas: got {yours}; a replica is a whole copy of "
                                           f"the model, so round UP to an integer (math.ceil).")
    _judge(yours, ref, [
        (little, f"Little's law alone gives {little}, but then each replica would run at "
                 f"ρ = {lam * work / little:.2f} > {rho}: add replicas until "
                 f"λ·seconds_per_request / replicas <= max_utilization."),
        (stable, f"the utilization bound alone gives {stable}, but {stable} replicas of "
                 f"{batch} slots cannot hold the λ·e2e = {lam * e2e:.0f} requests in flight "
                 f"(Little's law): take the larger of the two."),
        (math.ceil(lam / batch), "λ / batch ignores how long each request stays: requests in "
                                 "flight = λ × e2e (Little's law)."),
        (math.floor(lam * e2e / batch), "rounded down: the last replica's worth of requests "
                                        "would have nowhere to run. Use math.ceil."),
        (max(math.floor(lam * e2e / batch), math.floor(lam * work / rho)),
         "rounded down: use math.ceil for both bounds."),
    ], f"replicas for λ = {lam} req/s, e2e {e2e} s, batch {batch}")


# --------------------------------------------------------------------------- the verdicts


@register(cases=1, success="every verdict agrees with calc")
def claim_verdicts(case: Case, fn) -> None:
    """Your claim_verdicts() -> {claim id: True if the claim is right, False if wrong}, one
    entry per claim of quizzes.claims.CLAIMS. Prints every claim with its computed value,
    your verdict and calc's, then names the verdicts that disagree."""
    from quizzes import claims

    got = case.call(fn)
    case.expect(isinstance(got, dict), f"return a dict {{claim id: True/False}}, got "
                                       f"{type(got).__name__}.")
    ids = [c.id for c in claims.CLAIMS]
    unknown = sorted(set(got) - set(ids))
    case.expect(not unknown, f"unknown claim ids {unknown}; the claims are {ids}.")
    missing = [i for i in ids if got.get(i) is None]
    case.expect(not missing, f"no verdict yet for {missing}: say True (right) or False (wrong) "
                             f"for each.")
    bad = [f"{c.id}={got[c.id]!r}" for c in claims.CLAIMS if not isinstance(got[c.id], bool)]
    case.expect(not bad, f"verdicts must be True or False; got {', '.join(bad)}.")
    claims.report(got)  # every claim: the computed value, your verdict, calc's
    wrong = [c for c in claims.CLAIMS if got[c.id] != c.is_true()]
    if wrong:
        lines = [f"{c.id}: you say {'right' if got[c.id] else 'wrong'}; {claims.shown(c)}"
                 + (f" ({c.lesson})" if c.lesson and not c.is_true() else "") for c in wrong]
        raise _Difference(f"{len(wrong)} of {len(ids)} verdicts disagree with calc:\n  "
                          + "\n  ".join(lines))


# --------------------------------------------------------------------------- the capstone


@register(cases=1, success="a deployment within the quality budget")
def capstone_deployment(case: Case, fn, capstone) -> None:
    """Your my_deployment() -> widgets.deploy_runs.Deployment: valid, not the defaults, and
    with weights whose KL to fp32 stays within the capstone's budget."""
    from widgets.deploy_runs import Deployment

    got = case.call(fn)
    case.expect(isinstance(got, Deployment), f"return a Deployment(...), got {type(got).__name__}. "
                                             f"For example Deployment(weights='fp32', max_num_seqs=16).")
    case.expect(got != Deployment(), "that is the defaults: change at least one choice (weights, "
                                     "spec_k, max_num_seqs, max_num_batched_tokens, "
                                     "enable_prefix_caching) and measure whether it helps.")
    kl = capstone.kl(got.weights)
    case.expect(kl <= capstone.kl_budget,
                f"{got.weights} weights are {kl:.4f} nats of KL from fp32 per token, over the budget of "
                f"{capstone.kl_budget}: quality is part of the job. Use more bits.")
