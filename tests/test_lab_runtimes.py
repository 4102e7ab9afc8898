"""benchmarks/lab_runtimes.py: which notebooks it runs, and the cell it appends to mark a
lab's predictions (run for real on a tiny notebook: the cell is removed before saving)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lab_runtimes", REPO / "benchmarks" / "lab_runtimes.py")
lab_runtimes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lab_runtimes)


def test_labs_are_chosen_by_number_or_name_and_an_unknown_one_is_named():
    assert [p.stem for p in lab_runtimes.notebooks(["09"])] == ["09-serving"]
    assert [p.stem for p in lab_runtimes.notebooks(["01-roofline", "05"])] == ["01-roofline",
                                                                               "05-continuous-batching"]
    assert len(lab_runtimes.notebooks([])) == 10
    with pytest.raises(ValueError, match=r"no solution notebook '99'"):
        lab_runtimes.notebooks(["99"])


@pytest.mark.slow
def test_execute_marks_the_kept_predictions_and_saves_without_the_mark_cell(tmp_path, monkeypatch):
    """A two-cell notebook that predicts lab09.q12 and records its measurement: execute()
    returns the mark of that prediction (and that the other one was not given), and the saved
    notebook has the two cells only."""
    monkeypatch.setenv("QUIZZES_ANSWERS", "off")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell('import quizzes\nquizzes.predict("lab09.q12", "500 ms")'),
                nbformat.v4.new_code_cell("quizzes.record(unloaded_latency_ms=550.0)")]
    path = tmp_path / "09-tiny.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "out.ipynb"
    seconds, marks = lab_runtimes.execute(path, out, timeout_s=120)
    assert seconds > 0
    assert "lab09.q12: ✓ You predicted 500 ms; your measurement gives 550 ms" in marks
    assert "lab09.q3: No answer was given." in marks
    saved = json.loads(out.read_text())
    assert len(saved["cells"]) == 2 and "Prediction kept" in json.dumps(saved["cells"][0]["outputs"])
