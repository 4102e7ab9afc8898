"""Lab 10 checks: cost, the numbers behind "check the claim", the design, the verdicts.

    check.dollars_per_million(fn)    # ($/h, tok/s, utilization) -> $ per 1M tokens
    check.kv_cache_gb(fn)            # (layers, kv_heads, head_dim, seq_len, batch, dtype_bytes,
                                     #  shared_prefix=0) -> GB, a shared prefix stored once
    check.tokens_per_pass(fn)        # (alphas: acceptance per guess position) -> tokens per pass
    check.allreduce_seconds(fn)      # (message_bytes, num_gpus, quoted_link_bytes_per_s,
                                     #  step_latency_s) -> s
    check.replicas_needed(fn)        # (rate, e2e_s, batch, seconds_per_request, max_util) -> int
    check.claim_verdicts(fn)         # () -> {claim id: True (right) / False (wrong)}
    check.capstone_deployment(fn, capstone)  # () -> a Deployment within the KL budget that
                                             #    measurably beats the defaults' tok/s

Oracles: ``minillm.calc`` (``cost_per_million_tokens``, ``kv_cache_bytes``,
``allreduce_time_s`` at half the quoted link bandwidth, ``replicas_needed`` (Little's law)
with the utilization bound of ``design_deployment``), ``reference_tokens_per_pass`` (the
expectation over the pass's outcomes, written out) and ``quizzes.claims.truth()``. Inputs are
random (never round numbers), and each named slip is computed on the same inputs: a slip is
named only when it reproduces the student's value and the right answer does not. The
messages name what is off (a unit, a factor, a missing term), never the formula: the
exercises ask the student to derive it. The verdict check names the claims whose verdict is
wrong and never prints what calc computes until every verdict is right.
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


@register(cases=4, nudge="Follow the units: dollars per hour on top, the tokens that hour makes below, "
                         "then scale to a million tokens.",
          concept="A rented GPU bills every hour, busy or idle; only the busy fraction of the hour "
                  "produces tokens, at the throughput measured while busy.")
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
        (ref * 3600, "you divided an hourly price by tokens per SECOND: the units do not match. "
                     "Count both per hour."),
        (ref / 1e3, "that is the price of 1,000 tokens, not of a million."),
        (ref * util * util, "the utilization is on the wrong side: a GPU busy half the time serves "
                            "half the tokens for the same bill, so a lower utilization must make "
                            "each token dearer."),
        (ref * util, "the utilization is missing: an idle hour is paid too, so a GPU busy part of "
                     "the time makes each token dearer."),
    ], "$ per 1M tokens")


# --------------------------------------------------------------------------- claim tools


@register(cases=4, nudge="Count the tokens the cache stores (the shared prefix once, each sequence's own "
                         "tokens once per sequence), then the bytes one token stores.",
          concept="Per token, every layer stores a key and a value vector for each KV head. Prefix "
                  "caching (Lab 04) keeps one copy of a prefix that several sequences share.")
def kv_cache_gb(case: Case, fn) -> None:
    """Your kv_cache_gb(num_layers, num_kv_heads, head_dim, seq_len, batch, dtype_bytes,
    shared_prefix=0): the KV cache of `batch` sequences of `seq_len` tokens whose first
    `shared_prefix` tokens are the same for all and stored once, in GB (1e9 bytes)."""
    from minillm import calc

    layers, heads = case.size(12, 96), case.choice([1, 2, 4, 8, 12, 32])
    dim, t = case.choice([64, 80, 128]), case.size(500, 9000)
    batch, dt = case.size(2, 32), case.choice([1, 2, 4])
    shared = (0, case.size(50, t // 2), case.size(1, t - 1), case.size(100, t // 3))[case.index]
    per_token = calc.kv_cache_bytes(layers, heads, dim, 1, dt)
    ref = per_token * (shared + batch * (t - shared)) / calc.GB
    args = (layers, heads, dim, t, batch, dt)
    yours = _number(case.call(fn, *args, shared_prefix=shared) if shared else case.call(fn, *args),
                    "KV cache (GB)")
    plain = per_token * t * batch / calc.GB
    _judge(yours, ref, [
        (ref * calc.GB / calc.GiB, "that is GiB (2³⁰ bytes). The question asks for GB = 1e9 bytes, "
                                   "the unit of datasheets; GiB reads 7% smaller."),
        (ref / 2, "the factor for K and V is missing: every layer stores a key AND a value "
                  "vector per KV head per token."),
        (ref / 2 * calc.GB / calc.GiB, "two slips: K and V are counted once, and the result is in "
                                       "GiB rather than GB (1e9 bytes)."),
        (plain, f"you stored the shared prefix of {shared} tokens once per sequence: with prefix "
                f"caching the sequences share one copy of it."),
        (per_token * batch * (t - shared) / calc.GB, f"the shared prefix itself is missing: its "
                                                     f"{shared} tokens are stored once, not zero times."),
        (ref / batch, "that is one sequence; the batch multiplies each sequence's own tokens."),
        (ref * calc.GB, "that is bytes; the question asks for GB (1e9 bytes)."),
    ], f"KV cache (GB) of {batch} sequences of {t} tokens sharing {shared}")


def reference_tokens_per_pass(alphas) -> float:
    """Expected tokens per target pass: sum over the pass's outcomes (the first rejected guess,
    or none) of their probability times the tokens they yield (accepted guesses + the one
    token the target adds)."""
    expected, p_all_before = 0.0, 1.0
    for i, a in enumerate(alphas):
        expected += p_all_before * (1 - a) * (i + 1)   # guesses 1..i accepted, guess i+1 rejected
        p_all_before *= a
    return expected + p_all_before * (len(alphas) + 1)  # all k accepted: k + the bonus token


@register(cases=4, nudge="Work one pass by hand with two guesses: list its possible outcomes, the "
                         "probability of each and the tokens each yields.",
          concept="A guess counts only if every guess before it was accepted (the first rejection "
                  "discards the rest), and every pass adds one token of the target's own.")
def tokens_per_pass(case: Case, fn) -> None:
    """Your tokens_per_pass(alphas): expected tokens per target pass of speculative decoding,
    where alphas[i] is the probability that guess i + 1 is accepted given that every guess
    before it was (k = len(alphas) guesses)."""
    import numpy as np

    from minillm import calc

    k = (5, case.size(2, 8), case.size(1, 10), 1)[case.index]
    if case.index == 0:
        alphas = [0.7] * k                                     # the claim's constant α
    else:                                                      # acceptance falling with position
        start = 0.55 + 0.4 * float(case.rng.random())
        alphas = [round(start * 0.93 ** i, 4) for i in range(k)]
    ref = reference_tokens_per_pass(alphas)
    if case.index == 0:
        assert abs(ref - calc.spec_expected_tokens(0.7, k)) < 1e-12
    yours = _number(case.call(fn, list(alphas)), "tokens per pass")
    prods = np.cumprod(alphas)
    mean = float(np.mean(alphas))
    _judge(yours, ref, [
        (sum(alphas) + 1, "you counted every guess as kept with its own probability. A guess counts "
                          "only if all the guesses before it were accepted too."),
        (sum(alphas), "two slips: each guess is counted on its own probability, and the target's "
                      "own token is missing."),
        (ref - 1, "the target's own token is missing: every pass adds one (the correction or the "
                  "bonus token)."),
        (1 + float(prods[:-1].sum()), "one term short: the last guess counts too, when every guess "
                                      "before it and itself are accepted."),
        (calc.spec_expected_tokens(mean, k), "you used the mean acceptance as if every position had "
                                             "it: each position has its own probability here."),
    ], f"tokens per pass with acceptance {alphas}")


@register(cases=4, nudge="Count the ring's steps, what each step sends, over which direction of the "
                         "link, and what each step costs besides its bytes.",
          concept="A ring all-reduce is a reduce-scatter then an all-gather; in each phase every GPU "
                  "passes one N-th of the message to its neighbour, N − 1 times, one way round the "
                  "ring. Spec sheets add both directions of a link.")
def allreduce_seconds(case: Case, fn) -> None:
    """Your allreduce_seconds(message_bytes, num_gpus, quoted_link_bytes_per_s,
    step_latency_s): a ring all-reduce's time when the link's spec-sheet figure counts both
    directions and every ring step also pays step_latency_s."""
    from minillm import calc

    msg = case.size(1, 500) * 1e6 + case.size(1, 999) * 1e3
    n = (8, 4, case.choice([3, 6, 16]), 2)[case.index]
    quoted = case.choice([900e9, 600e9, 64e9, 128e9])
    lat = (5e-6, 2e-5, round(1e-6 * case.size(1, 30), 7), 1e-5)[case.index]
    if case.index == 3:
        msg = case.size(1, 200) * 1e3        # a small message: the latency dominates
    ref = calc.allreduce_time_s(msg, n, quoted / 2, lat)
    bytes_time = calc.allreduce_time_s(msg, n, quoted / 2)
    steps = 2 * (n - 1)
    yours = _number(case.call(fn, msg, n, quoted, lat), "all-reduce time (s)")
    _judge(yours, ref, [
        (bytes_time / 2 + steps * lat, "you used the quoted figure, which counts both directions; "
                                       "a ring step sends one way, to the next GPU."),
        (bytes_time, "the latency is missing: every ring step pays it before its bytes flow."),
        (bytes_time + lat, "the latency is paid once per ring step, not once per all-reduce."),
        (bytes_time + (n - 1) * lat, "half the steps' latency: the ring runs two phases (reduce-"
                                     "scatter, then all-gather) of N − 1 steps each."),
        (msg / (quoted / 2) + steps * lat, "the bytes are off: each step sends one N-th of the message, "
                                           "and there are two phases of N − 1 steps."),
        (msg / quoted + steps * lat, "two slips: the bytes each GPU sends in the whole ring, and the "
                                     "quoted link figure counting both directions."),
    ], f"all-reduce of {msg:.4g} bytes on {n} GPUs, {lat * 1e6:.3g} µs per step")


# --------------------------------------------------------------------------- design


@register(cases=5, nudge="Check each bound on its own against the case printed above, then which one "
                         "decides.",
          concept="Two limits size a fleet: the requests in flight must find slots (Little's law), "
                  "and each replica must stay below its utilization bound (stability); replicas come "
                  "whole.")
def replicas_needed(case: Case, fn) -> None:
    """Your replicas_needed(arrival_rate, e2e_s, batch_size, seconds_per_request,
    max_utilization): enough replicas to hold λ·e2e requests in flight at batch_size each,
    AND to keep each replica's utilization λ·seconds_per_request / replicas at or below
    max_utilization."""
    lam = case.size(5, 300) + 0.5
    e2e = round(1 + 9 * float(case.rng.random()), 3)
    batch = case.choice([8, 16, 32, 64, 128, 256])
    rho = case.choice([0.7, 0.8, 0.9])
    if case.index < 2:  # at least 4 batches in flight: the two bounds then round apart
        lam = max(lam, math.ceil(4 * batch / e2e) + 0.5)
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


@register(cases=1, success="every verdict agrees with calc",
          nudge="Recompute each claim named above with your tools and calc, and compare the number "
                "with the claim's own.",
          concept="A claim is right when the computed value lies within 2% of it (or the comparison it "
                  "states holds). The wrong ones forget a factor, mix units, or quote another quantity "
                  "(both directions, sparse FLOPs).")
def claim_verdicts(case: Case, fn) -> None:
    """Your claim_verdicts() -> {claim id: True if the claim is right, False if wrong}, one
    entry per claim of quizzes.claims.CLAIMS. While a verdict is wrong, names the claims whose
    verdict disagrees with calc, never what calc computes; once all agree, prints each claim's
    computed value and the slip behind every wrong one."""
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
    wrong = [c for c in claims.CLAIMS if got[c.id] != c.is_true()]
    if wrong:
        lines = [f"{c.id}: you say {'right' if got[c.id] else 'wrong'}; recompute it"
                 + (f" ({c.check})" if c.check else "") for c in wrong]
        raise _Difference(f"{len(wrong)} of {len(ids)} verdicts disagree with calc:\n  "
                          + "\n  ".join(lines))
    claims.report(got)  # all right: now the computed values and the slips


# --------------------------------------------------------------------------- the capstone


@register(cases=1, success="a deployment within the quality budget that beats the defaults",
          nudge="Measure a candidate against the defaults yourself (capstone.compare) before you "
                "choose.",
          concept="On this workload the weights' read and the prefill's arithmetic dominate: fewer "
                  "bytes per weight, or fewer and fuller steps, pay; quality is measured as KL to the "
                  "fp32 model.")
def capstone_deployment(case: Case, fn, capstone) -> None:
    """Your my_deployment() -> widgets.deploy_runs.Deployment. The rules: weights whose KL to
    fp32 stays within the capstone's budget, and output tok/s at least (1 + min_gain) × the
    defaults', both measured here, back to back, best of `capstone.repeats` runs each."""
    from widgets.deploy_runs import Deployment

    got = case.call(fn)
    case.expect(isinstance(got, Deployment), f"return a Deployment(...), got {type(got).__name__}. "
                                             f"For example Deployment(weights='fp32', max_num_seqs=16).")
    case.expect(got != Deployment(), "that is the defaults: the capstone asks for a deployment that "
                                     "beats them. Change at least one choice (weights, spec_k, "
                                     "max_num_seqs, max_num_batched_tokens, enable_prefix_caching) "
                                     "and measure whether it helps.")
    kl = capstone.kl(got.weights)
    case.expect(kl <= capstone.kl_budget,
                f"{got.weights} weights are {kl:.4f} nats of KL from fp32 per token, over the budget of "
                f"{capstone.kl_budget}: quality is part of the job. Use more bits.")
    yours, base = capstone.compare(got)
    gain = yours.throughput / base.throughput
    case.expect(gain >= 1 + capstone.min_gain,
                f"measured just now, best of {capstone.repeats} runs each: yours {yours.throughput:.1f} "
                f"tok/s, the defaults {base.throughput:.1f} tok/s ({gain:.2f}×). The rule is at least "
                f"{1 + capstone.min_gain:.2f}× the defaults' tok/s within the KL budget: try another "
                f"lever, or combine two.")
    print(f"  measured just now, best of {capstone.repeats} runs each: yours {yours.throughput:.1f} tok/s, "
          f"the defaults {base.throughput:.1f} tok/s: {gain:.2f}× (at least {1 + capstone.min_gain:.2f}× "
          f"needed), within the KL budget of {capstone.kl_budget}")
