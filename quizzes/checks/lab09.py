"""Lab 09 checks: an SSE parser, a percentile from raw latencies, a shed-or-admit policy.

    check.parse_sse(parse_sse)        # lines of a text/event-stream -> [payload, ..., "[DONE]"]
    check.percentile(percentile)      # (latencies, p) -> the nearest-rank p-th percentile
    check.should_admit(should_admit)  # (prompt_len, num_waiting, num_free_blocks,
                                      #  reserved_blocks, max_queue_len, block_size) -> bool

Oracles: ``minillm.serve.sse.iter_events`` (the parser the load generator uses),
``calc.percentile``, and ``reference_should_admit``, the rule of the server's
``AsyncEngine.submit``: shed (503) when ``max_queue_len`` requests already wait, or when the
prompt's blocks do not fit in the free blocks left after the waiting prompts' own.

Invariants: every case is fresh random data (OpenAI-style chunks with non-ASCII text,
lognormal latencies in random order, random admission scenarios with the edges included);
a slip is named only when it reproduces the student's answer and the right answer does not.
A parser that fails is then run on one small probe per SSE rule, and the first rule it
breaks is named. Messages name what is off (a rank, an order, a unit, a missing test),
never the code of the answer.
"""
from __future__ import annotations

import json
import math

from .core import Case, _Difference, register

__all__ = ["parse_sse", "percentile", "should_admit", "reference_should_admit", "sse_lines"]

_WORDS = ["the", " server", " streams", " tokens", " café", " naïve", " 東京", " 🚀", " p99",
          ",", " latency", " queue", "\n", ' "quoted"', " back\\slash"]


# --------------------------------------------------------------------------- SSE


def _chunks(case: Case) -> list:
    cid = f"cmpl-{case.size(1000, 9999)}"
    n = case.size(2, 6)
    out = [{"id": cid, "object": "text_completion", "model": "smollm2-135m-instruct",
            "choices": [{"index": 0, "text": "".join(case.choice(_WORDS) for _ in range(case.size(1, 3))),
                         "finish_reason": "length" if i == n - 1 else None}]} for i in range(n)]
    if case.rng.random() < 0.5:
        out.append({"id": cid, "object": "text_completion", "choices": [],
                    "usage": {"prompt_tokens": case.size(5, 40), "completion_tokens": n,
                              "total_tokens": n + 40}})
    return out + ["[DONE]"]


def sse_lines(payloads, *, comments=False, multiline=False, no_space=False, fields=False, rng=None):
    """The lines (no line endings) a server sends for ``payloads``."""
    lines = []
    for i, p in enumerate(payloads):
        if comments and (rng is None or rng.random() < 0.6):
            lines += [": keep-alive", ""] if i % 2 else [":"]
        if fields and i % 2 == 0:
            lines += [f"id: {i}", "event: completion"]
        text = p if isinstance(p, str) else json.dumps(p, ensure_ascii=False, indent=1 if multiline else None)
        prefix = "data:" if no_space and i % 2 else "data: "
        lines += [prefix + part for part in text.split("\n")] + [""]
    return lines


_PROBES = [  # (lines, expected, what the rule is, what to do)
    (['data: {"n": 1}', ""], [{"n": 1}], "prefix",
     "every payload line starts with 'data:' and one space; strip them and json.loads the rest"),
    (['data: {"n": 1}', "", "", 'data: {"n": 2}', ""], [{"n": 1}, {"n": 2}], "blank",
     "a blank line ends one event, not the stream (and several blank lines in a row are "
     "allowed): keep reading"),
    (['data: {"n": 1}', "", "data: [DONE]", ""], [{"n": 1}, "[DONE]"], "done",
     "the stream ends with 'data: [DONE]', which is not JSON (json.loads('[DONE]') fails): "
     "yield the string '[DONE]' itself. It is how a client tells a finished stream from a "
     "cut connection, so do not drop it"),
    ([": keep-alive", "", 'data: {"n": 1}', "", ":", "data: [DONE]", ""], [{"n": 1}, "[DONE]"], "comment",
     "lines starting with ':' are comments, which servers send as keep-alives while a "
     "request waits: skip them and keep reading"),
    (["id: 7", "event: completion", 'data: {"n": 1}', "", "retry: 500", "data: [DONE]", ""],
     [{"n": 1}, "[DONE]"], "fields",
     "an event may carry other fields (id:, event:, retry:); only data: lines hold the payload"),
    (['data:{"n": 1}', ""], [{"n": 1}], "no space",
     "the space after 'data:' is optional ('data:{...}' is valid SSE): remove one leading "
     "space if there is one, instead of slicing off a fixed 6 characters"),
    (['data: {"n":', "data: 1}", ""], [{"n": 1}], "multi-line",
     "one event's payload may span several data: lines: collect them until the blank line, "
     "join them with '\\n', then parse once"),
]


