"""Predictions that count: ``quizzes.predict`` keeps the first answer (in the kernel, in a
sidecar file, in the notebook's output metadata), shows a later change as a change, and
``quizzes.show`` marks the kept prediction against the measurement; the release blanks the
reference prediction; the grader scores every quiz question from the FIRST answers kept in
the submission and in its ledger; and every lab asks at least two predictions, each before
the cell that records what it predicts.

The demo bank's q4 (``quizzes/bank/demo.py``) is the prediction these tests use; it predicts
``copy_big_ms``, measured in tests/fixtures/00-demo.ipynb.
"""

from __future__ import annotations

import ast
import csv
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

import quizzes
from quizzes import kept, predictions, questions
from quizzes.release import ReleaseError, build_lab, layout, predict_tags, render

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "tests" / "fixtures" / "00-demo.ipynb"
LABS = sorted(p for p in (REPO / "solutions").glob("*.ipynb") if re.match(r"^\d\d-", p.name))


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A new kernel's state: nothing kept, nothing measured, the sidecar in tmp_path."""
    side = tmp_path / "answers.json"
    monkeypatch.setenv("QUIZZES_ANSWERS", str(side))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setattr(questions, "measured", {})
    kept.reset()
    yield side
    kept.reset()


def _first(qid: str) -> str:
    return kept.get(qid)["first"]["text"]


# ------------------------------------------------------------------ predict: keep, change, mark


def test_empty_prediction_shows_the_question_and_keeps_nothing(fresh):
    view = predictions.prediction_view("demo.q4", "")
    assert "Type your prediction between the quotes" in view.text and "right within 20%" in view.text
    assert view.metadata == {} and kept.get("demo.q4") is None


def test_first_prediction_is_kept_and_a_later_one_is_a_change(fresh):
    view = predictions.prediction_view("demo.q4", "2 ms")
    assert "✓ Prediction kept: 2 ms" in view.text and 'quizzes.show("demo.q4")' in view.text
    record = view.metadata[kept.META_KEY]["answers"]["demo.q4"]
    assert record["kind"] == "prediction" and record["first"]["value"] == 2.0
    assert "unchanged" in predictions.prediction_view("demo.q4", "0.002 s").text  # the same number
    changed = predictions.prediction_view("demo.q4", "3 ms")
    assert "Changed: you first predicted 2 ms; now 3 ms" in changed.text and "first prediction, 2 ms" in changed.text
    entry = changed.metadata[kept.META_KEY]["answers"]["demo.q4"]
    assert entry["first"]["text"] == "2 ms" and entry["latest"]["text"] == "3 ms" and entry["changes"] == 1
    assert json.loads(fresh.read_text())["demo.q4"]["first"]["text"] == "2 ms"  # the sidecar


def test_unreadable_prediction_is_not_kept(fresh):
    view = predictions.prediction_view("demo.q4", "fast")
    assert "Please enter a number" in view.text and "Nothing was kept" in view.text
    assert kept.get("demo.q4") is None
    assert "asks for time" in predictions.prediction_view("demo.q4", "3 GB").text


def test_predict_only_takes_predictions(fresh):
    with pytest.raises(ValueError, match="not a prediction"):
        quizzes.predict("demo.q1", "26 GB")


def test_predict_prints_without_ipython(fresh, capsys):
    quizzes.predict("demo.q4", "4 ms")
    assert "✓ Prediction kept: 4 ms" in capsys.readouterr().out


def test_first_prediction_survives_a_kernel_restart(fresh):
    predictions.prediction_view("demo.q4", "2 ms")
    kept.reset()  # a new kernel: only the sidecar remembers
    assert "Your prediction is kept: 2 ms" in predictions.prediction_view("demo.q4", "").text
    assert "you first predicted 2 ms; now 5 ms" in predictions.prediction_view("demo.q4", "5 ms").text


