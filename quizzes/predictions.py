"""Answers that count: ``quizzes.predict`` before a measurement, ``quizzes.answer`` without
widgets, and the marking of a kept FIRST answer (in the notebook and by the grader).

A prediction is a ``Numeric(predict=True, needs=(...))``. In the cell tagged
``predict:<id>``, BEFORE the cell that measures and calls ``quizzes.record``::

    quizzes.predict("lab01.q15", "300 tok/s")

reads the number (units as any ``Numeric``), keeps it as the first answer (``quizzes.kept``)
and says it will be marked after the measurement; a later, different answer is shown as a
change and the first stays the one marked. With ``""`` it shows the question and what to
type. After the measurement, ``quizzes.show`` marks the kept prediction against it
(``mark_entry``): "you predicted X; your measurement gives Y: +12% off, within the 20%
allowed: right".

Invariant: the marks given here and by the grader come from the same function
(``mark_entry``), given the first answer and the measurements of the run.
"""

from __future__ import annotations

import html
from dataclasses import replace
from typing import Any, Mapping

from . import kept, questions
from .numeric_marking import Unreadable, _close, _NeedsMeasurement, read_number
from .questions import Choice, Numeric, choice_index, get_question
from .result import Result
from .units import format_quantity

__all__ = ["predict", "prediction_view", "answer", "keep_answer", "mark_entry", "mark_prediction",
           "prediction_question", "View"]


class View:
    """What a cell shows: plain text, HTML, and the output metadata saved with it."""

    def __init__(self, text: str, html_text: str, meta: Mapping | None = None):
        self.text, self.html, self.metadata = text, html_text, dict(meta or {})

    def bundle(self) -> dict[str, str]:
        return {"text/plain": self.text, "text/html": self.html}

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.bundle(), self.metadata

    def __repr__(self) -> str:
        return self.text


def prediction_question(qid: str) -> Numeric:
    _, q = get_question(qid)
    if not (isinstance(q, Numeric) and q.predict):
        raise ValueError(f"{qid} is not a prediction: quizzes.predict takes questions written as "
                         "Numeric(..., predict=True, needs=(...)); show other questions with quizzes.show")
    return q


def _measured_already(q: Numeric) -> bool:
    return bool(q.needs) and all(k in questions.measured for k in q.needs)


def _shown(q, entry_answer: Mapping) -> str:
    """A kept answer as shown: a number in the question's unit, else its text (Choice answers
    are kept with no value)."""
    value = entry_answer.get("value")
    return format_quantity(value, q.unit) if isinstance(value, (int, float)) else str(entry_answer.get("text", ""))


def _html(qid: str, prompt: str, lines: list[str], color: str = "#333") -> str:
    from .ui import markup

    body = "".join(f'<div style="color:{color}">{html.escape(ln)}</div>' for ln in lines)
    return (f'<div class="quiz-prediction"><b>{html.escape(qid)}</b> (predict before you measure): '
            f"{markup(prompt)}{body}</div>")


def prediction_view(qid: str, answer: Any = "") -> View:
    """Keep ``answer`` as the prediction (if it is the first) and say what happened."""
    q = prediction_question(qid)
    empty = answer is None or (isinstance(answer, str) and not answer.strip())
    entry = kept.get(qid)
    color = "#333"
    if empty:
        example = format_quantity(2.5, q.unit) if q.unit else "2.5"
        if entry:
            lines = [f"Your prediction is kept: {_shown(q, entry['first'])} (your first answer). It is marked "
                     f'after the measurement: quizzes.show("{qid}").']
        else:
            lines = [f'Type your prediction between the quotes, e.g. quizzes.predict("{qid}", "{example}"), '
                     f"and run this cell. Your first answer is kept and marked against your measurement "
                     f"(right within {q.rtol:.0%})."]
    else:
        try:
            value = read_number(q, answer)
        except Unreadable as exc:
            lines, color = [f"✗ {exc} Nothing was kept: fix the text between the quotes and run the cell again."], "#8a5300"
        else:
            after = _measured_already(q)
            entry, event = kept.keep(qid, "prediction", str(answer), value, after)
            first = _shown(q, entry["first"])
            if event == "first":
                lines = [f"✓ Prediction kept: {first}. It is marked against your measurement after the "
                         f'measurement cell: quizzes.show("{qid}").']
                if after:
                    lines.append("Note: this session has measured it already, so this counts as an answer given "
                                 "after the measurement, not a prediction.")
            elif event == "same":
                lines = [f"✓ Prediction kept: {first} (unchanged)."]
            else:
                lines = [f"Changed: you first predicted {first}; now {format_quantity(value, q.unit)}. Your first "
                         f"prediction, {first}, is the one marked; the change is recorded."]
                color = "#8a5300"
    text = f"{qid} (predict before you measure): {q.prompt}\n" + "\n".join(lines)
    return View(text, _html(qid, q.prompt, lines, color), kept.metadata({qid: entry}) if entry else {})


