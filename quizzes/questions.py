"""Quiz questions, their banks, and the marking of one answer.

A bank is a module ``quizzes/bank/<name>.py`` holding ``QUESTIONS``, a list of
``Numeric`` and ``Choice`` objects (see ``quizzes/__init__.py`` for the guide).
A question's full id is ``"<bank>.<id>"``, e.g. ``"lab01.q3"``.

``answer(qid, value) -> Result`` is the one marking function: the widget, the
tests and the grader all go through it, so a question is right or wrong the
same way everywhere.

Invariants:
- Numeric answers are computed when the answer is checked, never at import
  (they may import ``minillm.calc`` or read a measurement taken on this
  machine), so importing a bank is cheap and cannot fail on a missing module.
- Marking never raises for anything a student can type: bad input gives a
  Result with ``status="invalid"``; a broken answer function gives
  ``status="error"`` with a message naming the question.

Here: the question types, ``measured``/``record``, loading and validating banks,
``answer``/``expected`` and the marking of a Choice. Marking a Numeric (units, tolerance,
unit-slip hints) is ``numeric_marking``; the ``Result`` type is ``result``. Both are
re-exported here and import nothing from this module.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .numeric_marking import _mark_numeric, _NeedsMeasurement
from .result import Result
from .units import UnitError, parse_unit

__all__ = [
    "Numeric",
    "Choice",
    "Option",
    "Result",
    "Bank",
    "answer",
    "expected",
    "load_bank",
    "available_banks",
    "get_question",
    "measured",
    "record",
    "choice_index",
    "MAX_PREDICT_RTOL",
]

_ID = re.compile(r"^[a-z0-9_]+$")
#: The loosest tolerance a prediction may have (the issue's "20% or less").
MAX_PREDICT_RTOL = 0.2

#: Values measured on this machine by a lab's measurement cells, read by
#: ``Numeric`` answers that declare ``needs=(...)``. Fill it with ``record``.
measured: dict[str, float] = {}


def record(**values: float) -> None:
    """Store measurements (e.g. ``record(bandwidth_GBps=26.1)``) for quiz answers."""
    for key, val in values.items():
        measured[key] = float(val)


# --------------------------------------------------------------------- questions


@dataclass(frozen=True)
class Numeric:
    """A question whose answer is a number in ``unit``.

    answer: a number, or a function returning one (in ``unit``). A function may
        take no argument or one, ``measured``: the dict filled by ``record``.
    needs: names of measurements the answer reads; if one is missing the
        student is told to run the measurement cell first.
    example_measured: values for ``needs`` used by the tests of the bank.
    rtol/atol: an answer x is right when |x - answer| <= atol + rtol*|answer|.
    predict: a prediction: asked in a ``predict:<id>`` cell with ``quizzes.predict`` BEFORE
        the cell that measures ``needs``; the student's first answer is kept and marked
        against the measurement (needs a non-empty ``needs`` and ``0 < rtol <= 0.2``).
    """

    id: str
    prompt: str
    answer: float | Callable[..., float]
    unit: str = ""
    rtol: float = 0.03
    atol: float = 0.0
    explanation: str = ""
    needs: tuple[str, ...] = ()
    example_measured: Mapping[str, float] = field(default_factory=dict)
    placeholder: str = ""
    predict: bool = False

    kind = "numeric"

    def expected_value(self, measured_values: Mapping[str, float] | None = None) -> float:
        ans = self.answer
        if not callable(ans):
            return float(ans)
        values = measured if measured_values is None else measured_values
        missing = [k for k in self.needs if k not in values]
        if missing:
            raise _NeedsMeasurement(missing)
        takes_arg = bool(inspect.signature(ans).parameters)
        return float(ans(values) if takes_arg else ans())


@dataclass(frozen=True)
class Option:
    """One choice of a ``Choice`` question; ``why`` says why it is right or wrong."""

    text: str
    correct: bool = False
    why: str = ""


@dataclass(frozen=True)
class Choice:
    """A multiple-choice question with an explanation per option."""

    id: str
    prompt: str
    options: Sequence[Option]
    explanation: str = ""

    kind = "choice"


Question = Numeric | Choice


# --------------------------------------------------------------------- banks


@dataclass(frozen=True)
class Bank:
    name: str
    title: str
    questions: dict[str, Question]  # local id -> question, in bank order

    def ids(self) -> list[str]:
        return [f"{self.name}.{qid}" for qid in self.questions]


_BANKS: dict[str, Bank] = {}


def available_banks() -> list[str]:
    from . import bank as bank_pkg

    return sorted(m.name for m in pkgutil.iter_modules(bank_pkg.__path__) if not m.name.startswith("_"))


def load_bank(name: str) -> Bank:
    """Import ``quizzes.bank.<name>`` and validate its QUESTIONS (cached)."""
    if name in _BANKS:
        return _BANKS[name]
    if not _ID.match(name):
        raise KeyError(f"bad bank name {name!r}: use lowercase letters, digits and _ (e.g. 'lab01')")
    try:
        mod = importlib.import_module(f"quizzes.bank.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"quizzes.bank.{name}":
            raise
        raise KeyError(f"no quiz bank {name!r}; available: {', '.join(available_banks()) or 'none'}") from None
    questions = getattr(mod, "QUESTIONS", None)
    if not isinstance(questions, (list, tuple)) or not questions:
        raise ValueError(f"quizzes/bank/{name}.py must define a non-empty list QUESTIONS")
    table: dict[str, Question] = {}
    for q in questions:
        _validate(name, q)
        if q.id in table:
            raise ValueError(f"quiz bank {name!r}: question id {q.id!r} is used twice")
        table[q.id] = q
    bank = Bank(name, getattr(mod, "TITLE", name), table)
    _BANKS[name] = bank
    return bank


def _validate(bank: str, q: Any) -> None:
    where = f"quiz bank {bank!r}"
    if not isinstance(q, (Numeric, Choice)):
        raise TypeError(f"{where}: QUESTIONS may hold Numeric and Choice objects, not {type(q).__name__}")
    if not _ID.match(q.id):
        raise ValueError(f"{where}: question id {q.id!r} must be lowercase letters, digits and _ (e.g. 'q3')")
    if isinstance(q, Choice):
        if len(q.options) < 2 or not any(o.correct for o in q.options):
            raise ValueError(f"{where}, {q.id}: a Choice needs at least 2 options and at least one correct")
        texts = [o.text.strip().casefold() for o in q.options]
        if len(set(texts)) != len(texts):
            raise ValueError(f"{where}, {q.id}: two options have the same text")
    else:
        try:
            parse_unit(q.unit)
        except UnitError:
            raise ValueError(f"{where}, {q.id}: unknown unit {q.unit!r}") from None
        missing = [k for k in q.needs if k not in q.example_measured]
        if missing:
            raise ValueError(f"{where}, {q.id}: give example_measured values for {missing} (the tests use them)")
        if q.predict and (not q.needs or not 0 < q.rtol <= MAX_PREDICT_RTOL or q.atol):
            raise ValueError(f"{where}, {q.id}: a prediction (predict=True) is marked against a measurement: give "
                             f"needs=(...) and 0 < rtol <= {MAX_PREDICT_RTOL} with atol=0 (it has needs={q.needs}, "
                             f"rtol={q.rtol}, atol={q.atol})")


def get_question(qid: str) -> tuple[Bank, Question]:
    bank_name, _, local = qid.partition(".")
    if not local:
        raise KeyError(f"question ids look like 'lab01.q3', got {qid!r}")
    bank = load_bank(bank_name)
    if local not in bank.questions:
        raise KeyError(f"no question {local!r} in bank {bank_name!r}; it has {', '.join(bank.questions)}")
    return bank, bank.questions[local]


# --------------------------------------------------------------------- marking


def expected(qid: str, measured_values: Mapping[str, float] | None = None) -> Any:
    """The right answer: a number in the question's unit, or the correct option text."""
    _, q = get_question(qid)
    if isinstance(q, Choice):
        return next(o.text for o in q.options if o.correct)
    return q.expected_value(measured_values)


