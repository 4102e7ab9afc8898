"""ipywidgets rendering of quiz questions: ``quizzes.show("lab01")``.

Each question is a box with a prompt, an input (a text box for numeric
questions, radio buttons for choices), a Check button and a feedback line. The
general explanation appears once the answer is right, or after
``REVEAL_AFTER`` wrong tries; a choice's own explanation ("why") is part of the
feedback at once.

Answers count: the first readable answer to each question is kept for grading
(``quizzes.kept``). Under the quiz, a "kept for grading" line lists them; Check updates it in
place (its display id), so the saved notebook carries the first answers in that output's
metadata. A prediction (``Numeric(predict=True)``) that was made with ``quizzes.predict``
is not asked again: its box marks the kept first prediction against the measurement
(``PredictionWidget``); only a prediction never made gets a text box.

Stable hooks for browser tests (CSS classes on the widgets' DOM nodes):
  .quiz-question and .quiz-q-<bank>-<id>   the box of one question ("_" becomes "-")
  .quiz-prompt / .quiz-input / .quiz-choices / .quiz-check / .quiz-feedback /
  .quiz-explanation                         its parts
  .quiz-correct / .quiz-wrong               added to .quiz-feedback after a check
  .quiz-prediction                          the box of a kept prediction (its .quiz-feedback: the mark)
The Check button's description is "Check"; a kept prediction's button is "Mark".
"""

from __future__ import annotations

import html
import re
import uuid
from typing import Callable, Iterable

from . import kept
from .questions import Choice, Numeric, Result, answer, get_question, load_bank

REVEAL_AFTER = 2
#: shown with a prediction that was never made in its predict: cell
LATE_NOTE = ("(A prediction: it counts when made with quizzes.predict in the cell before the measurement; "
             "answered here after the measurement, it is marked but scores 0.)")

__all__ = ["QuestionWidget", "PredictionWidget", "build", "show", "kept_view"]