def predict(qid: str, answer: Any = "") -> None:
    """Predict a measurement before taking it: ``quizzes.predict("lab01.q15", "300 tok/s")``.

    The first answer is kept (in this kernel, next to the notebook, and in this cell's saved
    output) and marked after the measurement by ``quizzes.show``; a later different answer is
    shown as a change. With ``""``: shows the question and what to type."""
    view = prediction_view(qid, answer)
    kept.emit(view.bundle(), view.metadata)


# ----------------------------------------------------------------------- answers without widgets


def keep_answer(qid: str, value: Any) -> tuple[dict, str] | None:
    """Keep an answer given in the quiz (Check button, ``quizzes.answer``); None if unreadable."""
    _, q = get_question(qid)
    if isinstance(q, Choice):
        idx = choice_index(q, value)
        if idx is None:
            return None
        return kept.keep(qid, "answer", list(q.options)[idx].text)
    try:
        number = read_number(q, value)
    except Unreadable:
        return None
    seen = {k: questions.measured[k] for k in q.needs if k in questions.measured}
    return kept.keep(qid, "answer", str(value), number, q.predict and _measured_already(q), seen)


def answer(qid: str, value: Any, measured_values: Mapping[str, float] | None = None) -> Result:
    """Mark an answer and keep it for grading: ``quizzes.answer("lab01.q3", "26 GB")``.

    The first answer to a question is the one graded; the result, shown as the cell's output,
    carries it in its metadata (leave the call as the cell's last line)."""
    _, q = get_question(qid)
    if isinstance(q, Numeric) and q.predict and kept.get(qid):
        result = mark_prediction(qid, measured_values)
    else:
        result = questions.answer(qid, value, measured_values)
    if result.status not in ("correct", "wrong"):
        return result
    got = keep_answer(qid, value)
    if got is None:
        return result
    entry, event = got
    message = result.message
    if event == "changed" and not (isinstance(q, Numeric) and q.predict):
        message += f" (Your first answer, {_shown(q, entry['first'])}, is the one graded.)"
    return replace(result, message=message, metadata=kept.metadata({qid: entry}))


# ----------------------------------------------------------------------- marking a kept first answer


def mark_entry(qid: str, entry: Mapping | None, measured_values: Mapping[str, float] | None = None) -> Result:
    """Mark the FIRST answer of a kept entry. Predictions get "you predicted X; your measurement
    gives Y"; other questions the usual marking of ``questions.answer``."""
    _, q = get_question(qid)
    if entry is None:
        return Result(qid, False, "invalid", "No answer was given.")
    first = entry["first"]
    if not (isinstance(q, Numeric) and q.predict):
        return questions.answer(qid, first.get("text", ""), measured_values)
    try:
        target = q.expected_value(measured_values)
    except _NeedsMeasurement as exc:
        return Result(qid, False, "invalid", f"You predicted {_shown(q, first)}. Run the measurement cell "
                      f"({', '.join(exc.names)}) first; your prediction is marked then.")
    except Exception as exc:  # a bug in the bank, not the student's
        return Result(qid, False, "error", f"The answer to {qid} could not be computed ({type(exc).__name__}: {exc}). "
                      "This is a bug in the course; please report it.")
    x = first.get("value")
    if not isinstance(x, (int, float)):
        try:
            x = read_number(q, first.get("text", ""))
        except Unreadable as exc:
            return Result(qid, False, "invalid", f"Your kept prediction could not be read: {exc}")
    ok = _close(x, target, q)
    off = (x - target) / abs(target) if target else float("inf")
    shown_target = format_quantity(target, q.unit)
    msg = (f"{'✓' if ok else '✗'} You predicted {format_quantity(x, q.unit)}; your measurement gives {shown_target}: "
           f"{off:+.0%} off, {'within' if ok else 'outside'} the {q.rtol:.0%} allowed: {'right' if ok else 'wrong'}.")
    if not kept.same_answer(first, entry["latest"]):
        msg += f" (You later changed it to {_shown(q, entry['latest'])}; the first prediction is the one marked.)"
    if first.get("after_measurement"):
        msg += " (Given after the measurement, so it is not scored as a prediction.)"
    return Result(qid, ok, "correct" if ok else "wrong", msg, q.explanation, shown_target)


def mark_prediction(qid: str, measured_values: Mapping[str, float] | None = None) -> Result:
    """Mark this kernel's kept prediction against the measurements recorded in it."""
    prediction_question(qid)
    return mark_entry(qid, kept.get(qid), measured_values)