def answer(qid: str, value: Any, measured_values: Mapping[str, float] | None = None) -> Result:
    """Mark one answer. ``value`` may be text as typed ("26 GB"), a number, or
    for a Choice an option index (0-based), letter ("b") or the option text."""
    _, q = get_question(qid)
    if isinstance(q, Choice):
        return _mark_choice(qid, q, value)
    return _mark_numeric(qid, q, value, measured_values)


def choice_index(q: Choice, value: Any) -> int | None:
    """The option a value picks: an index (0-based), a letter ("b"), the option text or the Option."""
    opts = list(q.options)
    if isinstance(value, Option):
        return opts.index(value) if value in opts else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 <= value < len(opts) else None
    if isinstance(value, str):
        v = value.strip()
        letters = "abcdefghijklmnopqrstuvwxyz"[: len(opts)]
        if len(v) == 1 and v.casefold() in letters:
            return letters.index(v.casefold())
        for i, o in enumerate(opts):
            if o.text.strip().casefold() == v.casefold():
                return i
    return None


def _mark_choice(qid: str, q: Choice, value: Any) -> Result:
    idx = choice_index(q, value)
    if idx is None:
        return Result(qid, False, "invalid", "Pick one of the options first.", "")
    chosen = list(q.options)[idx]
    if chosen.correct:
        msg = "✓ Correct." + (f" {chosen.why}" if chosen.why else "")
        return Result(qid, True, "correct", msg, q.explanation, chosen.text)
    msg = "✗ Not quite." + (f" {chosen.why}" if chosen.why else " Try another option.")
    return Result(qid, False, "wrong", msg, q.explanation, "")
