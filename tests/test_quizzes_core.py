"""Quizzes: reading typed numbers with units, marking, banks, and the widget logic
(without a browser; tests/test_browser.py clicks the real thing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import quizzes
from quizzes.questions import (Choice, Numeric, Option, _validate, answer, available_banks, expected, get_question,
                               load_bank)
from quizzes.units import UnitError, format_quantity, parse_quantity

# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize("text, value, dim", [
    ("26e9", 26e9, ""),
    ("26 GB", 26e9, "B"),
    ("1.34GB", 1.34e9, "B"),
    ("1,340 MB", 1.34e9, "B"),
    ("26 gb", 26e9, "B"),
    ("1.5 GiB", 1.5 * 2**30, "B"),
    ("3 × 10^9", 3e9, ""),
    ("3*10**9", 3e9, ""),
    (".5", 0.5, ""),
    ("-2", -2.0, ""),
    ("2 TB/s", 2e12, "B/s"),
    ("312 TFLOP/s", 312e12, "FLOP/s"),
    ("989 TFLOPS", 989e12, "FLOP/s"),
    ("14 tok/s", 14.0, "tok/s"),
    ("12 ms", 0.012, "s"),
    ("100 µs", 1e-4, "s"),
    ("$0.87", 0.87, "$"),
    ("60%", 60.0, "%"),
    ("4x", 4.0, "x"),
    ("26 billion", 26e9, ""),
    ("274 steps", 274.0, "step"),
    (26, 26.0, ""),
])
def test_parse_quantity(text, value, dim):
    q = parse_quantity(text)
    assert q.value == pytest.approx(value) and q.dim == dim


@pytest.mark.parametrize("text", ["", "twenty", "GB", "12 parsecs", "1,5", True, float("nan")])
def test_parse_quantity_rejects(text):
    with pytest.raises(UnitError):
        parse_quantity(text)


def test_format_quantity():
    assert format_quantity(1.3421772, "GB") == "1.34 GB"
    assert format_quantity(2.6e10) == "2.6e10"
    assert format_quantity(4, "x") == "4×"
    assert format_quantity(0.87, "$") == "$0.87"


# ------------------------------------------------------------------ numeric marking (demo bank)


@pytest.mark.parametrize("typed", ["26", "26 GB", "26GB", "26.2", "26000 MB", "2.6e10 B", "26e9 bytes", "26 billion"])
def test_numeric_right_answers(typed):
    r = answer("demo.q1", typed)
    assert r.correct and r.status == "correct", r.message
    assert r.message.startswith("✓ Correct") and "26 GB" in r.message
    assert "2 bytes" in r.explanation


@pytest.mark.parametrize("typed, hint", [
    ("26e9", "10⁹ times too large for an answer in GB. Did you mean 26 GB?"),
    ("0.026", "10³ times too small"),
    ("26e-6", "10⁶ times too small"),
    ("24.2", "GiB against GB (2³⁰ against 10⁹ bytes)"),
    ("-26", "check the sign"),
])
def test_numeric_unit_hints(typed, hint):
    r = answer("demo.q1", typed)
    assert not r.correct and r.status == "wrong"
    assert r.message.startswith("✗ Check your units") and hint in r.message


def test_numeric_plain_wrong_says_which_side():
    assert answer("demo.q1", "30").message == "✗ Not quite: 30 GB is too high."
    assert answer("demo.q1", "13 GB").message == "✗ Not quite: 13 GB is too low."


@pytest.mark.parametrize("typed, words", [
    ("twenty six", "Please enter a number"),
    ("26 GB/s", "asks for bytes"),
    ("26,5", "Use a dot for decimals"),
    ("12 parsecs", "I could not read that"),
])
def test_numeric_unreadable_answers_get_friendly_messages(typed, words):
    r = answer("demo.q1", typed)
    assert r.status == "invalid" and not r.correct and words in r.message


def test_measured_question_needs_the_measurement_first(monkeypatch):
    monkeypatch.setattr(quizzes.questions, "measured", {})
    r = answer("demo.q2", "100")
    assert r.status == "invalid" and "run the measurement cell above first" in r.message
    quizzes.record(bandwidth_GBps=27.0)  # what a lab's measurement cell does
    assert answer("demo.q2", "100 tok/s").correct
    assert answer("demo.q2", "100", measured_values={"bandwidth_GBps": 54.0}).message.endswith("too low.")


def test_broken_answer_function_is_a_course_bug_not_a_crash(tmp_path):
    q = Numeric("q9", "?", answer=lambda: 1 / 0, unit="GB")
    from quizzes.questions import _mark_numeric

    r = _mark_numeric("x.q9", q, "1", None)
    assert r.status == "error" and "ZeroDivisionError" in r.message and "bug in the course" in r.message


# ------------------------------------------------------------------ choice marking


def test_choice_by_letter_index_or_text():
    assert answer("demo.q3", "a").correct
    assert answer("demo.q3", 0).correct
    assert answer("demo.q3", "each weight byte read is used for about one flop").correct
    wrong = answer("demo.q3", "c")
    assert not wrong.correct and wrong.message.startswith("✗ Not quite.") and "Interpreter overhead" in wrong.message
    assert answer("demo.q3", 7).status == "invalid"
    assert expected("demo.q3") == "Each weight byte read is used for about one FLOP"


# ------------------------------------------------------------------ banks


def test_unknown_ids_are_clear():
    with pytest.raises(KeyError, match="no quiz bank 'lab77'"):
        answer("lab77.q1", "1")
    with pytest.raises(KeyError, match="no question 'q9' in bank 'demo'"):
        answer("demo.q9", "1")
    with pytest.raises(KeyError, match="look like 'lab01.q3'"):
        answer("demo", "1")


@pytest.mark.parametrize("question, message", [
    (Numeric("Q1", "?", answer=1), "lowercase"),
    (Numeric("q1", "?", answer=1, unit="parsec"), "unknown unit"),
    (Numeric("q1", "?", answer=lambda m: m["bw"], needs=("bw",)), "example_measured"),
    (Choice("q1", "?", options=[Option("a"), Option("b")]), "at least one correct"),
    (Numeric("q1", "?", answer=1, predict=True), "a prediction .predict=True. is marked against a measurement"),
    (Numeric("q1", "?", answer=lambda m: m["t"], needs=("t",), example_measured={"t": 1.0}, rtol=0.5, predict=True),
     "rtol <= 0.2"),
    (Choice("q1", "?", options=[Option("a", correct=True), Option("A")]), "same text"),
    ("q1", "Numeric and Choice"),
])
def test_bank_validation(question, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _validate("labxx", question)


BANK_QUESTIONS = [qid for bank in available_banks() for qid in load_bank(bank).ids()]


@pytest.mark.parametrize("qid", BANK_QUESTIONS)
def test_every_bank_question_accepts_its_own_answer(qid):
    """Each question in every bank (lab banks included) marks its expected answer right."""
    _, q = get_question(qid)
    if isinstance(q, Choice):
        assert answer(qid, expected(qid)).correct
        return
    m = dict(q.example_measured)
    value = expected(qid, m)
    r = answer(qid, repr(value), measured_values=m)
    assert r.correct, r.message
    assert q.prompt.strip() and (q.explanation or q.unit is not None)


def test_importing_a_bank_imports_nothing_heavy():
    code = "import sys, quizzes.questions as q; q.load_bank('demo'); print('torch' in sys.modules, 'minillm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


# ------------------------------------------------------------------ widget logic


def test_widget_feedback_classes_and_explanation_reveal():
    pytest.importorskip("ipywidgets")
    from quizzes import ui

    box, items = ui.build("demo")
    assert [it.qid for it in items] == ["demo.q1", "demo.q2", "demo.q3", "demo.q4"]
    q1 = items[0]
    assert {"quiz-question", "quiz-q-demo-q1"} <= set(q1.box._dom_classes)
    assert "quiz-input" in q1.input._dom_classes and q1.button.description == "Check"

    q1.input.value = "30"
    q1.button.click()  # what the browser's click does
    assert "quiz-wrong" in q1.feedback._dom_classes and "too high" in q1.feedback.value
    assert "appears after a right answer or 1 more try" in q1.explanation.value
    q1.submit("31")
    assert "Explanation:" in q1.explanation.value  # revealed after 2 wrong tries
    q1.submit("26 GB")
    assert "quiz-correct" in q1.feedback._dom_classes and "quiz-wrong" not in q1.feedback._dom_classes
    q1.submit("")
    assert "Type an answer first" in q1.feedback.value and "quiz-invalid" in q1.feedback._dom_classes

    q3 = items[2]
    assert "quiz-choices" in q3.input._dom_classes
    q3.input.value = "The GPU has too few cores"
    q3.button.click()
    assert "Cores sit idle" in q3.feedback.value


def test_prompt_markup_escapes_html_and_dollars():
    from quizzes.ui import markup

    assert markup("At $2.50/h, is p < q? Use `calc.cost` **now**") == \
        "At $2.50/h, is p &lt; q? Use <code>calc.cost</code> <b>now</b>"


def test_single_question_and_lists():
    pytest.importorskip("ipywidgets")
    from quizzes import ui

    _, items = ui.build("demo.q3")
    assert [i.qid for i in items] == ["demo.q3"]
    _, items = ui.build(["demo.q1", "demo.q3"])
    assert len(items) == 2
    with pytest.raises(KeyError):
        ui.build("demo.q42")
