"""Grading (quizzes.grade) on the demo notebook, and the nbval run `make test` uses.

One grading run (module fixture) covers: an untouched lab, a solved one, a half-solved
one whose checks were deleted or edited, one that hangs, a malformed file and a file
that matches no lab. The demo has three exercises worth 1 + 2 + 1 points; greedy_pick
has two check cells, so it can score half.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from quizzes import grade
from quizzes.release import build_lab, render

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "tests" / "fixtures" / "00-demo.ipynb"
SANITIZE = REPO / "tests" / "nbval_sanitize.cfg"

pytestmark = pytest.mark.timeout(600)


def _with(lab, edits: dict[str, str | None], drop_tags: tuple[str, ...] = ()):
    """A copy of the lab with cells (found by tag) replaced, or deleted when the value is None."""
    nb = nbformat.from_dict(nbformat.reads(render(lab), as_version=4))
    cells = []
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        hit = next((t for t in tags if t in edits), None)
        if hit is not None and edits[hit] is None:
            continue
        if hit is not None:
            cell.source = edits[hit]
        if any(t in drop_tags for t in tags):
            cell.metadata["tags"] = [t for t in tags if t not in drop_tags]
        cells.append(cell)
    nb.cells = cells
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("grading")
    release_dir, subs, out = root / "labs", root / "submissions", root / "out"
    release_dir.mkdir()
    lab = build_lab(nbformat.read(DEMO, as_version=4), DEMO.name)
    (release_dir / "00-demo.ipynb").write_text(render(lab))
    for student in ("untouched", "solved", "half", "hang"):
        (subs / student).mkdir(parents=True)

    shutil.copy(release_dir / "00-demo.ipynb", subs / "untouched" / "00-demo.ipynb")
    shutil.copy(DEMO, subs / "solved" / "00-demo.ipynb")  # the solution itself, markers and all
    half = _with(lab, {
        # softmax right, but its tag was lost: found again by cell id
        "exercise:softmax": "def softmax(x):\n    return torch.softmax(x, dim=-1)",
        # matvec wrong, and its check "edited" into a fake pass: the release check runs
        "exercise:matvec": "def matvec(w, x):\n    return (w @ x) * 1.01",
        "check:matvec": "print('✓ matvec: matches the reference on 3 random cases')",
        # greedy_pick returns int32: passes the plain assert, fails the dtype check -> half
        "exercise:greedy_pick": "def greedy_pick(logits):\n    return logits.argmax(dim=-1).int()",
        "check:greedy_pick": None,  # both of its check cells deleted
    }, drop_tags=("exercise:softmax",))
    nbformat.write(half, subs / "half" / "00-demo.ipynb")
    hang = _with(lab, {
        "exercise:softmax": "def softmax(x):\n    return torch.softmax(x, dim=-1)",
        "exercise:matvec": "def matvec(w, x):\n    while True:\n        pass",
        "exercise:greedy_pick": "def greedy_pick(logits)\n    return logits.argmax(-1)",  # SyntaxError
    })
    nbformat.write(hang, subs / "hang" / "00-demo.ipynb")
    (subs / "mallory-00-demo.ipynb").write_text('{"cells": [ this is not json')
    nbformat.write(nbformat.v4.new_notebook(), subs / "notes.ipynb")
    (subs / "eve-00-demo.ipynb").write_text(  # valid JSON, broken notebook: a cell without source
        '{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, '
        '"cells": [{"cell_type": "code", "metadata": {"tags": ["exercise:softmax"]}}]}')

    code = grade.main([str(subs), "--release-dir", str(release_dir), "--out", str(out),
                       "--timeout", "10", "--setup-timeout", "240", "--jobs", "2"])
    assert code == 0
    with open(out / "details.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    table = {(r["student"], r["exercise"]): r for r in rows}
    return table, out


def total(table, student):
    """The student's exercise points (quiz questions are rows of their own, kind quiz/prediction)."""
    return sum(float(r["points"]) for (s, _), r in table.items() if s == student and r["kind"] == "exercise")


def test_untouched_notebook_scores_zero_without_crashing(graded):
    table, _ = graded
    assert total(table, "untouched") == 0
    for ex in ("softmax", "matvec", "greedy_pick"):
        assert table[("untouched", ex)]["status"] == "not implemented"


