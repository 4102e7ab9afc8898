"""Grading Lab 10 (the capstone): untouched, solved and half-solved submissions, graded by
`python -m quizzes.grade` exactly as `make grade` does, with MINILLM_QUICK=1 (a smaller
capstone workload and a shorter load on the real server; everything else runs as usual:
the real model, the engine, the server, the checks).

Lab 10 has seven exercises: dollars_per_million, replicas_needed, kv_cache_gb,
tokens_per_pass, allreduce_seconds, claim_verdicts (1 point each) and capstone (2).
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import nbformat
import pytest

from quizzes import grade
from quizzes.release import build_lab, render

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "10-capstone.ipynb"
POINTS = {"dollars_per_million": 1.0, "replicas_needed": 1.0, "kv_cache_gb": 1.0,
          "tokens_per_pass": 1.0, "allreduce_seconds": 1.0, "claim_verdicts": 1.0, "capstone": 2.0}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Two exercises right, two with a classic slip, the rest left as stubs.
HALF = {
    "exercise:dollars_per_million": '''\
def dollars_per_million(dollars_per_hour, tokens_per_s, utilization):
    return dollars_per_hour / (tokens_per_s * 3600 * utilization) * 1e6
''',
    "exercise:replicas_needed": '''\
import math

def replicas_needed(arrival_rate, e2e_s, batch_size, seconds_per_request, max_utilization):
    return math.ceil(arrival_rate * e2e_s / batch_size)          # Little's law only
''',
    "exercise:kv_cache_gb": '''\
def kv_cache_gb(num_layers, num_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch * dtype_bytes / 1e9
''',
    "exercise:tokens_per_pass": '''\
def tokens_per_pass(alpha, k):
    return k * alpha + 1                                         # the shortcut
''',
}


def _half_solved(lab):
    nb = nbformat.from_dict(nbformat.reads(render(lab), as_version=4))
    for cell in nb.cells:
        tag = next((t for t in cell.metadata.get("tags", []) if t in HALF), None)
        if tag:
            cell.source = HALF[tag]
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("grading-lab10")
    release_dir, subs, out = root / "labs", root / "submissions", root / "out"
    release_dir.mkdir()
    lab = build_lab(nbformat.read(SOLUTION, as_version=4), SOLUTION.name)
    (release_dir / SOLUTION.name).write_text(render(lab))
    for student in ("untouched", "solved", "half"):
        (subs / student).mkdir(parents=True)
    shutil.copy(release_dir / SOLUTION.name, subs / "untouched" / SOLUTION.name)
    shutil.copy(SOLUTION, subs / "solved" / SOLUTION.name)
    nbformat.write(_half_solved(lab), subs / "half" / SOLUTION.name)

    with pytest.MonkeyPatch.context() as mp:  # the grader's kernels inherit this environment
        mp.setenv("MINILLM_QUICK", "1")
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("OMP_WAIT_POLICY", "PASSIVE")
        code = grade.main([str(subs), "--release-dir", str(release_dir), "--out", str(out),
                           "--timeout", "120", "--setup-timeout", "600", "--jobs", "2"])
    assert code == 0
    with open(out / "details.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {(r["student"], r["exercise"]): r for r in rows}, out


def _points(table, student):
    return {ex: float(table[(student, ex)]["points"]) for ex in POINTS}


def test_untouched_lab_scores_zero_and_says_not_implemented(graded):
    table, out = graded
    assert _points(table, "untouched") == dict.fromkeys(POINTS, 0.0)
    assert {table[("untouched", ex)]["status"] for ex in POINTS} == {"not implemented"}
    assert "score: 0 / 8" in (out / "untouched" / "10-capstone.feedback.txt").read_text()


def test_solved_lab_gets_full_marks_and_ran_the_server(graded):
    table, out = graded
    assert _points(table, "solved") == POINTS
    graded_nb = nbformat.read(out / "solved" / "10-capstone.graded.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in graded_nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "real server" in text and "simulator" in text  # the small-scale validation ran
    assert "✓ claim_verdicts: every verdict agrees with calc" in text
    assert "the defaults" in text  # the leaderboard


def test_half_solved_lab_scores_per_exercise_with_the_reason(graded):
    table, out = graded
    assert _points(table, "half") == {**dict.fromkeys(POINTS, 0.0), "dollars_per_million": 1.0,
                                      "kv_cache_gb": 1.0}
    assert table[("half", "replicas_needed")]["status"] == "fail"
    assert "Little's law alone" in table[("half", "replicas_needed")]["detail"]
    assert "k·α + 1 counts every guess" in table[("half", "tokens_per_pass")]["detail"]
    for ex in ("allreduce_seconds", "claim_verdicts", "capstone"):
        assert table[("half", ex)]["status"] == "not implemented"
    assert "score: 2 / 8" in (out / "half" / "10-capstone.feedback.txt").read_text()