def test_first_prediction_is_read_back_from_the_saved_notebook(fresh, tmp_path, monkeypatch):
    view = predictions.prediction_view("demo.q4", "2 ms")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("quizzes.predict('demo.q4', '2 ms')", outputs=[
        nbformat.v4.new_output("display_data", data=view.bundle(), metadata=view.metadata)])])
    path = tmp_path / "01-lab.ipynb"
    nbformat.write(nb, path)
    monkeypatch.delenv("QUIZZES_ANSWERS")
    monkeypatch.setenv("JPY_SESSION_NAME", str(path))  # what Jupyter tells the kernel
    kept.reset()
    assert kept.sidecar_path() == tmp_path / ".01-lab.answers.json" and not kept.sidecar_path().exists()
    assert _first("demo.q4") == "2 ms"  # from the notebook's output metadata alone


def test_kept_prediction_is_marked_against_the_measurement(fresh):
    predictions.prediction_view("demo.q4", "2 ms")
    waiting = predictions.mark_prediction("demo.q4")
    assert waiting.status == "invalid" and "Run the measurement cell (copy_big_ms) first" in waiting.message
    right = predictions.mark_prediction("demo.q4", {"copy_big_ms": 2.2})
    assert right.correct and right.message == ("✓ You predicted 2 ms; your measurement gives 2.2 ms: -9% off, "
                                               "within the 20% allowed: right.")
    quizzes.record(copy_big_ms=3.0)  # what the measurement cell does
    wrong = predictions.mark_prediction("demo.q4")
    assert not wrong.correct and "-33% off, outside the 20% allowed: wrong" in wrong.message
    predictions.prediction_view("demo.q4", "3 ms")  # a change after the measurement does not count
    again = predictions.mark_prediction("demo.q4")
    assert not again.correct and "You later changed it to 3 ms; the first prediction is the one marked" in again.message


def test_a_prediction_made_after_the_measurement_says_so(fresh):
    quizzes.record(copy_big_ms=2.0)
    view = predictions.prediction_view("demo.q4", "2 ms")
    assert "counts as an answer given after the measurement" in view.text
    assert kept.get("demo.q4")["first"]["after_measurement"] is True


def test_show_marks_the_kept_prediction_instead_of_asking(fresh):
    pytest.importorskip("ipywidgets")
    from quizzes import ui

    _, items = ui.build("demo")
    assert isinstance(items[3], ui.QuestionWidget)  # nothing predicted: a text box
    predictions.prediction_view("demo.q4", "2 ms")
    quizzes.record(copy_big_ms=2.1)
    _, items = ui.build("demo")
    q4 = items[3]
    assert isinstance(q4, ui.PredictionWidget) and not hasattr(q4, "input")
    assert "quiz-prediction" in q4.box._dom_classes and "quiz-correct" in q4.feedback._dom_classes
    assert "You predicted 2 ms; your measurement gives 2.1 ms" in q4.feedback.value
    assert "time ≈ 2 × bytes ÷ bandwidth" in q4.explanation.value


def test_show_without_widgets_prints_the_mark(fresh, monkeypatch, capsys):
    from quizzes import ui

    predictions.prediction_view("demo.q4", "2 ms")
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now raises ImportError
    ui.show("demo.q4")
    out = capsys.readouterr().out
    assert "demo.q4: Predict" in out and "Run the measurement cell (copy_big_ms) first" in out


# ------------------------------------------------------------------ answers in the quiz: kept too


def test_quizzes_answer_keeps_the_first_answer_in_its_output(fresh):
    wrong = quizzes.answer("demo.q1", "30")
    assert not wrong.correct
    data, meta = wrong._repr_mimebundle_()
    assert data["text/plain"] == wrong.message and meta[kept.META_KEY]["answers"]["demo.q1"]["first"]["text"] == "30"
    right = quizzes.answer("demo.q1", "26 GB")
    assert right.correct and "Your first answer, 30 GB, is the one graded." in right.message
    assert quizzes.answer("demo.q1", "twenty").status == "invalid" and _first("demo.q1") == "30"
    quizzes.answer("demo.q3", "c")
    assert _first("demo.q3") == "Python is slow"  # a choice is kept as its option's text


def test_widget_check_keeps_the_first_answer_and_the_kept_line_lists_it(fresh):
    pytest.importorskip("ipywidgets")
    from quizzes import ui

    _, items = ui.build("demo")
    calls = []
    items[0].on_kept = lambda: calls.append(1)
    items[0].submit("30")
    items[0].submit("")  # not an answer: not kept
    items[0].submit("26 GB")
    assert calls == [1, 1] and _first("demo.q1") == "30"
    view = ui.kept_view(["demo.q1", "demo.q2"])
    assert "q1: 30 (then 26 GB)" in view.text
    assert set(view.metadata[kept.META_KEY]["answers"]) == {"demo.q1"}


