"""The quiz side of grading: which questions a lab asks, the first answers a submission kept,
and their marks.

- The questions: every id that the release notebook's ``quizzes.show(...)`` and
  ``quizzes.predict(...)`` calls name (a bank name stands for all its questions), in order.
- The answers: the entries saved in the submission's output metadata (``quizzes.kept``),
  merged with those the grader kept from the same student's earlier submissions of the same
  lab (the ledger ``OUT/answers.json``): the earliest first answer wins, so a second
  submission cannot replace a first answer.
- The measurements: the grader appends one cell to the run (``GRADER_CELL``) that reports
  ``quizzes.measured``; predictions are marked against those, the graded run's own.
  A non-prediction question that reads measurements is marked against the values the
  student saw when answering (kept with the answer), else against the graded run's.

Each question is worth 1 point: its FIRST answer right. A prediction first answered after
its measurement was taken scores 0 ("late").
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Mapping

import nbformat

from . import kept
from .predictions import mark_entry
from .questions import Numeric, get_question
from .release import _is_predict_call, predict_tags
from .scores import Row

__all__ = ["asked_questions", "submitted_answers", "add_measured_cell", "quiz_rows", "load_ledger", "save_ledger",
           "merged_answers", "record_in_ledger", "GRADER_CELL"]

GRADER_CELL = ("# Added by the grader: what this run measured, to mark the predictions against.\n"
               "import quizzes, quizzes.kept\n"
               "quizzes.kept.publish_measured(quizzes.measured)")
LEDGER = "answers.json"


def _quiz_call_ids(node: ast.Call) -> list[str]:
    if not node.args:
        return []
    arg = node.args[0]
    items = arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
    return [a.value for a in items if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def _quiz_calls(nb, predict_cells_only: bool = False):
    """The ``quizzes.show(...)`` and ``quizzes.predict(...)`` calls in a notebook's code cells."""
    for cell in nb.cells:
        if cell.get("cell_type") != "code" or (predict_cells_only and not predict_tags(cell)):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            is_show = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "show"
                       and isinstance(node.func.value, ast.Name) and node.func.value.id == "quizzes")
            if is_show or _is_predict_call(node):
                yield node


def asked_questions(release_nb) -> list[str]:
    """Full ids of the questions the notebook shows or predicts, without repeats, in bank order
    (banks in the order the notebook first names them)."""
    from .questions import load_bank
    from .ui import _resolve

    found: list[str] = []
    for node in _quiz_calls(release_nb):
        for spec in _quiz_call_ids(node):
            try:
                found += [q for q in _resolve(spec) if q not in found]
            except Exception:  # an unknown or broken bank: the notebook's own cell reports it
                continue
    banks = list(dict.fromkeys(q.split(".", 1)[0] for q in found))
    return sorted(found, key=lambda q: (banks.index(q.split(".", 1)[0]), load_bank(q.split(".", 1)[0]).ids().index(q)))


def submitted_answers(student_nb) -> dict[str, dict]:
    """The entries kept in a submission's outputs (earliest first answer per question)."""
    return kept.records_in_notebook(student_nb)


def _unrun_prediction(student_nb, qid: str) -> str:
    """The text a never-run predict: cell holds for qid, or ""."""
    for node in _quiz_calls(student_nb, predict_cells_only=True):
        if _is_predict_call(node) and _quiz_call_ids(node) == [qid] and len(node.args) > 1:
            ref = node.args[1]
            if isinstance(ref, ast.Constant) and str(ref.value).strip():
                return str(ref.value).strip()
    return ""


def add_measured_cell(nb) -> None:
    cell = nbformat.v4.new_code_cell(GRADER_CELL, id="grader-measured")
    cell.metadata["tags"] = ["grader"]
    nb.cells.append(cell)


def quiz_rows(base: tuple[str, str, str], qids: list[str], answers: Mapping[str, dict],
              measured: Mapping[str, float] | None, student_nb=None) -> list[Row]:
    """One row per question: 1 point when its first answer is right."""
    rows = []
    for qid in qids:
        _, q = get_question(qid)
        predict = isinstance(q, Numeric) and q.predict
        kind = "prediction" if predict else "quiz"
        entry = answers.get(qid)
        if entry is None:
            unrun = _unrun_prediction(student_nb, qid) if (predict and student_nb is not None) else ""
            detail = (f"quizzes.predict holds {unrun!r}, but the cell was never run, so no first answer was kept"
                      if unrun else "no answer was kept in the notebook")
            rows.append(Row(*base, qid, 0.0, 1.0, "unanswered", detail, kind))
            continue
        first = entry["first"]
        needs = getattr(q, "needs", ())
        values: Mapping[str, float] = measured or {}
        seen = first.get("measured") or {}
        if needs and not predict and all(k in seen for k in needs):
            values = seen
        if needs and not all(k in values for k in needs):
            rows.append(Row(*base, qid, 0.0, 1.0, "not measured",
                            f"the graded run did not record {', '.join(k for k in needs if k not in values)} "
                            f"(did its measurement cell fail?); your first answer: {first['text']}", kind, first["text"]))
            continue
        result = mark_entry(qid, entry, values)
        detail = result.message
        if predict and entry.get("kind") == "answer":
            detail += " (answered in the quiz, not in the prediction cell)"
        if predict and first.get("after_measurement") and result.status in ("correct", "wrong"):
            rows.append(Row(*base, qid, 0.0, 1.0, "late", "first answered after the measurement had been taken: "
                            + detail, kind, first["text"]))
            continue
        status = {"correct": "right", "wrong": "wrong"}.get(result.status, result.status)
        rows.append(Row(*base, qid, 1.0 if result.correct else 0.0, 1.0, status, detail[:500], kind, first["text"]))
    return rows


# ----------------------------------------------------------------------- the ledger of first answers


def load_ledger(out_dir: Path) -> dict[str, dict[str, dict]]:
    """``OUT/answers.json``: "<student>|<notebook>" -> {qid: entry}, from earlier grading runs."""
    try:
        data = json.loads((out_dir / LEDGER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_in_ledger(ledger: dict, key: str, answers: Mapping[str, dict]) -> None:
    """Merge a graded submission's `answers` into `ledger[key]` question by question. Two
    submissions of one student and lab graded in one batch were each merged with the ledger
    as it was before the batch; merging again here keeps the earlier first answer whichever
    is written last."""
    earlier = ledger.get(key, {})
    ledger[key] = merged_answers(earlier, answers, sorted(set(earlier) | set(answers)))


def save_ledger(out_dir: Path, ledger: Mapping[str, Mapping[str, dict]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / LEDGER).write_text(json.dumps(ledger, indent=1, sort_keys=True), encoding="utf-8")


def merged_answers(earlier: Mapping[str, dict], submitted: Mapping[str, dict], qids: list[str]) -> dict[str, dict]:
    """{qid: one entry} for `qids` from two records of a student's answers, the earliest
    first answer of each winning (`kept.merge`)."""
    out = {}
    for qid in qids:
        entry = kept.merge(earlier.get(qid), submitted.get(qid))
        if entry is not None:
            out[qid] = entry
    return out