def _run_parser(fn, lines):
    try:
        return list(fn(list(lines))), None
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - a probe only reports what happened
        return None, exc


def _diagnose_sse(fn) -> str | None:
    for lines, want, _, fix in _PROBES:
        got, exc = _run_parser(fn, lines)
        if got == want:
            continue
        seen = (f"raised {type(exc).__name__}: {exc}" if exc is not None else f"returned {got!r}")
        if exc is None and got and isinstance(got[0], str) and got[0].startswith("data"):
            fix = "the 'data:' prefix is still on your payload. " + fix
        return f"on the stream {lines!r} your parser {seen}, expected {want!r}: {fix}."
    return None


@register(cases=4, nudge="Compare your payloads with the rules listed above the exercise, one rule at "
                         "a time, on the stream printed here.",
          concept="SSE is line-oriented: one field per line, one event per blank line; only data "
                  "lines carry the payload, and the end marker is not JSON.")
def parse_sse(case: Case, fn) -> None:
    """Your parse_sse(lines): the lines of a text/event-stream (str, no line endings) ->
    the list of payloads: each event's JSON as a dict, and "[DONE]" as the string."""
    from minillm.serve.sse import iter_events

    payloads = _chunks(case)
    style = [dict(), dict(comments=True, fields=True), dict(multiline=True),
             dict(comments=True, multiline=True, no_space=True, fields=True)][case.index % 4]
    lines = sse_lines(payloads, rng=case.rng, **style)
    want = list(iter_events(lines))
    assert want == payloads  # the oracle reads what sse_lines wrote
    try:
        got = case.call(fn, lines)
    except _Difference as error:  # it raised: name the SSE rule it breaks, if a probe finds one
        why = _diagnose_sse(fn)
        raise _Difference(f"{why}\n  (On this case: {error})" if why else str(error)) from None
    try:
        got = list(got)
    except TypeError:
        raise _Difference(f"return a list (or yield the payloads), got {type(got).__name__}.") from None
    if got == want:
        return
    why = _diagnose_sse(fn)
    if why:
        raise _Difference(why)
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    raise _Difference(f"payload {i} differs: yours {got[i] if i < len(got) else 'missing'!r}, expected "
                      f"{want[i] if i < len(want) else 'nothing'!r} ({len(got)} payloads against {len(want)}).")


# --------------------------------------------------------------------------- percentile


@register(cases=4, nudge="Try your function by hand on 10 latencies: which of the sorted values should "
                         "p90, p95 and p50 return?",
          concept="The nearest-rank percentile is an observed latency: the smallest one with at least "
                  "p% of all latencies at or below it. Positions count from 1 in that definition and "
                  "from 0 in a Python list.")