def test_records_merge_earliest_first():
    a = {"qid": "x.q1", "kind": "prediction", "first": {"text": "1", "value": 1.0, "at": 10.0},
         "latest": {"text": "1", "value": 1.0, "at": 10.0}, "changes": 0}
    b = {"qid": "x.q1", "kind": "answer", "first": {"text": "2", "value": 2.0, "at": 20.0},
         "latest": {"text": "3", "value": 3.0, "at": 30.0}, "changes": 1}
    for m in (kept.merge(a, b), kept.merge(b, a)):
        assert m["first"]["text"] == "1" and m["kind"] == "prediction" and m["latest"]["text"] == "3"
        assert m["changes"] == 1
    nb = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "display_data", "metadata": kept.metadata({"x.q1": b})}]},
                    {"cell_type": "code", "outputs": [{"output_type": "display_data", "metadata": kept.metadata({"x.q1": a})}]}]}
    assert kept.records_in_notebook(nb)["x.q1"]["first"]["text"] == "1"


def test_two_submissions_in_one_batch_keep_the_earlier_first_answer():
    """grade_all merges each submission with the ledger as it was before the batch; writing
    both into the ledger must keep the earlier first answer, in either order."""
    from quizzes.quiz_grading import record_in_ledger

    early = {"qid": "x.q1", "kind": "answer", "first": {"text": "1", "value": 1.0, "at": 10.0},
             "latest": {"text": "1", "value": 1.0, "at": 10.0}, "changes": 0}
    late = {"qid": "x.q1", "kind": "answer", "first": {"text": "2", "value": 2.0, "at": 20.0},
            "latest": {"text": "2", "value": 2.0, "at": 20.0}, "changes": 0}
    other = {**early, "qid": "x.q2"}
    for order in (({"x.q1": early, "x.q2": other}, {"x.q1": late}), ({"x.q1": late}, {"x.q1": early, "x.q2": other})):
        ledger = {}
        for answers in order:
            record_in_ledger(ledger, "ann|01-roofline", answers)
        entry = ledger["ann|01-roofline"]
        assert entry["x.q1"]["first"]["text"] == "1" and entry["x.q1"]["latest"]["text"] == "2"
        assert entry["x.q2"]["first"]["text"] == "1"  # a question only one submission answered stays


# ------------------------------------------------------------------ a real kernel


def test_in_a_kernel_the_first_answer_is_kept_across_a_restart(fresh, tmp_path):
    from nbclient import NotebookClient

    def run(*sources):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
        NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
        return nb

    first = run("import quizzes", 'quizzes.predict("demo.q4", "2 ms")', 'quizzes.predict("demo.q4", "3 ms")',
                'quizzes.answer("demo.q1", "30")')
    outs = [c.outputs for c in first.cells]
    assert outs[1][0]["output_type"] == "display_data" and "Prediction kept: 2 ms" in outs[1][0]["data"]["text/plain"]
    assert outs[2][0]["metadata"][kept.META_KEY]["answers"]["demo.q4"]["first"]["text"] == "2 ms"
    assert outs[3][0]["output_type"] == "execute_result"
    assert outs[3][0]["metadata"][kept.META_KEY]["answers"]["demo.q1"]["first"]["text"] == "30"
    second = run("import quizzes", 'quizzes.predict("demo.q4", "4 ms")')  # a new kernel: the sidecar remembers
    assert "you first predicted 2 ms; now 4 ms" in second.cells[1].outputs[0]["data"]["text/plain"]
    assert kept.records_in_notebook(second)["demo.q4"]["first"]["text"] == "2 ms"


# ------------------------------------------------------------------ release: the reference is blanked


def code(src: str, *tags: str):
    c = nbformat.v4.new_code_cell(src)
    if tags:
        c.metadata["tags"] = list(tags)
    return c


def _lab(*cells):
    nb = nbformat.v4.new_notebook(cells=list(cells))
    return build_lab(nb, "01-x.ipynb")


