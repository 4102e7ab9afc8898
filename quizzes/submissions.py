"""The submissions side of grading: which notebooks were handed in, which release notebook
each one answers, whose it is, and the notebook that is actually run.

The notebook that runs is always a fresh copy of the release notebook with ONLY the
student's ``exercise:<id>`` cells carried over (found by tag, else by cell id), so a
student who edits or deletes a check cell changes nothing: the release's checks run.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from .release import Layout, tag_value

__all__ = ["find_submissions", "match_release", "student_name", "student_exercises", "assemble"]


def find_submissions(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def match_release(path: Path, releases: dict[str, Path]) -> Path | None:
    name = path.name.lower()
    hits = [stem for stem in releases if stem.lower() in name]
    if hits:
        return releases[max(hits, key=len)]
    m = re.search(r"(?<!\d)(\d\d)-", path.name)
    if m:
        same = [stem for stem in releases if stem.startswith(m.group(1) + "-")]
        if len(same) == 1:
            return releases[same[0]]
    return None


def student_name(path: Path, root: Path, release_stem: str | None) -> str:
    rel = path.relative_to(root)
    if len(rel.parts) > 1:
        return "/".join(rel.parts[:-1])
    stem = path.stem
    if release_stem:
        rest = re.sub(re.escape(release_stem), "", stem, flags=re.I).strip(" -_.()")
        if rest:
            return rest
    return stem


def student_exercises(student_nb, release_nb, lay: Layout) -> tuple[dict[str, str], set[str]]:
    """Source of each exercise from the student's notebook, and the ids not found."""
    found: dict[str, list[str]] = {}
    for cell in student_nb.cells:
        if cell.get("cell_type") != "code":
            continue
        ex = tag_value(cell, "exercise")
        if ex in lay.exercise_cell:
            found.setdefault(ex, []).append(cell.source)
    by_id = {c.get("id"): c for c in student_nb.cells if c.get("cell_type") == "code" and c.get("id")}
    missing: set[str] = set()
    for ex, idx in lay.exercise_cell.items():
        if ex in found:
            continue
        rid = release_nb.cells[idx].get("id")
        if rid in by_id and tag_value(by_id[rid], "check") is None:  # tag removed, cell kept
            found[ex] = [by_id[rid].source]
        else:
            missing.add(ex)
    return {ex: "\n\n".join(srcs) for ex, srcs in found.items()}, missing


def assemble(release_nb, lay: Layout, sources: dict[str, str], stubbed: set[str], blanked: set[int]):
    nb = copy.deepcopy(release_nb)
    for ex, idx in lay.exercise_cell.items():
        if ex in sources and ex not in stubbed:
            nb.cells[idx].source = sources[ex]
    for idx in blanked:
        nb.cells[idx].source = "# (the grader skipped this cell: it timed out in an earlier run)"
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb
