"""``Result``: the outcome of marking one answer, whatever the question's kind.

Every way of answering (the widget, ``quizzes.answer``, the tests, the grader) gets one
of these back, so right and wrong look the same everywhere. ``status`` says which of the
four outcomes it is; ``message`` is what the student reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Result"]


@dataclass(frozen=True)
class Result:
    """The outcome of one answer.

    status: "correct", "wrong" (a readable answer that is not right),
    "invalid" (not a readable answer), "error" (the question itself failed).
    """

    question: str
    correct: bool
    status: str
    message: str
    explanation: str = ""
    expected: str = ""  # the right answer as text; "" when not revealed/known
    #: output metadata to save with the displayed result (``quizzes.answer`` puts the kept
    #: first answer here, see ``quizzes.kept``); not part of equality
    metadata: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return self.message

    def _repr_html_(self) -> str:
        import html

        color = "#137333" if self.correct else "#b3261e"
        out = f'<div style="color:{color}">{html.escape(self.message)}</div>'
        if self.explanation and self.correct:
            out += f"<div>{html.escape(self.explanation)}</div>"
        return out

    def _repr_mimebundle_(self, include=None, exclude=None):
        """Text and HTML, plus ``metadata`` saved in the notebook with the output."""
        data = {"text/plain": self.message, "text/html": self._repr_html_()}
        return (data, self.metadata) if self.metadata else data