def test_release_blanks_the_demo_prediction():
    lab = build_lab(nbformat.read(DEMO, as_version=4), DEMO.name)
    cell = next(c for c in lab.cells if predict_tags(c) == ["q4"])
    assert cell.source == 'quizzes.predict("demo.q4", "")'
    assert "2**23 * 4 / (bandwidth" not in render(lab)
    assert layout(lab).predict_cell == {"q4": lab.cells.index(cell)}


def test_release_blanks_multiline_and_keyword_references():
    src = ('import quizzes\n# the reference spans two lines and ends in non-ASCII (ast counts UTF-8 bytes)\n'
           'quizzes.predict("demo.q4", answer=f"{a * b:.1f} "\n                "ms ≈")  # NBVAL_IGNORE_OUTPUT')
    lab = _lab(code(src, "predict:q4"))
    assert lab.cells[0].source.splitlines()[2:] == ['quizzes.predict("demo.q4", answer="")  # NBVAL_IGNORE_OUTPUT']
    ast.parse(lab.cells[0].source)


@pytest.mark.parametrize("src, tag, message", [
    ('ref = 2 * x\nquizzes.predict("demo.q4", f"{ref} ms")', "predict:q4", "holds only quizzes.predict"),
    ('quizzes.predict("demo.q1", "26 GB")', "predict:q1", "not written as a prediction"),
    ('quizzes.predict("demo.q4", "2 ms")', "predict:q5", "one quizzes.predict call per predict: tag"),
    ('quizzes.predict("demo.q4")', "predict:q4", "reference prediction as its second argument"),
    ('quizzes.predict(qid, "2 ms")', "predict:q4", "string literal"),
    ('%time quizzes.predict("demo.q4", "2 ms")', "predict:q4", "not plain Python"),
    ('quizzes.predict("demo.q99", "2 ms")', "predict:q99", "no question 'q99'"),
])
def test_release_rejects_predict_cells_that_would_leak_or_mislead(src, tag, message):
    with pytest.raises(ReleaseError, match=re.escape(message)):
        _lab(code(src, tag))


# ------------------------------------------------------------------ grading: first answers, per question


def _output(shown) -> dict:
    """The output a kernel saves for a displayed View or Result (with its metadata)."""
    bundle = shown._repr_mimebundle_()
    data, meta = bundle if isinstance(bundle, tuple) else (bundle, {})
    return nbformat.v4.new_output("display_data", data=data, metadata=meta)


def _submission(lab, predict_texts: list[str], quiz: dict[str, str]):
    """The lab as a student saves it: the prediction cell run with each text in turn (its last
    output carries the kept entry), and the quiz answered with quizzes.answer."""
    nb = nbformat.from_dict(nbformat.reads(render(lab), as_version=4))
    for cell in nb.cells:
        if predict_tags(cell):
            view = None
            for text in predict_texts:
                view = predictions.prediction_view("demo.q4", text)
            cell.source = f'quizzes.predict("demo.q4", "{predict_texts[-1]}")'
            cell.outputs = [_output(view)]
        if "quiz:demo" in cell.metadata.get("tags", []):
            cell.outputs = [_output(quizzes.answer(qid, text)) for qid, text in quiz.items()]
    return nb


def _read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_question_rows_for_late_unrun_and_unmeasured_predictions(fresh):
    from quizzes.quiz_grading import quiz_rows

    base = ("ann", "ann/00-demo.ipynb", "00-demo")
    predictions.prediction_view("demo.q4", "2 ms")
    before = kept.entries(["demo.q4"])
    row = quiz_rows(base, ["demo.q4"], before, None)[0]  # the graded run measured nothing
    assert row.status == "not measured" and row.points == 0 and "did not record copy_big_ms" in row.detail
    row = quiz_rows(base, ["demo.q4"], before, {"copy_big_ms": 2.1})[0]
    assert (row.status, row.points, row.kind, row.answer) == ("right", 1.0, "prediction", "2 ms")

    kept.reset()
    fresh.unlink()
    quizzes.record(copy_big_ms=2.0)
    predictions.prediction_view("demo.q4", "2 ms")  # first given after the measurement
    row = quiz_rows(base, ["demo.q4"], kept.entries(["demo.q4"]), {"copy_big_ms": 2.0})[0]
    assert row.status == "late" and row.points == 0 and "after the measurement had been taken" in row.detail

    never_run = nbformat.v4.new_notebook(cells=[code('quizzes.predict("demo.q4", "2 ms")', "predict:q4")])
    row = quiz_rows(base, ["demo.q4"], {}, {"copy_big_ms": 2.0}, never_run)[0]
    assert row.status == "unanswered" and "'2 ms', but the cell was never run" in row.detail


