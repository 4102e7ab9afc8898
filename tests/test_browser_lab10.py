"""Lab 10 in a real JupyterLab (headless Chromium): run every cell of the solution notebook
(the real server included), then drive the cost widget: type a new throughput into it and see
its $/1M tokens, its summary and its plot change; then answer a quiz question.

Skips without chromium (fails when CI is set): bash .ci/install-browser.sh
"""

from __future__ import annotations

import re
import time

import pytest

from browser_utils import answer_text_question

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

LAB10 = "solutions/10-capstone.ipynb"


def _plot_src(page) -> str:
    return page.locator(".minillm-cost-plot img").first.get_attribute("src") or ""


def test_lab10_runs_and_its_cost_widget_reacts(lab):
    from playwright.sync_api import expect

    t0 = time.monotonic()
    lab.open(LAB10)
    lab.run_all(timeout=600)
    print(f"Lab 10 ran in JupyterLab in {time.monotonic() - t0:.0f} s")
    assert lab.errors() == []
    page = lab.page
    text = page.locator(".jp-Notebook").inner_text()
    assert "✓ claim_verdicts: every verdict agrees with calc" in text

    # the cost widget, rendered at its starting point: 70B on A100s, 800 tok/s, half busy
    widget = page.locator(".minillm-cost").first
    widget.scroll_into_view_if_needed()
    expect(page.locator(".minillm-cost-plot img").first).to_be_visible(timeout=30_000)
    summary = page.locator(".minillm-cost-summary").first
    expect(summary).to_contain_text("$1.736 at 50% utilization", timeout=30_000)
    expect(summary).to_contain_text("GPUs needed: 28")
    lab.screenshot("lab10-cost")

    # type a doubled throughput, as a user would: the cost halves, fewer GPUs, a new plot
    before = _plot_src(page)
    box = page.locator(".minillm-cost-tokens-per-s input").first
    box.fill("1600")
    box.press("Enter")
    expect(summary).to_contain_text("$0.868 at 50% utilization", timeout=30_000)
    expect(summary).to_contain_text("GPUs needed: 16")
    deadline = time.monotonic() + 30
    while _plot_src(page) == before and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _plot_src(page) != before, "the cost plot did not change after a new throughput"
    lab.screenshot("lab10-cost-1600")

    # a computed quiz question: right, then wrong
    q2 = page.locator(".quiz-q-lab10-q2")
    q2.scroll_into_view_if_needed()
    answer_text_question(q2, "$2.17", "Correct")
    answer_text_question(q2, "$0.87", "Not quite")
    expect(q2.locator(".quiz-feedback")).to_have_class(re.compile(r"\bquiz-wrong\b"))
