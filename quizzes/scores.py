"""What the grader reports: one ``Row`` per submission × exercise, ``scores.csv``, a
feedback file per submission and the summary printed at the end.

``Row.status`` is one of: pass, partial, fail, not implemented, missing, error, timeout
(the exercise's own cells), unreadable, unmatched (the whole file). A file that could not
be graded is a row too, never a crash.
"""

from __future__ import annotations

import csv
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

__all__ = ["CSV_FIELDS", "Row", "Outcome", "write_scores", "write_feedback", "summary"]

CSV_FIELDS = ["student", "submission", "notebook", "exercise", "points", "max_points", "status", "detail"]


@dataclass
class Row:
    student: str
    submission: str
    notebook: str
    exercise: str
    points: float
    max_points: float
    status: str  # pass | partial | fail | not implemented | missing | error | timeout | unreadable | unmatched
    detail: str = ""


@dataclass
class Outcome:
    """What happened to one submission."""

    rows: list[Row]
    graded: object | None = None  # the executed notebook
    passes: int = 0
    notes: list[str] = field(default_factory=list)


def write_scores(rows: list[Row], path: Path) -> None:
    """``scores.csv``: one line per row, columns ``CSV_FIELDS``."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


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
    total = sum(r.points for r in outcome.rows)
    most = sum(r.max_points for r in outcome.rows)
    lines.append(f"score: {total:g} / {most:g}")
    for r in outcome.rows:
        lines.append(f"- {r.exercise}: {r.points:g}/{r.max_points:g} {r.status}" + (f" — {r.detail}" if r.detail else ""))
    lines += [f"  note: {n}" for n in outcome.notes]
    (dest / f"{stem}.feedback.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def summary(rows: list[Row]) -> str:
    by_sub: dict[str, list[Row]] = {}
    for r in rows:
        by_sub.setdefault(r.submission, []).append(r)
    width = max([len(s) for s in by_sub] + [10])
    out = [f"{'submission':<{width}}  {'notebook':<16} {'score':>9}  exercises"]
    mark = {"pass": "✓", "partial": "½", "timeout": "⏱"}
    for sub, rs in by_sub.items():
        if rs[0].status in ("unreadable", "unmatched"):
            out.append(f"{sub:<{width}}  {rs[0].notebook:<16} {'-':>9}  {rs[0].status}: {rs[0].detail[:80]}")
            continue
        score = f"{sum(r.points for r in rs):g}/{sum(r.max_points for r in rs):g}"
        parts = [f"{r.exercise} {mark.get(r.status, '✗')}" + ("" if r.status == "pass" else f" ({r.status})")
                 for r in rs]
        out.append(f"{sub:<{width}}  {rs[0].notebook:<16} {score:>9}  " + ", ".join(parts))
    return "\n".join(out)
