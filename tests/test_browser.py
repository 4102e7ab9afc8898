"""The browser harness, on the demo notebook: JupyterLab + ipywidgets in headless Chromium.

Runs every cell of tests/fixtures/00-demo.ipynb in a real JupyterLab, checks that no
cell errored, then answers the quiz right and wrong and reads the feedback. Screenshots
go to test-artifacts/. Skips without chromium (fails when CI is set): bash .ci/install-browser.sh
"""

from __future__ import annotations

import re

import pytest

from browser_utils import answer_text_question

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

DEMO = "tests/fixtures/00-demo.ipynb"


def test_demo_notebook_runs_and_quiz_gives_feedback(lab):
    from playwright.sync_api import expect

    lab.open(DEMO)
    lab.run_all()
    assert lab.errors() == []
    page = lab.page

    # the check cells printed their one-line verdicts
    text = page.locator(".jp-Notebook").inner_text()
    for name in ("softmax", "matvec", "greedy_pick"):
        assert f"✓ {name}: matches the reference on 3 random cases" in text

    # numeric question: right answer (with a unit) ...
    q1 = page.locator(".quiz-q-demo-q1")
    q1.scroll_into_view_if_needed()
    answer_text_question(q1, "26 GB", "Correct")
    feedback = q1.locator(".quiz-feedback")
    assert "26 GB" in feedback.inner_text()
    assert "2 bytes" in q1.locator(".quiz-explanation").inner_text()
    lab.screenshot("demo-quiz-right")

    # ... then wrong by a factor of 1e9: the feedback changes to a units hint
    answer_text_question(q1, "26e9", "Check your units")
    assert "Did you mean 26 GB?" in feedback.inner_text()
    expect(feedback).to_have_class(re.compile(r"\bquiz-wrong\b"))

    # multiple choice: a wrong option shows why it is wrong
    q3 = page.locator(".quiz-q-demo-q3")
    q3.get_by_text("Python is slow").click()
    q3.locator("button.quiz-check").click()
    q3.locator(".quiz-feedback").get_by_text(re.compile("Not quite")).wait_for()
    assert "Interpreter overhead" in q3.locator(".quiz-feedback").inner_text()
    q3.locator(".quiz-feedback").scroll_into_view_if_needed()
    lab.screenshot("demo-quiz-wrong")
