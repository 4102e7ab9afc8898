"""What the grader reports: one ``Row`` per submission × exercise and per submission ×
quiz question, the two CSV files, a feedback file per submission and the summary.

- ``scores.csv``: one line per submission; columns ``SCORE_FIELDS`` (who, which lab, the
  totals), then one column per exercise (its id) and one per quiz question (its full id,
  ``lab01.q15``), holding the points (empty where that lab has no such item).
- ``details.csv``: one line per row, columns ``CSV_FIELDS``: status and detail of each
  exercise and question, the first answer that was marked.

``Row.kind``: "exercise", "quiz" or "prediction". ``Row.status`` for an exercise: pass,
partial, fail, not implemented, missing, error, timeout; for a question: right, wrong,
unanswered, late (a prediction first answered after its measurement), not measured (the
graded run did not record what it needs), invalid, error; for the whole file: unreadable,
unmatched. A file that could not be graded is a row too, never a crash.
"""

from __future__ import annotations

import csv
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

__all__ = ["CSV_FIELDS", "SCORE_FIELDS", "Row", "Outcome", "write_scores", "write_details", "write_feedback",
           "summary"]

CSV_FIELDS = ["student", "submission", "notebook", "exercise", "points", "max_points", "status", "detail", "kind",
              "answer"]
SCORE_FIELDS = ["student", "submission", "notebook", "status", "total", "max_total", "exercises", "exercises_max",
                "quiz", "quiz_max"]


@dataclass
class Row:
    student: str
    submission: str
    notebook: str
    exercise: str
    points: float
    max_points: float
    status: str  # see the module docstring
    detail: str = ""
    kind: str = "exercise"  # exercise | quiz | prediction
    answer: str = ""  # for a question: the first answer, as typed

    @property
    def is_question(self) -> bool:
        return self.kind in ("quiz", "prediction")


@dataclass
class Outcome:
    """What happened to one submission."""

    rows: list[Row]
    graded: object | None = None  # the executed notebook
    passes: int = 0
    notes: list[str] = field(default_factory=list)
    answers: dict = field(default_factory=dict)  # qid -> the kept entry that was marked (quizzes.kept)
    key: str = ""  # "<student>|<notebook>": where the grader's ledger keeps its first answers


def write_details(rows: list[Row], path: Path) -> None:
    """``details.csv``: one line per row, columns ``CSV_FIELDS``."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def _g(x: float) -> str:
    return f"{x:g}"


def write_scores(rows: list[Row], path: Path) -> None:
    """``scores.csv``: one line per submission; the totals, then a column per exercise and per question."""
    by_sub: dict[str, list[Row]] = {}
    items: list[str] = []  # exercise ids first, then question ids, in order of appearance
    for r in rows:
        by_sub.setdefault(r.submission, []).append(r)
    for r in rows:
        if not r.is_question and r.exercise != "-" and r.exercise not in items:
            items.append(r.exercise)
    for r in rows:
        if r.is_question and r.exercise not in items:
            items.append(r.exercise)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=SCORE_FIELDS + items)
        w.writeheader()
        for sub, rs in by_sub.items():
            line = {"student": rs[0].student, "submission": sub, "notebook": rs[0].notebook}
            if rs[0].status in ("unreadable", "unmatched"):
                w.writerow({**line, "status": rs[0].status})
                continue
            ex, qs = _split(rs)
            (ep, em), (qp, qm) = _points(ex), _points(qs)
            line.update(status="graded", total=_g(ep + qp), max_total=_g(em + qm),
                        exercises=_g(ep), exercises_max=_g(em), quiz=_g(qp), quiz_max=_g(qm))
            line.update({r.exercise: _g(r.points) for r in rs})
            w.writerow(line)


def _split(rows: list[Row]) -> tuple[list[Row], list[Row]]:
    """(exercise rows, quiz-question rows), each in order."""
    return [r for r in rows if not r.is_question], [r for r in rows if r.is_question]


def _points(rows: list[Row]) -> tuple[float, float]:
    """(points scored, points possible) over `rows`."""
    return sum(r.points for r in rows), sum(r.max_points for r in rows)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "submission"


def write_feedback(path: Path, root: Path, out_dir: Path, outcome: Outcome) -> None:
    if not outcome.rows:
        return
    r0 = outcome.rows[0]
    dest = out_dir / _safe(r0.student)
    dest.mkdir(parents=True, exist_ok=True)
    stem = _safe(path.stem)
    if outcome.graded is not None:
        nbformat.write(outcome.graded, dest / f"{stem}.graded.ipynb")
    lines = [f"{r0.submission} ({r0.notebook})"]
    exercises, quiz = _split(outcome.rows)
    lines.append("score: {:g} / {:g}".format(*_points(exercises)))
    for r in exercises:
        lines.append(f"- {r.exercise}: {r.points:g}/{r.max_points:g} {r.status}" + (f" — {r.detail}" if r.detail else ""))
    if quiz:
        lines.append("quiz: {:g} / {:g} (your first answer to each question)".format(
            *_points(quiz)))
        for r in quiz:
            lines.append(f"- {r.exercise}: {r.points:g}/{r.max_points:g} {r.status}" + (f" — {r.detail}" if r.detail else ""))
    lines += [f"  note: {n}" for n in outcome.notes]
    (dest / f"{stem}.feedback.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def summary(rows: list[Row]) -> str:
    by_sub: dict[str, list[Row]] = {}
    for r in rows:
        by_sub.setdefault(r.submission, []).append(r)
    width = max([len(s) for s in by_sub] + [10])
    out = [f"{'submission':<{width}}  {'notebook':<16} {'score':>9} {'quiz':>7}  exercises"]
    mark = {"pass": "✓", "partial": "½", "timeout": "⏱"}
    for sub, rs in by_sub.items():
        if rs[0].status in ("unreadable", "unmatched"):
            out.append(f"{sub:<{width}}  {rs[0].notebook:<16} {'-':>9} {'-':>7}  {rs[0].status}: {rs[0].detail[:80]}")
            continue
        ex, qs = _split(rs)
        score = "{:g}/{:g}".format(*_points(ex))
        quiz = "{:g}/{:g}".format(*_points(qs)) if qs else "-"
        parts = [f"{r.exercise} {mark.get(r.status, '✗')}" + ("" if r.status == "pass" else f" ({r.status})")
                 for r in ex]
        out.append(f"{sub:<{width}}  {rs[0].notebook:<16} {score:>9} {quiz:>7}  " + ", ".join(parts))
    return "\n".join(out)
