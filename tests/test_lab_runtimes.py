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


def _gpu_report(rows, skipped=(), mode="full", cuda="13.0"):
    return {"mode": mode, "environment": {"device": "NVIDIA H100 80GB HBM3", "cuda": cuda,
                                          "date": "2026-11-28 09:12 UTC"},
            "sections": [{"name": "decode", "rows": []},
                         {"name": "labs", "rows": rows, "skipped": list(skipped)}]}


def test_a_gpu_reports_labs_are_recorded_under_gpu_and_nothing_else_changes():
    """--from-report: a passed lab gets its quick seconds, the GPU's name (and how many labs
    shared it) and the date; a failed, boxed or cut lab is named and not recorded; the CPU
    entries and the other labs stay as they were."""
    table = {"01-roofline": {"CPU": {"seconds": 44, "device_name": "AMD EPYC", "date": "x"},
                             "GPU": None},
             "02-kv-cache": {"CPU": None, "GPU": {"seconds": 70, "quick_seconds": 9,
                                                  "device_name": "NVIDIA H100 80GB HBM3",
                                                  "date": "2026-11-28"}},
             "05-continuous-batching": {"CPU": None, "GPU": {"quick_seconds": 1}}}
    before = json.loads(json.dumps(table))
    rows = [{"lab": "01-roofline", "ok": True, "seconds": 61.4},
            {"lab": "02-kv-cache", "ok": True, "seconds": 12.6},
            {"lab": "03-attention", "ok": True, "seconds": 150.2, "alongside": 4},
            {"lab": "04-paged-attention", "ok": False, "seconds": 30.0,
             "outcome": "pytest exit 1", "error": "Cell 12: AssertionError: q7"},
            {"lab": "06-quantization", "ok": False, "seconds": 300.0,
             "outcome": "time box: still running after 300 s"}]
    lines = lab_runtimes.from_report(_gpu_report(rows, ["07-speculative-decoding (time box)"]),
                                     table)
    assert table["01-roofline"] == {"CPU": before["01-roofline"]["CPU"], "GPU": {
        "quick_seconds": 61, "device_name": "NVIDIA H100 80GB HBM3", "date": "2026-11-28"}}
    assert table["02-kv-cache"]["GPU"] == {"quick_seconds": 13, "seconds": 70, "date": "2026-11-28",
                                           "device_name": "NVIDIA H100 80GB HBM3"}
    assert table["03-attention"]["GPU"]["device_name"] == "NVIDIA H100 80GB HBM3, 5 labs at once"
    assert "04-paged-attention" not in table and "06-quantization" not in table
    assert table["05-continuous-batching"] == before["05-continuous-batching"]
    assert any(ln.startswith("04-paged-attention: not recorded (pytest exit 1: Cell 12")
               for ln in lines)
    assert "07-speculative-decoding: not recorded (time box)" in lines
    assert len(lines) == 6

    only = {}
    lab_runtimes.from_report(_gpu_report(rows), only, ["03-attention"])
    assert list(only) == ["03-attention"]


@pytest.mark.parametrize("report, match", [
    (_gpu_report([], mode="cpu-dry-run", cuda=None), "not measured on a GPU"),
    ({**_gpu_report([]), "sections": [{"name": "decode", "rows": []}]}, "no labs section")])
def test_a_report_without_gpu_labs_is_refused(report, match):
    table = {}
    with pytest.raises(ValueError, match=match):
        lab_runtimes.from_report(report, table)
    assert table == {}


def test_the_from_report_command_writes_the_table_and_refuses_a_dry_run(tmp_path, monkeypatch,
                                                                        capsys):
    runtimes = tmp_path / "lab_runtimes.json"
    runtimes.write_text(json.dumps({"09-serving": {"CPU": None, "GPU": None}}))
    monkeypatch.setattr(lab_runtimes, "RUNTIMES", runtimes)
    report = tmp_path / "labs.json"
    report.write_text(json.dumps(_gpu_report([{"lab": "09-serving", "ok": True, "seconds": 80}])))
    lab_runtimes.main(["--from-report", str(report), "09"])
    assert json.loads(runtimes.read_text())["09-serving"]["GPU"]["quick_seconds"] == 80
    assert "09-serving: 80 s with MINILLM_QUICK=1 on NVIDIA H100" in capsys.readouterr().out
    report.write_text(json.dumps(_gpu_report([], mode="cpu-dry-run", cuda=None)))
    with pytest.raises(SystemExit, match="not measured on a GPU"):
        lab_runtimes.main(["--from-report", str(report)])
