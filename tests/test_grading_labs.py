"""Grading a real lab: Lab 02 (the KV cache), untouched, solved and half-solved.

The three submissions are made here from solutions/02-kv-cache.ipynb and the lab built from
it, then graded by `python -m quizzes.grade` exactly as `make grade` does. The kernels run
with MINILLM_QUICK=1, which the lab reads to time generation up to 32 tokens instead of 256;
everything else (the real model, the oracle cached == uncached, the checks) runs as usual.

Lab 02 has four exercises: kv_append (1 point), cached_attention (2), kv_cache_bytes (1) and
gqa_reduction (1).
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
SOLUTION = REPO / "solutions" / "02-kv-cache.ipynb"
EXERCISES = ("kv_append", "cached_attention", "kv_cache_bytes", "gqa_reduction")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# A student who got two exercises right, one wrong (the 1/D scale) and left one as the stub.
HALF = {
    "exercise:kv_append": '''\
def kv_append(k_cache, v_cache, k_new, v_new, start_pos):
    n = k_new.shape[1]
    k_cache[:, start_pos:start_pos + n] = k_new
    v_cache[:, start_pos:start_pos + n] = v_new
''',
    "exercise:cached_attention": '''\
def cached_attention(q, k_cache, v_cache, start_pos):
    B, T, Hq, D = q.shape
    S = start_pos + T
    g = Hq // k_cache.shape[2]
    k = k_cache[:, :S].transpose(1, 2).repeat_interleave(g, dim=1)
    v = v_cache[:, :S].transpose(1, 2).repeat_interleave(g, dim=1)
    scores = q.transpose(1, 2) @ k.transpose(-1, -2) / D          # should be / sqrt(D)
    future = torch.arange(S)[None, :] > torch.arange(start_pos, S)[:, None]
    return (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(1, 2)
''',
    "exercise:gqa_reduction": '''\
def gqa_reduction(num_heads, num_kv_heads):
    return num_heads // num_kv_heads
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
    root = tmp_path_factory.mktemp("grading-labs")
    release_dir, subs, out = root / "labs", root / "submissions", root / "out"
    release_dir.mkdir()
    lab = build_lab(nbformat.read(SOLUTION, as_version=4), SOLUTION.name)
    (release_dir / SOLUTION.name).write_text(render(lab))
    for student in ("untouched", "solved", "half"):
        (subs / student).mkdir(parents=True)
    shutil.copy(release_dir / SOLUTION.name, subs / "untouched" / SOLUTION.name)
    shutil.copy(SOLUTION, subs / "solved" / SOLUTION.name)  # the solution itself, markers and all
    nbformat.write(_half_solved(lab), subs / "half" / SOLUTION.name)

    with pytest.MonkeyPatch.context() as mp:  # the grader's kernels inherit this environment
        mp.setenv("MINILLM_QUICK", "1")
        mp.setenv("OMP_NUM_THREADS", "1")  # two kernels side by side on a small machine
        mp.setenv("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: no spinning against the other kernel
        code = grade.main([str(subs), "--release-dir", str(release_dir), "--out", str(out),
                           "--timeout", "120", "--setup-timeout", "400", "--jobs", "2"])
    assert code == 0
    with open(out / "details.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {(r["student"], r["exercise"]): r for r in rows}, out


def _points(table, student):
    return {ex: float(table[(student, ex)]["points"]) for ex in EXERCISES}


def test_untouched_lab_scores_zero_and_says_not_implemented(graded):
    table, out = graded
    assert _points(table, "untouched") == dict.fromkeys(EXERCISES, 0.0)
    assert {table[("untouched", ex)]["status"] for ex in EXERCISES} == {"not implemented"}
    assert "score: 0 / 5" in (out / "untouched" / "02-kv-cache.feedback.txt").read_text()


def test_solved_lab_gets_full_marks(graded):
    table, out = graded
    assert _points(table, "solved") == {"kv_append": 1.0, "cached_attention": 2.0,
                                        "kv_cache_bytes": 1.0, "gqa_reduction": 1.0}
    graded_nb = nbformat.read(out / "solved" / "02-kv-cache.graded.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in graded_nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "same tokens with your cache as without a cache: True" in text
    assert "In the depths of the ocean" in text  # the poem the oracle cell decodes
    assert "✓ cached_attention: matches the reference on 4 random cases" in text


def test_half_solved_lab_scores_per_exercise_with_the_reason(graded):
    table, out = graded
    assert _points(table, "half") == {"kv_append": 1.0, "cached_attention": 0.0,
                                      "kv_cache_bytes": 0.0, "gqa_reduction": 1.0}
    attention = table[("half", "cached_attention")]
    assert attention["status"] == "fail"
    assert "the scores are scaled by 1/D; the scale is 1/√D" in attention["detail"]
    assert table[("half", "kv_cache_bytes")]["status"] == "not implemented"
    feedback = (out / "half" / "02-kv-cache.feedback.txt").read_text()
    assert "score: 2 / 5" in feedback