def test_solved_notebook_gets_full_marks(graded):
    table, _ = graded
    assert total(table, "solved") == 4
    assert {table[("solved", ex)]["status"] for ex in ("softmax", "matvec", "greedy_pick")} == {"pass"}
    assert table[("solved", "matvec")]["max_points"] == "2.0"


def test_half_solved_with_deleted_and_edited_checks(graded):
    table, _ = graded
    assert table[("half", "softmax")]["status"] == "pass"  # found by cell id
    matvec = table[("half", "matvec")]
    assert matvec["status"] == "fail" and float(matvec["points"]) == 0
    assert "values differ from the reference" in matvec["detail"]  # the release check ran, not the fake one
    greedy = table[("half", "greedy_pick")]
    assert greedy["status"] == "partial" and float(greedy["points"]) == 0.5  # restored checks: 1 of 2 pass
    assert "dtype: expected int64, got int32" in greedy["detail"]
    assert total(table, "half") == 1.5


def test_hanging_exercise_times_out_and_the_rest_is_still_graded(graded):
    table, out = graded
    assert table[("hang", "matvec")]["status"] == "timeout" and float(table[("hang", "matvec")]["points"]) == 0
    assert table[("hang", "softmax")]["status"] == "pass"
    syntax = table[("hang", "greedy_pick")]
    assert syntax["status"] == "error" and "SyntaxError" in syntax["detail"]
    feedback = (out / "hang" / "00-demo.feedback.txt").read_text()
    assert "score: 1 / 4" in feedback and "re-running with the stub for matvec" in feedback


def test_unreadable_and_unmatched_files_are_reported(graded):
    table, _ = graded
    bad = table[("mallory", "-")]
    assert bad["status"] == "unreadable" and "not a readable notebook" in bad["detail"]
    assert table[("notes", "-")]["status"] == "unmatched"
    assert table[("eve", "-")]["status"] == "unreadable"


def test_outputs_graded_notebooks_and_feedback(graded):
    _, out = graded
    nb = nbformat.read(out / "solved" / "00-demo.graded.ipynb", as_version=4)
    texts = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "✓ softmax: matches the reference on 3 random cases" in texts
    assert (out / "untouched" / "00-demo.feedback.txt").read_text().count("not implemented") == 3


# ------------------------------------------------------------------ unit tests, no kernel


def test_match_release_and_student_names(tmp_path):
    rel = {"01-roofline": Path("labs/01-roofline.ipynb"), "02-kv-cache": Path("labs/02-kv-cache.ipynb")}
    assert grade.match_release(Path("alice/02-kv-cache.ipynb"), rel) == rel["02-kv-cache"]
    assert grade.match_release(Path("bob_02-KV-cache (1).ipynb"), rel) == rel["02-kv-cache"]
    assert grade.match_release(Path("carol-01-my-version.ipynb"), rel) == rel["01-roofline"]
    assert grade.match_release(Path("03-paged.ipynb"), rel) is None
    root = Path("/subs")
    assert grade.student_name(root / "alice" / "02-kv-cache.ipynb", root, "02-kv-cache") == "alice"
    assert grade.student_name(root / "bob_02-kv-cache.ipynb", root, "02-kv-cache") == "bob"
    assert grade.student_name(root / "02-kv-cache.ipynb", root, "02-kv-cache") == "02-kv-cache"


def test_no_release_notebooks_is_a_clear_error(tmp_path):
    (tmp_path / "labs").mkdir()
    with pytest.raises(SystemExit, match="make labs"):
        grade.grade_all(tmp_path, tmp_path / "labs", tmp_path / "out")


# ------------------------------------------------------------------ nbval, as `make test` runs it


def test_nbval_lax_with_sanitizer_masks_measurements_but_checks_deterministic_cells(tmp_path):
    shutil.copy(DEMO, tmp_path / "good.ipynb")
    nb = nbformat.read(DEMO, as_version=4)
    calc = next(c for c in nb.cells if c.get("id") == "calc")
    calc.outputs[0]["text"] = "13B parameters in fp16: 25.0 GB\n"  # a wrong saved value
    nbformat.write(nb, tmp_path / "tampered.ipynb")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nbval-lax", "--nbval-current-env",
         "--nbval-cell-timeout=300", f"--nbval-sanitize-with={SANITIZE}", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=500, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    # the measured cell (bandwidth, ms, a memory address) passes in both; only the tampered calc fails
    assert len(failed) == 1 and "tampered.ipynb" in failed[0], out[-3000:]
