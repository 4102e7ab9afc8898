"""Generate the student notebooks ``labs/NN-topic.ipynb`` from ``solutions/``.

    python -m quizzes.release             # write labs/ (what `make labs` runs)
    python -m quizzes.release --check     # exit 1 if labs/ is out of date

Rules (see the guide in ``quizzes/__init__.py``):
- Lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` become the block's
  ``# HINT:`` lines plus ``raise NotImplementedError("<hint>")`` at the marker's
  indentation. Only ``exercise:<id>`` cells may hold such blocks.
- Outputs and execution counts are cleared; cell metadata keeps only ``tags``
  (check cells also get ``editable``/``deletable`` false, exercise cells
  ``deletable`` false); notebook metadata is replaced by a fixed kernelspec
  (``python3``) and a note naming the source; ``# NBVAL_`` comment lines go.
- ``solution-only`` cells are dropped.
- In a cell tagged ``predict:<id>``, each ``quizzes.predict("<bank>.<id>", <reference>)``
  becomes ``quizzes.predict("<bank>.<id>", "")``: the student types the prediction between
  the quotes. Such a cell holds only those calls (plus imports and comments), each for a
  ``Numeric(predict=True)`` of the bank, one per ``predict:`` tag.

Invariants: the output depends only on the source notebook (same bytes on every
run); no marker and no solution line reaches a lab (checked, ReleaseError
otherwise); every exercise has exactly one exercise cell and at least one check.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
HINT = re.compile(r"^\s*#\s*HINT:\s?(.*)$")
NBVAL_COMMENT = re.compile(r"^\s*#\s*NBVAL_[A-Z_]+\s*$")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
NAME = re.compile(r"^\d\d-[A-Za-z0-9_-]+\.ipynb$")
_TAG_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
_CELL_ID = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")


class ReleaseError(ValueError):
    """A solution notebook breaks an authoring rule; the message says where and how."""


# ----------------------------------------------------------------------- tags


def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []) or [])


def tag_value(cell, kind: str) -> str | None:
    """The <id> of a ``kind:<id>`` tag (kind is exercise, check, quiz or points), or None."""
    for t in tags(cell):
        if t.startswith(kind + ":"):
            return t.split(":", 1)[1].strip()
    return None


@dataclass
class Layout:
    """Where the exercises and checks of a notebook are (cell indices)."""

    exercise_cell: dict[str, int] = field(default_factory=dict)
    check_cells: dict[str, list[int]] = field(default_factory=dict)
    points: dict[str, float] = field(default_factory=dict)
    predict_cell: dict[str, int] = field(default_factory=dict)  # local question id -> its predict: cell

    @property
    def exercises(self) -> list[str]:
        return list(self.exercise_cell)


def layout(nb, where: str = "notebook") -> Layout:
    """Find exercise/check cells and validate the tagging rules."""
    out = Layout()
    for i, cell in enumerate(nb.cells):
        ex, ck = tag_value(cell, "exercise"), tag_value(cell, "check")
        for kind, val in (("exercise", ex), ("check", ck), ("quiz", tag_value(cell, "quiz"))):
            if val is not None and not _TAG_ID.match(val):
                raise ReleaseError(f"{where}, cell {i}: tag '{kind}:{val}' — ids may use letters, digits, _ . -")
        for pid in predict_tags(cell):
            if not _TAG_ID.match(pid) or cell.cell_type != "code":
                raise ReleaseError(f"{where}, cell {i}: tag 'predict:{pid}' belongs on a code cell, and its id "
                                   "may use letters, digits, _ . -")
            if pid in out.predict_cell:
                raise ReleaseError(f"{where}: predict:{pid} is tagged on cells {out.predict_cell[pid]} and {i}; "
                                   "ask each prediction once")
            if ex is not None or ck is not None:
                raise ReleaseError(f"{where}, cell {i}: a predict:{pid} cell cannot also be an exercise or a check")
            out.predict_cell[pid] = i
        if ex is not None and ck is not None:
            raise ReleaseError(f"{where}, cell {i}: a cell is either exercise:{ex} or check:{ck}, not both")
        if (ex is not None or ck is not None) and cell.cell_type != "code":
            raise ReleaseError(f"{where}, cell {i}: exercise/check tags belong on code cells")
        if ex is not None:
            if ex in out.exercise_cell:
                raise ReleaseError(f"{where}: exercise '{ex}' is tagged on cells {out.exercise_cell[ex]} and {i}; "
                                   "keep one cell per exercise")
            out.exercise_cell[ex] = i
            pts = tag_value(cell, "points")
            try:
                out.points[ex] = float(pts) if pts is not None else 1.0
            except ValueError:
                raise ReleaseError(f"{where}, cell {i}: tag 'points:{pts}' must be a number") from None
        if ck is not None:
            out.check_cells.setdefault(ck, []).append(i)
    for ck, cells in out.check_cells.items():
        if ck not in out.exercise_cell:
            raise ReleaseError(f"{where}: check cell(s) {cells} are tagged check:{ck}, but no cell is tagged exercise:{ck}")
    for ex, i in out.exercise_cell.items():
        if ex not in out.check_cells:
            raise ReleaseError(f"{where}: exercise '{ex}' (cell {i}) has no cell tagged check:{ex}")
        if out.check_cells[ex][0] < i:
            raise ReleaseError(f"{where}: a check:{ex} cell comes before its exercise cell {i}")
    return out


def predict_tags(cell) -> list[str]:
    """The <id>s of all ``predict:<id>`` tags of a cell."""
    return [t.split(":", 1)[1].strip() for t in tags(cell) if t.startswith("predict:")]


# ----------------------------------------------------------------------- prediction cells


def _is_predict_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "predict"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "quizzes")


def blank_predictions(source: str, ids: list[str], where: str) -> str:
    """``quizzes.predict(qid, <reference>)`` -> ``quizzes.predict(qid, "")`` in a predict: cell."""
    rule = ("a predict: cell holds only quizzes.predict(\"<bank>.<id>\", <reference>) calls (plus imports and "
            "comments): compute the reference inside the call, from earlier cells' variables, so that the lab "
            "gets quizzes.predict(qid, \"\") and nothing that gives the answer away")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ReleaseError(f"{where}: {rule} (this one is not plain Python: {exc.msg}, line {exc.lineno})") from None
    spans: list[tuple[int, int, int, int]] = []
    seen: list[str] = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if not (isinstance(stmt, ast.Expr) and _is_predict_call(stmt.value)):
            raise ReleaseError(f"{where}, line {stmt.lineno}: {rule}")
        call = stmt.value
        qid = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else None
        if not isinstance(qid, str) or "." not in qid:
            raise ReleaseError(f"{where}, line {stmt.lineno}: the first argument of quizzes.predict must be the "
                               "question id as a string literal, e.g. \"lab01.q15\"")
        ref = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "answer"), None)
        if ref is None:
            raise ReleaseError(f"{where}, line {stmt.lineno}: give quizzes.predict({qid!r}, ...) the reference "
                               "prediction as its second argument (the lab gets \"\" there)")
        _check_prediction(qid, where)
        seen.append(qid.split(".", 1)[1])
        spans.append((ref.lineno, ref.col_offset, ref.end_lineno, ref.end_col_offset))
    if sorted(seen) != sorted(ids):
        raise ReleaseError(f"{where}: the cell is tagged {', '.join('predict:' + i for i in ids)} but predicts "
                           f"{', '.join(seen) or 'nothing'}: one quizzes.predict call per predict: tag")
    lines = [ln.encode("utf-8") for ln in source.split("\n")]  # ast offsets count UTF-8 bytes
    for l0, c0, l1, c1 in sorted(spans, reverse=True):
        head, tail = lines[l0 - 1][:c0], lines[l1 - 1][c1:]
        lines[l0 - 1: l1] = [head + b'""' + tail]
    return "\n".join(ln.decode("utf-8") for ln in lines)


def _check_prediction(qid: str, where: str) -> None:
    from .questions import Numeric, get_question

    try:
        _, q = get_question(qid)
    except (KeyError, ValueError, TypeError) as exc:
        raise ReleaseError(f"{where}: quizzes.predict({qid!r}): {exc}") from None
    if not (isinstance(q, Numeric) and q.predict):
        raise ReleaseError(f"{where}: {qid} is not written as a prediction: make it Numeric(..., predict=True, "
                           "needs=(...)) in its bank")


# ----------------------------------------------------------------------- solution blocks


def strip_solutions(source: str, where: str) -> tuple[str, list[str], int]:
    """Replace each solution block by its hints and a NotImplementedError stub.

    Returns (new source, the removed solution lines, number of blocks)."""
    out: list[str] = []
    removed: list[str] = []
    blocks = 0
    block: list[str] | None = None
    indent = ""
    for lineno, line in enumerate(source.splitlines(), 1):
        s = line.strip()
        if s.startswith(BEGIN):
            if block is not None:
                raise ReleaseError(f"{where}, line {lineno}: '{BEGIN}' inside another solution block")
            block, indent = [], line[: len(line) - len(line.lstrip())]
            continue
        if s.startswith(END):
            if block is None:
                raise ReleaseError(f"{where}, line {lineno}: '{END}' without a matching '{BEGIN}'")
            hints = [m.group(1).strip() for m in (HINT.match(b) for b in block) if m]
            out.extend(f"{indent}# HINT: {h}" for h in hints)
            message = json.dumps(" ".join(hints), ensure_ascii=False) if hints else ""
            out.append(f"{indent}raise NotImplementedError({message})")
            removed.extend(b for b in block if not HINT.match(b))
            block, blocks = None, blocks + 1
            continue
        if block is not None:
            block.append(line)
        elif not NBVAL_COMMENT.match(line):
            out.append(line)
    if block is not None:
        raise ReleaseError(f"{where}: '{BEGIN}' is never closed by '{END}'")
    return "\n".join(out), removed, blocks


def _significant(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith("#") and s not in ("pass", "...", "return", ")", "]", "}")


# ----------------------------------------------------------------------- one notebook


def build_lab(solution, name: str):
    """Return the student notebook (a NotebookNode) for a solution notebook."""
    where = f"solutions/{name}"
    lay = layout(solution, where)
    cells = []
    leaked_candidates: list[tuple[int, str]] = []
    seen_ids: set[str] = set()
    for i, cell in enumerate(solution.cells):
        ctags = tags(cell)
        if "solution-only" in ctags:
            continue
        src = cell.source
        if cell.cell_type == "code":
            new_src, removed, blocks = strip_solutions(src, f"{where}, cell {i}")
            if blocks and tag_value(cell, "exercise") is None:
                raise ReleaseError(f"{where}, cell {i}: solution blocks are only allowed in cells tagged "
                                   "exercise:<id> (the grader carries only those over)")
            if tag_value(cell, "exercise") is not None and not blocks:
                raise ReleaseError(f"{where}, cell {i}: exercise:{tag_value(cell, 'exercise')} has no "
                                   f"'{BEGIN}' ... '{END}' block")
            if predict_tags(cell):
                new_src = blank_predictions(new_src, predict_tags(cell), f"{where}, cell {i}")
            outside = {ln.strip() for ln in new_src.splitlines()}
            leaked_candidates += [(i, ln) for ln in removed if _significant(ln) and ln.strip() not in outside]
            src = new_src
        elif BEGIN in src or END in src:
            raise ReleaseError(f"{where}, cell {i}: solution markers are only allowed in code cells")
        meta: dict = {}
        if ctags:
            meta["tags"] = ctags
        if tag_value(cell, "check") is not None:
            meta["editable"], meta["deletable"] = False, False
        if tag_value(cell, "exercise") is not None:
            meta["deletable"] = False
        cid = cell.get("id")
        if not (isinstance(cid, str) and _CELL_ID.match(cid)) or cid in seen_ids:
            cid = f"{Path(name).stem[:40]}-cell-{i}"
        seen_ids.add(cid)
        if cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(source=src, metadata=meta, id=cid)
        elif cell.cell_type == "markdown":
            new = nbformat.v4.new_markdown_cell(source=src, metadata=meta, id=cid)
            if cell.get("attachments"):
                new["attachments"] = cell["attachments"]
        else:
            new = nbformat.v4.new_raw_cell(source=src, metadata=meta, id=cid)
        cells.append(new)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.nbformat, nb.nbformat_minor = 4, 5
    nb.metadata = {
        "kernelspec": dict(KERNELSPEC),
        "language_info": {"name": "python"},
        "minillm": {"generated_from": f"solutions/{name}",
                    "note": "Generated by `make labs`; edit the solution notebook, not this file."},
    }
    _assert_no_solutions(nb, leaked_candidates, where)
    layout(nb, f"labs/{name}")  # the lab keeps the same structure
    return nb


def _assert_no_solutions(nb, candidates: list[tuple[int, str]], where: str) -> None:
    text = render(nb)
    for marker in (BEGIN, END):
        if marker in text:
            raise ReleaseError(f"{where}: '{marker}' would reach the lab")
    lines = {ln.strip() for c in nb.cells for ln in c.source.splitlines()}
    for i, line in candidates:
        if line.strip() in lines:
            raise ReleaseError(f"{where}, cell {i}: solution line {line.strip()!r} would appear in the lab "
                               "(it is also written elsewhere; change one of them)")


def render(nb) -> str:
    """Serialize deterministically: nbformat's JSON (sorted keys, indent 1) plus a newline."""
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