def markup(text: str) -> str:
    """Prompts and explanations are plain text with `code` and **bold**; everything else is escaped
    (so "$2.50/h" and "p < q" show as typed: no HTML, no LaTeX)."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    return out.replace("\n", "<br>")


def _css_id(qid: str) -> str:
    return "quiz-q-" + qid.replace(".", "-").replace("_", "-")


def _show_result(feedback, result: Result) -> None:
    """Put a marked result in a feedback widget: its state class, then its coloured message."""
    color = {"correct": "#137333", "wrong": "#b3261e"}.get(result.status, "#8a5300")
    state = {"correct": "quiz-correct", "wrong": "quiz-wrong"}.get(result.status, "quiz-invalid")
    # classes first and in one assignment (one sync message), then the text a test waits for
    feedback._dom_classes = tuple(c for c in feedback._dom_classes
                                  if c not in ("quiz-correct", "quiz-wrong", "quiz-invalid")) + (state,)
    feedback.value = f'<span style="color:{color}">{html.escape(result.message)}</span>'


class QuestionWidget:
    """The widgets of one question, plus ``submit(value)`` for tests and scripts."""

    def __init__(self, qid: str):
        import ipywidgets as w

        self.qid = qid
        _, q = get_question(qid)
        self.question = q
        self.tries = 0
        self.last: Result | None = None
        self.on_kept: Callable[[], None] | None = None  # called after an answer is kept (the grading line)
        number = qid.split(".", 1)[1]
        note = f" <i>{html.escape(LATE_NOTE)}</i>" if isinstance(q, Numeric) and q.predict else ""
        self.prompt = w.HTML(value=f"<b>{html.escape(number)}.</b> {markup(q.prompt)}{note}")
        self.prompt.add_class("quiz-prompt")
        if isinstance(q, Choice):
            self.input = w.RadioButtons(options=[o.text for o in q.options], value=None,
                                        layout=w.Layout(width="100%"))
            self.input.add_class("quiz-choices")
        else:
            unit = f" ({q.unit})" if q.unit else ""
            self.input = w.Text(placeholder=q.placeholder or f"your answer{unit}, e.g. 2.5{' ' + q.unit if q.unit else ''}",
                                layout=w.Layout(width="260px"))
            self.input.add_class("quiz-input")
            self.input.continuous_update = False
        self.button = w.Button(description="Check", button_style="primary", tooltip="Check your answer")
        self.button.add_class("quiz-check")
        self.feedback = w.HTML(value="")
        self.feedback.add_class("quiz-feedback")
        self.explanation = w.HTML(value="")
        self.explanation.add_class("quiz-explanation")
        self.button.on_click(lambda _b: self.submit(self.input.value))
        row = w.VBox([self.input, self.button]) if isinstance(q, Choice) else w.HBox([self.input, self.button])
        self.box = w.VBox([self.prompt, row, self.feedback, self.explanation],
                          layout=w.Layout(border="1px solid #ddd", padding="6px 10px", margin="6px 0"))
        self.box.add_class("quiz-question")
        self.box.add_class(_css_id(qid))

    def submit(self, value) -> Result:
        """Mark ``value`` and update the feedback (what the Check button does)."""
        if value is None or (isinstance(value, str) and not value.strip()):
            result = Result(self.qid, False, "invalid",
                            "Pick an option first." if isinstance(self.question, Choice) else "Type an answer first.")
        else:
            result = answer(self.qid, value)
        self.last = result
        if result.status in ("correct", "wrong"):
            self.tries += 1
            from .predictions import keep_answer

            if keep_answer(self.qid, value) is not None and self.on_kept is not None:
                self.on_kept()
        _show_result(self.feedback, result)
        explanation = result.explanation
        if explanation and (result.correct or self.tries >= REVEAL_AFTER):
            self.explanation.value = f"<i>Explanation:</i> {markup(explanation)}"
        elif explanation and result.status == "wrong":
            left = REVEAL_AFTER - self.tries
            self.explanation.value = f"<i>The explanation appears after a right answer or {left} more tr{'y' if left == 1 else 'ies'}.</i>"
        return result


class PredictionWidget:
    """A prediction made with ``quizzes.predict``: no text box; the kept first prediction is
    marked against the measurement (again by the Mark button, e.g. after measuring)."""

    def __init__(self, qid: str):
        import ipywidgets as w

        from .predictions import mark_prediction

        self.qid = qid
        _, q = get_question(qid)
        self.question = q
        self._mark = mark_prediction
        number = qid.split(".", 1)[1]
        self.prompt = w.HTML(value=f"<b>{html.escape(number)}.</b> {markup(q.prompt)}")
        self.prompt.add_class("quiz-prompt")
        self.button = w.Button(description="Mark", tooltip="Mark your first prediction against your measurement")
        self.button.add_class("quiz-check")
        self.feedback = w.HTML(value="")
        self.feedback.add_class("quiz-feedback")
        self.explanation = w.HTML(value="")
        self.explanation.add_class("quiz-explanation")
        self.button.on_click(lambda _b: self.refresh())
        self.box = w.VBox([self.prompt, self.feedback, self.button, self.explanation],
                          layout=w.Layout(border="1px solid #ddd", padding="6px 10px", margin="6px 0"))
        for cls in ("quiz-question", "quiz-prediction", _css_id(qid)):
            self.box.add_class(cls)
        self.last: Result | None = None
        self.refresh()

    def refresh(self) -> Result:
        result = self._mark(self.qid)
        self.last = result
        _show_result(self.feedback, result)
        if result.explanation and result.status in ("correct", "wrong"):
            self.explanation.value = f"<i>Explanation:</i> {markup(result.explanation)}"
        return result


def _is_kept_prediction(qid: str) -> bool:
    _, q = get_question(qid)
    return isinstance(q, Numeric) and q.predict and kept.get(qid) is not None


def kept_view(ids: list[str]):
    """The "kept for grading" line under a quiz: the first answers, in text and in output metadata."""
    from .predictions import View

    got = kept.entries(ids)
    if got:
        parts = []
        for qid, e in got.items():
            part = f"{qid.split('.', 1)[1]}: {e['first']['text']}"
            if not kept.same_answer(e["first"], e["latest"]):
                part += f" (then {e['latest']['text']})"
            parts.append(part)
        text = "Kept for grading (your first answer to each question): " + "; ".join(parts)
    else:
        text = "Your first answer to each question is kept here for grading."
    return View(text, f'<div class="quiz-kept" style="color:#555;font-size:90%">{html.escape(text)}</div>',
                kept.metadata(got))


def _resolve(spec: str | Iterable[str]) -> list[str]:
    specs = [spec] if isinstance(spec, str) else list(spec)
    ids: list[str] = []
    for s in specs:
        if "." in s:
            get_question(s)  # raises a clear KeyError if unknown
            ids.append(s)
        else:
            ids.extend(load_bank(s).ids())
    return ids


def build(spec: str | Iterable[str]) -> tuple[object, list[QuestionWidget | PredictionWidget]]:
    """Widgets for a bank ("lab01"), one question ("lab01.q3") or a list of either."""
    import ipywidgets as w

    items = [PredictionWidget(qid) if _is_kept_prediction(qid) else QuestionWidget(qid) for qid in _resolve(spec)]
    box = w.VBox([it.box for it in items])
    box.add_class("quiz")
    return box, items


def show(spec: str | Iterable[str]) -> None:
    """Display the quiz for a bank, a question, or a list of them."""
    ids = _resolve(spec)
    try:
        import ipywidgets  # noqa: F401
        from IPython.display import display
    except ImportError:  # outside Jupyter: print the questions, answer with quizzes.answer
        from .predictions import mark_prediction

        for qid in ids:
            _, q = get_question(qid)
            print(f"{qid}: {q.prompt}")
            if _is_kept_prediction(qid):
                print(f"   {mark_prediction(qid).message}")
            elif isinstance(q, Numeric) and q.predict:
                print(f"   {LATE_NOTE}")
            elif isinstance(q, Choice):
                for letter, o in zip("abcdefghij", q.options):
                    print(f"   {letter}) {o.text}")
        print("Answer with quizzes.answer(question_id, value); your first answer to each question is graded.")
        return
    box, items = build(ids)
    display(box)
    display_id = f"quiz-kept-{uuid.uuid4().hex}"
    view = kept_view(ids)
    kept.emit(view.bundle(), view.metadata, display_id=display_id)

    def refresh() -> None:
        new = kept_view(ids)
        kept.update(new.bundle(), new.metadata, display_id)

    for it in items:
        if isinstance(it, QuestionWidget):
            it.on_kept = refresh
