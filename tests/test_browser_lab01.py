"""Lab 01 in a real JupyterLab (headless Chromium): run every cell of the solution notebook,
move the roofline's batch slider and see the plot redrawn, and answer a quiz question right,
then wrong. Screenshots go to test-artifacts/; the roofline widget's own picture also goes
to docs/lab01-roofline.png (the README shows it).

Skips without chromium (fails when CI is set): bash .ci/install-browser.sh
"""

from __future__ import annotations

import re
import time

import pytest

from browser_utils import REPO, answer_text_question

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

LAB01 = "solutions/01-roofline.ipynb"
DOCS_PICTURE = REPO / "docs" / "lab01-roofline.png"


def _plot_src(page) -> str:
    return page.locator(".minillm-roofline-plot img").first.get_attribute("src") or ""


def test_lab01_runs_its_roofline_reacts_and_its_quiz_gives_feedback(lab):
    from playwright.sync_api import expect

    t0 = time.monotonic()
    lab.open(LAB01)
    lab.run_all(timeout=600)
    print(f"Lab 01 ran in JupyterLab in {time.monotonic() - t0:.0f} s")
    assert lab.errors() == []
    page = lab.page
    text = page.locator(".jp-Notebook").inner_text()
    for name in ("decode_ceiling", "matvec_intensity", "matmul_intensity", "ridge_point"):
        assert f"✓ {name}: matches the reference on 4 random cases" in text

    # the roofline widget: rendered with this machine's measurements ...
    roof = page.locator(".minillm-roofline").first
    roof.scroll_into_view_if_needed()
    expect(page.locator(".minillm-roofline-plot img").first).to_be_visible(timeout=30_000)
    summary = page.locator(".minillm-roofline-summary").first
    expect(summary).to_contain_text("stops being bandwidth-bound", timeout=30_000)
    expect(summary).to_contain_text("decode B=1")
    lab.screenshot("lab01-roofline")
    DOCS_PICTURE.parent.mkdir(exist_ok=True)
    roof.screenshot(path=str(DOCS_PICTURE))

    # ... and redrawn when the batch slider moves (arrow keys on its handle, as a user would)
    before = _plot_src(page)
    handle = page.locator(".minillm-roofline-batch .noUi-handle").first
    for _attempt in range(3):  # a key press that lands before the handle has focus does nothing
        handle.focus()
        handle.press("ArrowRight")
        deadline = time.monotonic() + 30
        while _plot_src(page) == before and time.monotonic() < deadline:
            time.sleep(0.3)
        if _plot_src(page) != before:
            print(f"roofline redrawn after {_attempt + 1} key press(es)")
            break
    assert _plot_src(page) != before, "the roofline plot did not change after moving the batch slider"
    expect(summary).to_contain_text("decode B=2", timeout=30_000)
    lab.screenshot("lab01-roofline-batch2")

    # the quiz: right, then wrong
    q1 = page.locator(".quiz-q-lab01-q1")
    q1.scroll_into_view_if_needed()
    answer_text_question(q1, "26 GB", "Correct")
    feedback = q1.locator(".quiz-feedback")
    expect(feedback).to_have_class(re.compile(r"\bquiz-correct\b"))
    assert "2 bytes" in q1.locator(".quiz-explanation").inner_text()
    lab.screenshot("lab01-quiz-right")
    answer_text_question(q1, "13 GB", "Not quite")
    assert "too low" in feedback.inner_text()
    expect(feedback).to_have_class(re.compile(r"\bquiz-wrong\b"))
    lab.screenshot("lab01-quiz-wrong")