# ----------------------------------------------------------------------- the command


def solution_files(solutions_dir: Path, names: list[str] | None = None) -> list[Path]:
    files = sorted(p for p in solutions_dir.glob("*.ipynb") if NAME.match(p.name))
    if names:
        wanted = {n if n.endswith(".ipynb") else n + ".ipynb" for n in names}
        files = [p for p in files if p.name in wanted or p.stem.split("-")[0] in names]
    return files


def release(solutions_dir: Path, labs_dir: Path, check: bool = False, names: list[str] | None = None,
            log=print) -> int:
    """Write (or, with check=True, compare) every lab. Returns a process exit code."""
    sources = solution_files(solutions_dir, names)
    problems: list[str] = []
    if not names and solutions_dir.exists():
        for odd in sorted(p for p in solutions_dir.glob("*.ipynb") if not NAME.match(p.name)):
            problems.append(f"warning: {odd} ignored: solution notebooks are named like 01-topic.ipynb")
    for src in sources:
        try:
            nb = nbformat.read(src, as_version=4)
            text = render(build_lab(nb, src.name))
        except ReleaseError as exc:
            problems.append(f"error: {exc}")
            continue
        except Exception as exc:  # unreadable JSON and the like
            problems.append(f"error: solutions/{src.name}: cannot read it ({type(exc).__name__}: {exc})")
            continue
        dest = labs_dir / src.name
        current = dest.read_text(encoding="utf-8") if dest.exists() else None
        if current == text:
            log(f"up to date  {dest}")
        elif check:
            problems.append(f"out of date: {dest} (run `make labs` and commit the result)")
        else:
            labs_dir.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8")
            log(f"wrote       {dest}")
    if not names:
        known = {p.name for p in sources}
        for extra in sorted(labs_dir.glob("*.ipynb")) if labs_dir.exists() else []:
            if extra.name not in known:
                problems.append(f"{'stale' if check else 'warning: stale'}: {extra} has no source in {solutions_dir}/"
                                + ("" if check else " (delete it)"))
    for p in problems:
        log(p)
    errors = [p for p in problems if not p.startswith("warning")]
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quizzes.release", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="only these notebooks (e.g. 02 or 02-kv-cache)")
    ap.add_argument("--solutions", type=Path, default=Path("solutions"))
    ap.add_argument("--labs", type=Path, default=Path("labs"))
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if labs/ is out of date")
    args = ap.parse_args(argv)
    return release(args.solutions, args.labs, check=args.check, names=args.names or None)


if __name__ == "__main__":
    sys.exit(main())