def percentile(case: Case, fn) -> None:
    """Your percentile(latencies, p): the nearest-rank p-th percentile (p in percent) of raw
    latencies given in arrival order: the smallest observed latency with at least p% of them
    at or below it."""
    import numpy as np

    from minillm import calc

    p = [99, 99, 95, 90][case.index % 4]
    n = [100, case.size(30, 97), 200, case.size(11, 60)][case.index % 4]
    xs = [round(float(x), 6) for x in case.rng.lognormal(-1.0, 0.8, n)]
    xs[case.size(0, n // 3)] = round(max(xs) * 3, 6)  # a slow request early on: order matters
    ref = calc.percentile(xs, p)
    s = sorted(xs)
    rank = math.ceil(round(p * n / 100, 9))
    yours = case.call(fn, list(xs), p)
    try:
        yours = float(yours)
    except (TypeError, ValueError):
        raise _Difference(f"return one number (seconds), got {type(yours).__name__}.") from None
    if abs(yours - ref) <= 1e-12:
        return
    where = f"(n = {n} latencies, p = {p}: the answer is the {_ordinal(rank)} smallest, {ref:.6g} s)"
    slips = [
        (float(np.mean(xs)), "that is the mean. A percentile is one of the observed latencies, at a "
                             "position in the sorted values: p99 is the latency that 99% of requests "
                             "do not exceed."),
        (xs[rank - 1], "you took the value at the right position of the latencies in arrival order: "
                       "positions count in the SORTED latencies."),
        (s[min(rank, n - 1)], "one position too high: check your index on 10 latencies by hand (p90 is "
                              "the 9th smallest), and remember that a Python list counts from 0."),
        (s[max(rank - 2, 0)], "one position too low: when p·n/100 is not a whole number, at least p% "
                              "of the values must still lie at or below the answer."),
        (float(np.percentile(xs, p)), "you interpolated between two observations (numpy's default "
                                      "method='linear'). The nearest-rank percentile is a latency "
                                      "that was actually observed."),
        (s[-1], "that is the maximum: p99 ignores the slowest 1% of requests."),
        (s[n // 2], "that is the median; use p."),
    ]
    named = [message for value, message in slips
             if abs(yours - value) <= 1e-12 and abs(value - ref) > 1e-12]
    if named:  # two slips can give the same value (the max is one rank too high for p99 of 100)
        raise _Difference(f"you gave {yours:.6g} s {where}: " + " Or: ".join(named))
    raise _Difference(f"you gave {yours:.6g} s, expected {ref:.6g} s {where}.")


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


# --------------------------------------------------------------------------- shed or admit


def reference_should_admit(prompt_len, num_waiting, num_free_blocks, reserved_blocks,
                           max_queue_len, block_size) -> bool:
    """Admit unless the queue is full or the prompt's blocks do not fit in the free blocks
    left once the waiting prompts have taken theirs."""
    if num_waiting >= max_queue_len:
        return False
    return -(-prompt_len // block_size) <= num_free_blocks - reserved_blocks


_ADMIT_SLIPS = [
    (lambda p, w, f, r, q, b: w <= q and -(-p // b) <= f - r,
     "the queue limit is off by one: with max_queue_len = q, a new request that finds q "
     "already waiting would make q + 1 waiting."),
    (lambda p, w, f, r, q, b: w < q and p // b <= f - r,
     "a prompt's blocks are rounded down: a prompt of 17 tokens in blocks of 16 needs 2 blocks, "
     "not 1."),
    (lambda p, w, f, r, q, b: w < q and p <= f - r,
     "you compared tokens with blocks: count the prompt in blocks."),
    (lambda p, w, f, r, q, b: w < q and -(-p // b) <= f,
     "the waiting requests' prompts will take reserved_blocks of the free blocks before this "
     "one runs: those blocks are not free for it."),
    (lambda p, w, f, r, q, b: w < q and -(-p // b) < f - r,
     "a prompt that needs exactly the blocks that are left fits: it must be admitted."),
    (lambda p, w, f, r, q, b: -(-p // b) <= f - r,
     "the queue limit is never applied: a full queue sheds whatever the free blocks say (a long "
     "queue means every new request waits too long anyway)."),
    (lambda p, w, f, r, q, b: w < q,
     "the KV check is missing: a prompt that the blocks left by the waiting prompts cannot hold "
     "must be shed."),
    (lambda *a: not reference_should_admit(*a),
     "every answer is inverted: return True to admit, False to shed (answer 503)."),
]


@register(cases=3, nudge="Run the two shedding cases on paper with the inputs printed above.",
          concept="Admission protects the requests already accepted: the queue bounds how long they "
                  "wait, and the KV pool must keep room for the prompts already waiting before it "
                  "takes a new one.")
def should_admit(case: Case, fn) -> None:
    """Your should_admit(prompt_len, num_waiting, num_free_blocks, reserved_blocks,
    max_queue_len, block_size) -> True to admit, False to shed with a 503 + Retry-After."""
    b = case.choice([8, 16, 32])
    q = case.size(2, 16)
    scenarios = []
    for _ in range(48):
        p = case.size(1, 6 * b)
        scenarios.append((p, case.size(0, q + 2), case.size(0, 20), case.size(0, 6), q, b))
    for k in (2, 3):  # the edges: a full queue, a prompt that just fits, a block-size multiple
        scenarios += [(k * b, q, 30, 0, q, b), (k * b + 1, 0, k + 2, 1, q, b),
                      (k * b, 0, k + 3, 3, q, b), (k * b - 1, q - 1, k, 0, q, b)]
    want = [reference_should_admit(*s) for s in scenarios]
    got = []
    for s in scenarios:
        answer = case.call(fn, *s)
        case.expect(isinstance(answer, bool) or type(answer).__name__ == "bool_",
                    f"return True (admit) or False (shed), got {answer!r} for {s}.")
        got.append(bool(answer))
    if got == want:
        return
    case.inputs = []  # the message is about all the scenarios, not the last call
    for slip, message in _ADMIT_SLIPS:
        guess = [slip(*s) for s in scenarios]
        if guess == got and guess != want:
            raise _Difference(message)
    i = next(j for j in range(len(want)) if got[j] != want[j])
    p, w, f, r, _, _ = scenarios[i]
    raise _Difference(
        f"for prompt_len={p}, num_waiting={w}, num_free_blocks={f}, reserved_blocks={r}, "
        f"max_queue_len={q}, block_size={b} you {'admit' if got[i] else 'shed'}; expected "
        f"{'admit' if want[i] else 'shed'} (the prompt needs {-(-p // b)} blocks, "
        f"{f - r} are left for it).")