@pytest.mark.timeout(900)
def test_grading_scores_each_question_from_the_first_answers(fresh, tmp_path, monkeypatch):
    from quizzes import grade

    release_dir, out = tmp_path / "labs", tmp_path / "out"
    release_dir.mkdir()
    lab = build_lab(nbformat.read(DEMO, as_version=4), DEMO.name)
    (release_dir / DEMO.name).write_text(render(lab))
    # 1st submission: a wild first prediction (then a sensible one), q1 right, q3 wrong, q2 unanswered
    first = _submission(lab, ["0.0001 ms", "3 ms"], {"demo.q1": "26 GB", "demo.q3": "c"})
    (tmp_path / "sub1" / "ann").mkdir(parents=True)
    nbformat.write(first, tmp_path / "sub1" / "ann" / DEMO.name)
    args = ["--release-dir", str(release_dir), "--out", str(out), "--timeout", "60", "--setup-timeout", "300"]
    assert grade.main([str(tmp_path / "sub1"), *args]) == 0

    scores = _read(out / "scores.csv")
    assert len(scores) == 1 and scores[0]["student"] == "ann"
    row = scores[0]
    assert list(row)[-7:] == ["softmax", "matvec", "greedy_pick", "demo.q1", "demo.q2", "demo.q3", "demo.q4"]
    assert {k: row[k] for k in ("demo.q1", "demo.q2", "demo.q3", "demo.q4")} == \
        {"demo.q1": "1", "demo.q2": "0", "demo.q3": "0", "demo.q4": "0"}
    assert row["quiz"] == "1" and row["quiz_max"] == "4" and row["exercises"] == "0" and row["exercises_max"] == "4"
    details = {r["exercise"]: r for r in _read(out / "details.csv")}
    q4 = details["demo.q4"]
    assert q4["kind"] == "prediction" and q4["status"] == "wrong" and q4["answer"] == "0.0001 ms"
    assert "You predicted 0.0001 ms; your measurement gives" in q4["detail"]
    assert "You later changed it to 3 ms" in q4["detail"]
    assert details["demo.q2"]["status"] == "unanswered" and details["demo.q3"]["answer"] == "Python is slow"
    assert details["softmax"]["kind"] == "exercise" and details["softmax"]["status"] == "not implemented"
    graded = nbformat.read(out / "ann" / "00-demo.graded.ipynb", as_version=4)
    assert "copy_big_ms" in kept.measured_in_notebook(graded)  # the run's own measurement
    feedback = (out / "ann" / "00-demo.feedback.txt").read_text()
    assert "score: 0 / 4" in feedback and "quiz: 1 / 4 (your first answer to each question)" in feedback

    # 2nd submission, later: a fresh notebook whose first answers differ. The ledger keeps the first ones.
    kept.reset()
    monkeypatch.setenv("QUIZZES_ANSWERS", str(tmp_path / "second-kernel.json"))
    quizzes.record(bandwidth_GBps=27.0)  # what this student measured before answering q2
    second = _submission(lab, ["2 ms"], {"demo.q1": "30 GB", "demo.q2": "100"})
    (tmp_path / "sub2" / "ann").mkdir(parents=True)
    nbformat.write(second, tmp_path / "sub2" / "ann" / DEMO.name)
    assert grade.main([str(tmp_path / "sub2"), *args]) == 0
    details = {r["exercise"]: r for r in _read(out / "details.csv")}
    assert details["demo.q1"]["status"] == "right" and details["demo.q1"]["answer"] == "26 GB"
    assert details["demo.q4"]["answer"] == "0.0001 ms" and details["demo.q4"]["status"] == "wrong"
    q2 = details["demo.q2"]  # first answered now: marked now, against the bandwidth the student saw
    assert q2["answer"] == "100" and q2["status"] == "right", q2
    ledger = json.loads((out / "answers.json").read_text())
    assert ledger["ann|00-demo"]["demo.q1"]["first"]["text"] == "26 GB"


