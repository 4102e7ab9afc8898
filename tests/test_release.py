"""The student-notebook generator (quizzes.release): stubs, hints, cleaning, determinism.

Works on tests/fixtures/00-demo.ipynb and on tiny notebooks built here; one test checks
that the repository's own labs/ is up to date with solutions/.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from quizzes.release import ReleaseError, build_lab, layout, release, render, strip_solutions

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "tests" / "fixtures" / "00-demo.ipynb"


def code(src: str, *tags: str):
    c = new_code_cell(src)
    if tags:
        c.metadata["tags"] = list(tags)
    return c


def notebook(*cells):
    nb = new_notebook(cells=list(cells))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture
def demo_lab():
    return build_lab(nbformat.read(DEMO, as_version=4), DEMO.name)


def _cell(nb, tag):
    return next(c for c in nb.cells if tag in c.metadata.get("tags", []))


# ------------------------------------------------------------------ the stubs


def test_solution_block_becomes_hint_and_stub(demo_lab):
    src = _cell(demo_lab, "exercise:softmax").source
    assert src.splitlines() == [
        "def softmax(x):",
        "    # HINT: subtract the row max before exp, then divide by the row sum.",
        '    raise NotImplementedError("subtract the row max before exp, then divide by the row sum.")',
    ]
    assert _cell(demo_lab, "exercise:greedy_pick").source.splitlines()[-1] == "    raise NotImplementedError()"


def test_stub_compiles_and_raises_with_the_hint(demo_lab):
    ns: dict = {}
    exec(_cell(demo_lab, "exercise:matvec").source, ns)
    with pytest.raises(NotImplementedError, match="one matrix-vector product"):
        ns["matvec"](None, None)


def test_no_solution_code_reaches_the_lab(demo_lab):
    text = render(demo_lab)
    for leaked in ("BEGIN SOLUTION", "END SOLUTION", "torch.exp(x - x.max", "return w @ x", "logits.argmax(dim=-1)",
                   "Instructor note"):
        assert leaked not in text


def test_outputs_metadata_and_kernel_are_clean(demo_lab):
    assert demo_lab.metadata["kernelspec"]["name"] == "python3"
    assert set(demo_lab.metadata) == {"kernelspec", "language_info", "minillm"}
    assert (demo_lab.nbformat, demo_lab.nbformat_minor) == (4, 5)
    for cell in demo_lab.cells:
        assert set(cell.metadata) <= {"tags", "editable", "deletable"}
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
            assert "NBVAL_" not in cell.source
    check = _cell(demo_lab, "check:softmax")
    assert check.metadata["editable"] is False and check.metadata["deletable"] is False
    assert _cell(demo_lab, "exercise:softmax").metadata["deletable"] is False
    assert not any("solution-only" in c.metadata.get("tags", []) for c in demo_lab.cells)


def test_cell_ids_and_tags_survive_for_the_grader(demo_lab):
    solution = nbformat.read(DEMO, as_version=4)
    assert _cell(demo_lab, "exercise:softmax").id == _cell(solution, "exercise:softmax").id
    lay = layout(demo_lab)
    assert lay.exercises == ["softmax", "matvec", "greedy_pick"]
    assert lay.points == {"softmax": 1.0, "matvec": 2.0, "greedy_pick": 1.0}
    assert [len(v) for v in lay.check_cells.values()] == [1, 1, 2]


def test_top_level_block_keeps_its_indentation():
    src = "x = 1\nfor i in range(3):\n    ### BEGIN SOLUTION\n    # HINT: add i\n    x += i\n    ### END SOLUTION\nprint(x)"
    out, removed, blocks = strip_solutions(src, "t")
    assert blocks == 1 and removed == ["    x += i"]
    assert out.splitlines()[2:4] == ["    # HINT: add i", '    raise NotImplementedError("add i")']


# ------------------------------------------------------------------ rules


@pytest.mark.parametrize("cells, message", [
    ([code("def f():\n    ### BEGIN SOLUTION\n    return 1", "exercise:f"), code("f()", "check:f")], "never closed"),
    ([code("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")], "only allowed in cells tagged exercise"),
    ([code("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "exercise:f")], "has no cell tagged check:f"),
    ([code("g()", "check:g")], "no cell is tagged exercise:g"),
    ([code("def f():\n    return 1", "exercise:f"), code("f()", "check:f")], "has no '### BEGIN SOLUTION'"),
    ([code("def f():\n    ### BEGIN SOLUTION\n    return 41 + 1\n    ### END SOLUTION\n# return 41 + 1", "exercise:f"),
      code("f()", "check:f"), code("def h():\n    return 41 + 1")], "would appear in the lab"),
    ([code("f()", "check:f"), code("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "exercise:f")],
     "comes before its exercise"),
    ([code("def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION", "exercise:f"),
      code("def f():\n    ### BEGIN SOLUTION\n    pass\n    ### END SOLUTION", "exercise:f"), code("f()", "check:f")],
     "keep one cell per exercise"),
])
def test_authoring_mistakes_are_reported(cells, message):
    with pytest.raises(ReleaseError, match=message):
        build_lab(notebook(*cells), "01-x.ipynb")


def test_markdown_cell_may_not_hold_markers():
    nb = notebook(new_markdown_cell("### BEGIN SOLUTION\nanswer\n### END SOLUTION"))
    with pytest.raises(ReleaseError, match="only allowed in code cells"):
        build_lab(nb, "01-x.ipynb")


# ------------------------------------------------------------------ the command


def test_release_is_idempotent_and_check_mode_detects_drift(tmp_path):
    sol, labs = tmp_path / "solutions", tmp_path / "labs"
    sol.mkdir()
    shutil.copy(DEMO, sol / "00-demo.ipynb")
    log: list[str] = []
    assert release(sol, labs, log=log.append) == 0
    first = (labs / "00-demo.ipynb").read_bytes()
    assert release(sol, labs, log=log.append) == 0
    assert (labs / "00-demo.ipynb").read_bytes() == first  # byte for byte
    assert release(sol, labs, check=True, log=log.append) == 0
    json.loads(first)  # valid JSON
    assert first.endswith(b"\n")

    # the solution changes -> --check fails and names the file and the fix
    nb = nbformat.read(sol / "00-demo.ipynb", as_version=4)
    nb.cells[0].source += "\n\nOne more sentence."
    nbformat.write(nb, sol / "00-demo.ipynb")
    log.clear()
    assert release(sol, labs, check=True, log=log.append) == 1
    assert any("out of date" in line and "make labs" in line for line in log)
    assert (labs / "00-demo.ipynb").read_bytes() == first  # --check writes nothing

    # a lab without a solution is stale
    assert release(sol, labs, log=log.append) == 0
    shutil.copy(labs / "00-demo.ipynb", labs / "07-orphan.ipynb")
    log.clear()
    assert release(sol, labs, check=True, log=log.append) == 1
    assert any("07-orphan" in line for line in log)


def test_unreadable_solution_is_an_error_not_a_crash(tmp_path):
    sol = tmp_path / "solutions"
    sol.mkdir()
    (sol / "03-broken.ipynb").write_text("{not json")
    log: list[str] = []
    assert release(sol, tmp_path / "labs", log=log.append) == 1
    assert any("03-broken" in line and "cannot read" in line for line in log)


def test_repository_labs_are_up_to_date():
    """labs/ must equal what `make labs` would write from solutions/."""
    proc = subprocess.run([sys.executable, "-m", "quizzes.release", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
