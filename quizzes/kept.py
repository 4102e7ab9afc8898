"""The student's answers, kept: the FIRST answer to each question, and any change after it.

A student answers in three ways: ``quizzes.predict(qid, "...")`` in a prediction cell, the
Check button of ``quizzes.show``, or ``quizzes.answer(qid, "...")``. Each goes through
``keep``, which holds one entry per question id::

    {"qid": "lab01.q15", "kind": "prediction",         # or "answer"
     "first":  {"text": "300 tok/s", "value": 300.0, "at": 1764170000.0, "after_measurement": false},
     "latest": {... the same fields: the most recent answer ...},
     "changes": 1}                                      # answers that differed from the one before

Where it is kept, so that it survives a kernel restart and reaches the grader:

1. in the kernel (``_KEPT``);
2. in a sidecar file next to the notebook, ``.<notebook stem>.answers.json`` (qid -> entry),
   when the kernel knows its notebook (Jupyter sets ``JPY_SESSION_NAME``), or in the file
   that ``QUIZZES_ANSWERS`` names (``QUIZZES_ANSWERS=off``: no file, and nothing read back
   from the notebook either: the grader's kernels, or an author re-running a solution);
3. in the notebook itself: every output that shows an answer carries the entries in its
   output metadata, ``{"minillm_quiz": {"version": 1, "answers": {qid: entry}}}``: the
   prediction cell's output, the result of ``quizzes.answer``, and the "kept for grading"
   line under a quiz (the Check button updates it in place, through its display id).
   A kernel's first ``keep`` also reads the entries back from the saved notebook, so a
   deleted sidecar does not reset a first answer.

Merging (``merge``): for one question, the entry whose first answer is the earliest gives
``first`` and ``kind``; the newest answer is ``latest``. The grader reads a submission's
outputs the same way (``records_in_notebook``), and the grader's run reports what it measured
with ``publish_measured`` (read back by ``measured_in_notebook``).

Invariants: a first answer, once kept, is never replaced (in this kernel, in the sidecar, or
in any output written afterwards); keeping never raises for an unwritable sidecar.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["META_KEY", "keep", "get", "entries", "merge", "metadata", "records_in_notebook",
           "measured_in_notebook", "publish_measured", "emit", "update", "sidecar_path", "reset"]

META_KEY = "minillm_quiz"
VERSION = 1

_KEPT: dict[str, dict] = {}
_loaded = False


# ----------------------------------------------------------------------- where


def notebook_path() -> Path | None:
    """The notebook this kernel runs, when Jupyter said so (JPY_SESSION_NAME), else None."""
    name = os.environ.get("JPY_SESSION_NAME", "")
    if not name.endswith(".ipynb"):
        return None
    path = Path(name)
    if not path.is_absolute():  # a path relative to the server root; the kernel runs in the notebook's folder
        path = Path.cwd() / path.name
    return path


def _off() -> bool:
    """QUIZZES_ANSWERS=off: keep answers in this kernel only (the grader's runs; authors' re-runs)."""
    return os.environ.get("QUIZZES_ANSWERS", "x").strip().lower() in ("", "off", "0", "none")


def sidecar_path() -> Path | None:
    env = os.environ.get("QUIZZES_ANSWERS")
    if _off():
        return None
    if env is not None:
        return Path(env)
    nb = notebook_path()
    return nb.with_name(f".{nb.stem}.answers.json") if nb else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    side = sidecar_path()
    found = _read_json(side) if side and side.exists() else None
    if isinstance(found, dict):
        for qid, entry in found.items():
            if _valid(entry):
                _KEPT[qid] = merge(_KEPT.get(qid), entry)
    nb = None if _off() else notebook_path()
    saved = _read_json(nb) if nb and nb.exists() else None
    if isinstance(saved, dict):
        for qid, entry in records_in_notebook(saved).items():
            _KEPT[qid] = merge(_KEPT.get(qid), entry)


def _save() -> None:
    side = sidecar_path()
    if side is None:
        return
    try:
        tmp = side.with_name(side.name + ".tmp")
        tmp.write_text(json.dumps(_KEPT, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(side)
    except OSError:
        pass  # a read-only folder: the kernel and the notebook's outputs still keep the answer


def reset() -> None:
    """Forget everything kept in this kernel (tests); the next ``keep`` reads the sidecar again."""
    global _loaded
    _KEPT.clear()
    _loaded = False


# ----------------------------------------------------------------------- keeping


def _valid(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("first"), dict) and isinstance(entry.get("latest"), dict)
            and isinstance(entry["first"].get("text"), str) and isinstance(entry["first"].get("at"), (int, float)))


def same_answer(a: Mapping, b: Mapping) -> bool:
    va, vb = a.get("value"), b.get("value")
    if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
        return math.isclose(va, vb, rel_tol=1e-9, abs_tol=0.0)
    return str(a.get("text", "")).strip().casefold() == str(b.get("text", "")).strip().casefold()


def keep(qid: str, kind: str, text: str, value: float | None = None, after_measurement: bool = False,
         measured: Mapping[str, float] | None = None) -> tuple[dict, str]:
    """Keep one answer. Returns (the entry, event): event is "first" (nothing was kept before),
    "same" (equal to the first answer) or "changed" (differs from the first, which stays).
    ``measured``: the measurements the answer was given against (for questions that read
    this machine's measurements, so the grader marks it against what the student saw)."""
    _load()
    attempt = {"text": str(text).strip(), "value": value, "at": time.time(), "after_measurement": bool(after_measurement)}
    if measured:
        attempt["measured"] = {k: float(v) for k, v in measured.items()}
    old = _KEPT.get(qid)
    if old is None:
        entry = {"qid": qid, "kind": kind, "first": attempt, "latest": attempt, "changes": 0}
        event = "first"
    else:
        entry = {**old, "latest": attempt}
        if not same_answer(old["latest"], attempt):
            entry["changes"] = int(old.get("changes", 0)) + 1
        event = "same" if same_answer(old["first"], attempt) else "changed"
    _KEPT[qid] = entry
    _save()
    return entry, event


def get(qid: str) -> dict | None:
    _load()
    return _KEPT.get(qid)


def entries(qids: Iterable[str]) -> dict[str, dict]:
    _load()
    return {q: _KEPT[q] for q in qids if q in _KEPT}


def merge(a: dict | None, b: dict | None) -> dict | None:
    """One entry from two records of the same question: the earliest first answer wins."""
    if a is None or b is None:
        return a if b is None else b
    early = a if a["first"]["at"] <= b["first"]["at"] else b
    latest = max(a["latest"], b["latest"], key=lambda t: t.get("at", 0))
    changes = max(int(a.get("changes", 0)), int(b.get("changes", 0)), int(not same_answer(early["first"], latest)))
    return {**early, "latest": latest, "changes": changes}


# ----------------------------------------------------------------------- the notebook's outputs


def metadata(kept_entries: Mapping[str, dict]) -> dict:
    """Output metadata that carries entries into the saved notebook."""
    return {META_KEY: {"version": VERSION, "answers": dict(kept_entries)}}


def _outputs(nb: Mapping) -> Iterable[Mapping]:
    for cell in nb.get("cells", []) or []:
        if isinstance(cell, Mapping) and cell.get("cell_type") == "code":
            for out in cell.get("outputs", []) or []:
                if isinstance(out, Mapping):
                    yield out


def records_in_notebook(nb: Mapping) -> dict[str, dict]:
    """Every entry saved in a notebook's output metadata, merged per question (earliest first wins)."""
    found: dict[str, dict] = {}
    for out in _outputs(nb):
        meta = (out.get("metadata") or {}).get(META_KEY)
        answers = meta.get("answers") if isinstance(meta, Mapping) else None
        if not isinstance(answers, Mapping):
            continue
        for qid, entry in answers.items():
            if _valid(entry):
                found[qid] = merge(found.get(qid), dict(entry))
    return found


def publish_measured(values: Mapping[str, float]) -> None:
    """Show what this run measured (the grader's last cell), in a form ``measured_in_notebook`` reads."""
    clean = {k: float(v) for k, v in values.items()}
    text = "measured in this run: " + (", ".join(f"{k} = {v:.6g}" for k, v in sorted(clean.items())) or "nothing")
    emit({"text/plain": text}, {META_KEY: {"version": VERSION, "measured": clean}})


def measured_in_notebook(nb: Mapping) -> dict[str, float] | None:
    """The values the last ``publish_measured`` output reports, or None if there is none."""
    found = None
    for out in _outputs(nb):
        meta = (out.get("metadata") or {}).get(META_KEY)
        if isinstance(meta, Mapping) and isinstance(meta.get("measured"), Mapping):
            found = {k: float(v) for k, v in meta["measured"].items()}
    return found


# ----------------------------------------------------------------------- showing


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def emit(data: Mapping[str, str], meta: Mapping | None = None, display_id: str | None = None) -> None:
    """Display a mime bundle with output metadata (IPython), or print its text (plain Python)."""
    if _shell() is None:
        print(data.get("text/plain", ""))
        return
    from IPython.display import display

    display(dict(data), raw=True, metadata=dict(meta or {}), display_id=display_id)


def update(data: Mapping[str, str], meta: Mapping | None, display_id: str) -> None:
    """Replace an earlier ``emit(..., display_id=...)`` output, e.g. from a widget's callback.
    JupyterLab applies it to the cell that showed it, and the saved notebook keeps the new
    output and its metadata. Does nothing outside a kernel."""
    shell = _shell()
    if shell is None or getattr(shell, "kernel", None) is None:
        return
    from IPython.display import display

    display(dict(data), raw=True, metadata=dict(meta or {}), display_id=display_id, update=True)
