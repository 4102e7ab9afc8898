"""Marking a numeric answer: read what the student typed, express it in the question's
unit, compare it with the expected value, and say why it is wrong.

A bare number is read in the question's unit; a number with a unit is converted when the
dimensions agree (bytes and GB, s and ms) and refused with a message when they do not.
An answer off by 10^3, 10^6, 10^9 (or GiB vs GB, percent vs fraction, the sign) gets a
"check your units" hint instead of "too high/too low".

Invariant: nothing a student can type raises; bad input gives ``status="invalid"``, a
broken answer function ``status="error"`` naming the question.

This module does not import ``questions`` (which imports it): it reads a question
through ``NumericQuestion``, the few attributes of ``questions.Numeric`` it needs.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Protocol

from .result import Result
from .units import (BINARY_SLIPS, DECIMAL_SLIPS, Quantity, UnitError, format_quantity,
                    parse_quantity, parse_unit)


class NumericQuestion(Protocol):
    """What marking reads from a ``questions.Numeric``."""

    unit: str
    rtol: float
    atol: float
    explanation: str

    def expected_value(self, measured_values: Mapping[str, float] | None = None) -> float: ...


class _NeedsMeasurement(Exception):
    """A Numeric's answer reads measurements (``names``) that ``quizzes.record`` has not stored yet."""

    def __init__(self, names: list[str]):
        super().__init__(", ".join(names))
        self.names = names


def _close(x: float, target: float, q: NumericQuestion) -> bool:
    return abs(x - target) <= q.atol + q.rtol * abs(target)


class Unreadable(ValueError):
    """What the student typed is not a number in a unit the question accepts; the message says why."""


def read_number(q: NumericQuestion, value: Any) -> float:
    """What the student typed, as a number in the question's unit (no target needed: predictions
    are read this way before the measurement exists). Raises ``Unreadable`` with the message to show."""
    unit_text = q.unit or "a plain number"
    example = f"{format_quantity(2.5, q.unit)}" if q.unit else "2.5"
    try:
        given = parse_quantity(value)
    except UnitError as exc:
        text = str(value).strip()
        if text and not any(c.isdigit() for c in text):
            msg = f"Please enter a number, like {example!r} or '2.5e9' — '{text}' is not one."
        elif "," in text and re.search(r"\d,\d{1,2}(\D|$)", text):
            msg = f"Use a dot for decimals: e.g. {example!r}."
        else:
            msg = f"I could not read that: {exc}. Answer in {unit_text}, e.g. {example!r}."
        raise Unreadable(msg) from None
    want_dim, factor = parse_unit(q.unit)
    x = _to_question_unit(given, want_dim, factor, value, q.unit)
    if isinstance(x, str):
        raise Unreadable(x)
    return x


def _mark_numeric(qid: str, q: NumericQuestion, value: Any, measured_values: Mapping[str, float] | None) -> Result:
    # 1. the right answer (may need this machine's measurements)
    try:
        target = q.expected_value(measured_values)
    except _NeedsMeasurement as exc:
        return Result(
            qid, False, "invalid",
            f"This question uses a value measured on your machine ({', '.join(exc.names)}): "
            "run the measurement cell above first, then check again.",
        )
    except Exception as exc:  # a bug in the bank or in minillm.calc, not the student's fault
        return Result(qid, False, "error", f"The answer to {qid} could not be computed ({type(exc).__name__}: {exc}). "
                      "This is a bug in the course; please report it.")
    # 2. the student's number, in the question's unit
    try:
        x = read_number(q, value)
    except Unreadable as exc:
        return Result(qid, False, "invalid", str(exc))
    want_dim, _ = parse_unit(q.unit)
    shown_target = format_quantity(target, q.unit)
    shown_x = format_quantity(x, q.unit)
    if _close(x, target, q):
        return Result(qid, True, "correct", f"✓ Correct: {shown_x} (expected {shown_target}).", q.explanation, shown_target)
    hint = _unit_hint(x, target, q, want_dim)
    if hint:
        return Result(qid, False, "wrong", f"✗ Check your units: {hint}", q.explanation)
    side = "too high" if x > target else "too low"
    return Result(qid, False, "wrong", f"✗ Not quite: {shown_x} is {side}.", q.explanation)


def _to_question_unit(given: Quantity, want_dim: str, factor: float, raw: Any, unit: str) -> float | str:
    """The given quantity expressed in the question's unit, or a message if incompatible."""
    if not given.unit_given:
        return given.value  # a bare number is read in the question's unit
    dim = given.dim
    if dim == want_dim:
        return given.value / factor
    if dim == "":  # "26 billion": a count, read in the question's base unit
        return given.value / factor
    if {dim, want_dim} <= {"", "x"}:
        return given.value / factor
    if dim == "%" and want_dim in ("", "x"):
        return given.value / 100.0
    if {dim, want_dim} == {"FLOP", "FLOP/s"} and "flops" in str(raw).casefold().replace("/s", ""):
        return given.value / factor  # "TFLOPS" is used for both counts and rates
    return (f"This question asks for {_unit_word(want_dim)}, but your unit is {_unit_word(dim)}. "
            f"Answer in {unit or 'a plain number'}, e.g. {format_quantity(2.5, unit)!r}.")


def _unit_word(dim: str) -> str:
    return {
        "": "no unit (a plain number)",
        "B": "bytes (B, KB, MB, GB)",
        "B/s": "bytes per second (GB/s)",
        "FLOP": "FLOPs",
        "FLOP/s": "FLOP per second (TFLOP/s)",
        "tok": "tokens",
        "tok/s": "tokens per second (tok/s)",
        "s": "time (s, ms)",
        "$": "dollars ($)",
        "%": "a percentage (%)",
        "x": "a ratio (×)",
    }.get(dim, dim)


def _unit_hint(x: float, target: float, q: NumericQuestion, want_dim: str) -> str:
    if x == 0 or target == 0:
        return ""
    for larger in (True, False):
        for factor, word in DECIMAL_SLIPS.items():
            scale = factor if larger else 1 / factor
            if _close(x / scale, target, q):
                direction = "too large" if larger else "too small"
                return (f"your {format_quantity(x)} is {word} times {direction} for an answer in {q.unit or 'plain numbers'}. "
                        f"Did you mean {format_quantity(x / scale, q.unit)}?")
    if want_dim in ("B", "B/s"):
        for r, word in BINARY_SLIPS.items():
            if _close(x * r, target, q) or _close(x / r, target, q):
                return (f"the number is off by a power of 1024/1000: {word}? This course uses "
                        f"GB = 10⁹ bytes.")
    if want_dim == "%" and _close(x * 100, target, q):
        return f"answer in percent: did you mean {format_quantity(x * 100, '%')}?"
    if want_dim in ("", "x") and _close(x / 100, target, q):
        return f"answer as a fraction, not a percentage: did you mean {format_quantity(x / 100)}?"
    if _close(-x, target, q):
        return "check the sign."
    return ""