# ------------------------------------------------------------------ every lab: two predictions, asked first


def _records(cell) -> set[str]:
    """Keys a cell records with quizzes.record(key=...)."""
    plain = "\n".join(ln for ln in cell.source.splitlines() if not ln.lstrip().startswith(("%", "!")))  # magics
    try:
        tree = ast.parse(plain)
    except SyntaxError:
        return set()
    return {k.arg for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "record" for k in node.keywords if k.arg}


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_every_lab_asks_two_predictions_before_their_measurements(path):
    """Passes only once every lab piece of issue 29 has added its predictions."""
    bank = questions.load_bank(f"lab{path.name[:2]}")
    preds = [q for q in bank.questions.values() if isinstance(q, questions.Numeric) and q.predict]
    assert len(preds) >= 2, (f"{bank.name} has {len(preds)} prediction(s) (Numeric(predict=True)); every lab "
                             "needs at least 2, each asked in a predict:<id> cell before its measurement")
    nb = nbformat.read(path, as_version=4)
    lay = layout(nb, path.name)
    code_cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    for q in preds:
        assert q.id in lay.predict_cell, f"{bank.name}.{q.id}: no cell tagged predict:{q.id} in solutions/{path.name}"
        asked = lay.predict_cell[q.id]
        for key in q.needs:
            recorded = next((i for i, c in code_cells if key in _records(c)), None)
            assert recorded is not None, f"{bank.name}.{q.id} needs {key!r}, but no cell calls quizzes.record({key}=...)"
            assert asked < recorded, (f"{bank.name}.{q.id}: its predict cell ({asked}) must come before the first cell "
                                      f"that records {key!r} ({recorded})")


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_every_solution_prediction_was_kept_in_its_saved_run(path):
    """The solution's own predict cells must produce readable answers: a unit the parser does
    not know ("274 steps" before "steps" was a unit) leaves nothing kept, and the solution
    then teaches a prediction that never counted. Read from the saved outputs."""
    nb = nbformat.read(path, as_version=4)
    lay = layout(nb, path.name)
    for qid, i in lay.predict_cell.items():
        text = json.dumps(nb.cells[i].get("outputs", []), ensure_ascii=False)
        assert "Prediction kept" in text, (f"solutions/{path.name}, cell {i} (predict:{qid}): the saved output "
                                           "does not say the prediction was kept; re-run it and read its message")


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_no_quiz_answer_is_printed_by_any_solution_notebook(path):
    """Issue 29: a question that is not a prediction is not answered by copying a value the
    lab printed (Labs 09 and 10 had this test; every lab keeps it now)."""
    sys.path.insert(0, str(REPO / "tests"))
    from notebook_answers import printed_answers

    assert printed_answers(path.name, f"lab{path.name[:2]}") == {}


# ------------------------------------------------------------------ the real thing: JupyterLab keeps the Check


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_in_jupyterlab_check_writes_the_first_answer_into_the_saved_notebook(lab):
    """The Check button's answer reaches the saved .ipynb: the "kept for grading" line under the
    quiz is updated in place (display id) and saved with its metadata, which the grader reads."""
    from browser_utils import answer_text_question

    lab.open(DEMO)
    lab.run_all()
    q1 = lab.page.locator(".quiz-q-demo-q1")
    q1.scroll_into_view_if_needed()
    answer_text_question(q1, "30", "Not quite")
    answer_text_question(q1, "26 GB", "Correct")
    lab.page.locator(".quiz-kept", has_text="q1: 30 (then 26 GB)").wait_for(timeout=30_000)
    q4 = lab.page.locator(".quiz-q-demo-q4")
    assert "You predicted" in q4.locator(".quiz-feedback").inner_text()  # marked, not asked again
    import time

    deadline = time.monotonic() + 30
    while True:  # an autosave from before the Check may be on disk first: save until the file has it
        lab.save()
        found = kept.records_in_notebook(lab.notebook())
        if found.get("demo.q1", {}).get("latest", {}).get("text") == "26 GB" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert found["demo.q1"]["first"]["text"] == "30" and found["demo.q1"]["latest"]["text"] == "26 GB"
    assert found["demo.q4"]["kind"] == "prediction"
