"""Every lab has a predict-then-measure question, and it really discriminates.

A predict-then-measure question is a ``Numeric`` that reads a measurement the lab
records (``needs=(...)``), accepts at most 20% relative error (``rtol <= 0.2``, no
absolute slack), and asks the student to predict (its prompt says "predict" and states
the tolerance). The labs are found by globbing ``solutions/``, so a lab
added later is covered without editing this file: ``solutions/NN-topic.ipynb`` has its
quiz in ``quizzes/bank/labNN.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quizzes.questions import Numeric, answer, load_bank

ROOT = Path(__file__).resolve().parents[1]
MAX_RTOL = 0.2
LABS = sorted(p.name[:2] for p in (ROOT / "solutions").glob("*.ipynb") if re.match(r"^\d\d-", p.name))


def predict_measure_questions(bank_name: str) -> list[Numeric]:
    bank = load_bank(bank_name)
    return [q for q in bank.questions.values()
            if isinstance(q, Numeric) and q.needs and 0 < q.rtol <= MAX_RTOL and q.atol == 0
            and "predict" in q.prompt.lower()]


def all_cases() -> list[tuple[str, str]]:
    return [(f"lab{n}", q.id) for n in LABS for q in predict_measure_questions(f"lab{n}")]


def test_labs_found():
    assert LABS, "no solution notebooks found in solutions/"


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_has_a_predict_then_measure_question(lab):
    found = predict_measure_questions(f"lab{lab}")
    assert found, (f"quizzes/bank/lab{lab}.py has no predict-then-measure question: add a Numeric with "
                   f"needs=(...) (read from quizzes.record in the notebook), rtol <= {MAX_RTOL}, and a "
                   f"prompt that asks to predict and states the tolerance")


@pytest.mark.parametrize("lab", LABS)
def test_the_prompt_states_the_tolerance(lab):
    for q in predict_measure_questions(f"lab{lab}"):
        pct = f"{round(q.rtol * 100)}%"
        assert pct in q.prompt, f"lab{lab}.{q.id}: the prompt should say the tolerance ({pct})"


@pytest.mark.parametrize("bank_name,qid", all_cases())
def test_exact_prediction_is_right_and_wild_ones_are_wrong(bank_name, qid):
    q = load_bank(bank_name).questions[qid]
    measured = dict(q.example_measured)
    exact = q.expected_value(measured)
    assert exact != 0
    full = f"{bank_name}.{qid}"
    assert answer(full, exact, measured).correct
    assert answer(full, exact * (1 + 0.9 * q.rtol), measured).correct
    for factor in (10.0, 0.1, 1 + 1.5 * q.rtol, 1 - 1.5 * q.rtol):
        res = answer(full, exact * factor, measured)
        assert not res.correct, f"{full}: a prediction {factor}× the measurement was marked right"
        assert res.status == "wrong", res.status


@pytest.mark.parametrize("bank_name,qid", all_cases())
def test_answer_follows_the_measurement(bank_name, qid):
    """Scaling every recorded measurement by the same factor must move the marked answer:
    the question is marked against this run, not against a constant."""
    q = load_bank(bank_name).questions[qid]
    base = q.expected_value(dict(q.example_measured))
    moved = [q.expected_value({**q.example_measured, k: 3.0 * v}) for k, v in q.example_measured.items()]
    assert any(abs(m - base) > MAX_RTOL * abs(base) for m in moved), \
        f"{bank_name}.{qid}: its answer does not depend on the measurements it needs"
