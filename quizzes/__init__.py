"""Course machinery: checks, quizzes, student notebooks and grading.

Students meet four names::

    from quizzes import check      # check.kv_append(my_kv_append)
    import quizzes
    quizzes.predict("lab02.q9", "")   # a prediction, typed between the quotes BEFORE the measurement
    quizzes.show("lab02")          # the lab's quiz as widgets (or "lab02.q3" for one question)
    quizzes.answer("lab02.q3", "26 GB")   # the same without widgets

Authoring guide (for whoever writes a lab)
==========================================

1. Solution notebook -> student notebook
----------------------------------------
Write ``solutions/NN-topic.ipynb``; never edit ``labs/`` by hand. ``make labs``
(``python -m quizzes.release``) writes ``labs/NN-topic.ipynb`` from it, and
``python -m quizzes.release --check`` (run by the tests) fails when ``labs/`` is stale.

In an exercise cell, the code the student must write sits between marker lines;
keep the ``def`` line outside, so the stub ends up inside the function::

    def kv_append(cache_k, cache_v, k, v):
        ### BEGIN SOLUTION
        # HINT: one torch.cat per tensor, along the sequence dimension (dim=2).
        return torch.cat([cache_k, k], dim=2), torch.cat([cache_v, v], dim=2)
        ### END SOLUTION

becomes, in the lab::

    def kv_append(cache_k, cache_v, k, v):
        # HINT: one torch.cat per tensor, along the sequence dimension (dim=2).
        raise NotImplementedError("one torch.cat per tensor, along the sequence dimension (dim=2).")

Outputs, execution counts and metadata are dropped, the kernel is named
``python3``, ``# NBVAL_...`` comment lines are removed, and the generator fails if
any solution line or marker would reach ``labs/``. A block at the top level of a
cell works too, but then running the cell raises: prefer functions.

Cell tags (cell metadata "tags"; JupyterLab: property inspector -> Common Tools):

- ``exercise:<id>``  the cell the student edits; exactly one per id; must hold a
  solution block. Optional ``points:<n>`` tag on it (default 1).
- ``check:<id>``     a cell that checks exercise <id>; at least one per exercise.
  Made read-only in the lab, and the grader always runs the release copy.
- ``quiz:<id>``      a cell showing quiz questions (for readers and tests only).
- ``predict:<id>``   a cell asking the prediction ``<bank>.<id>`` (see 3): it holds only
  ``quizzes.predict("lab01.q15", <reference>)`` (plus imports and comments), and the lab
  gets ``quizzes.predict("lab01.q15", "")``. The release refuses anything else in it
  (a line computing the reference would hand out the answer), a call for a question
  that is not ``predict=True``, and a tag without its call.
- ``solution-only``  the whole cell is left out of the lab (instructor notes, ...).

2. Checks (``quizzes/checks/labNN.py``)
---------------------------------------
One module per lab (or a subpackage ``labNN/`` once it grows long, like ``lab03/``);
every ``@register``-ed function becomes ``check.<name>`` (names are global across
labs; reuse ``check.softmax``/``matvec``/``greedy_pick`` from ``generic.py`` rather
than redefining them). The function describes ONE random case; it is run ``cases``
times with fresh seeds::

    from quizzes.checks import register

    @register(cases=3)
    def kv_append(case, fn):
        "Appending one step of K/V to the cache grows dim 2 by one, old entries unchanged."
        import torch
        from minillm.reference import kv_append as ref   # the oracle
        b, h, t, d = case.size(1, 3), case.size(1, 4), case.size(0, 9), case.choice([8, 16])
        ck, cv, k, v = (case.randn(b, h, t, d), case.randn(b, h, t, d),
                        case.randn(b, h, 1, d), case.randn(b, h, 1, d))
        case.compare(case.call(fn, ck, cv, k, v), ref(ck, cv, k, v), what="(K, V)", atol=0)

- ``case.randn/rand/randint/size/choice``: seeded random inputs (never zeros).
- ``case.call(fn, ...)``: calls the student's code on copies of the inputs; a stub
  becomes "not implemented yet", an exception becomes its type, message, the
  line of the student's code and the input shapes.
- ``case.compare(yours, ref, what=..., atol=, rtol=, check_dtype=, show=)``:
  type, shape, dtype, device, first mismatch, max error vs tolerance.
- ``case.expect(cond, "what is wrong and what to do")`` for invariants.
- ``show_mismatch(yours, ref)``: yours vs reference with bad cells marked.

A pass prints ``✓ name: matches the reference on 3 random cases``; a failure
raises ``CheckFailed`` (an AssertionError) that Jupyter shows as the message only.

Hints teach best after an attempt, and never by handing out the formula. The ladder:

- the stub's ``# HINT:`` line states the task and the rules the check enforces (shapes,
  dtypes, what to return); it is the "not implemented yet" message of an untouched stub;
- every wrong attempt prints what differs and, when the check can see it, an automatic
  ``Diagnosis:`` (``checks/diagnosis.py``): the sign flipped, a unit slip (10³, 10⁹, GiB
  against GB, percent against fraction), a constant factor (named: 2×, 1/2, √2), a
  constant offset or a difference equal to one of the inputs (a missing term), a
  transposed result. Nothing to write for it: ``case.compare`` finds it;
- ``@register(nudge="...")``: printed as ``Hint: ...`` from the first wrong attempt on:
  what to look at (which quantity, dimension or unit), not how to compute it;
- ``@register(concept="...")``: printed as ``Concept: ...`` from the second wrong attempt
  of that check in the kernel session on (``checks.attempts`` counts them): the idea.
  ``hint=`` is the old name of ``concept`` and still works.

No stub hint and no nudge/concept may contain a line of the solution block (at least 12
characters without spaces, with an operator or a call, or its right-hand side after
``return``/``=``): tests/test_hints.py checks every exercise of every solution notebook.

3. Quiz banks (``quizzes/bank/labNN.py``)
-----------------------------------------
A module with ``TITLE`` and ``QUESTIONS``::

    from quizzes.questions import Choice, Numeric, Option

    def _kv_gb():
        from minillm import calc          # import inside: answers are computed at check time
        return calc.kv_cache_bytes(num_layers=80, num_kv_heads=8, head_dim=128, seq_len=4096, dtype_bytes=2) / 1e9

    QUESTIONS = [
        Numeric("q1", "KV cache of Llama-2-70B at 4096 tokens, fp16, one sequence?", answer=_kv_gb,
                unit="GB", rtol=0.02, explanation="2 · 80 · 8 · 128 · 4096 · 2 B = 1.34 GB"),
        Numeric("q2", "Predict this machine's batch-1 decode ceiling for fp32 weights (538 MB).",
                answer=lambda m: m["bandwidth_GBps"] / 0.538, unit="tok/s", rtol=0.2,
                needs=("bandwidth_GBps",), example_measured={"bandwidth_GBps": 25.0}),
        Choice("q3", "Which method pushes rounding error onto later columns?", options=[
            Option("GPTQ", correct=True, why="It uses the inverse Hessian of the layer inputs."),
            Option("AWQ", why="AWQ rescales salient channels; it does not propagate error.")]),
    ]

Prompts and explanations are plain text with `code` and **bold** (no HTML, no LaTeX:
write 2·N·L, ÷, ×, ², α). Numeric input accepts "26e9", "26 GB", "1,340 MB", "3 × 10^9"; a bare number is
read in the question's unit; an answer off by 10^3/10^6/10^9 (or GiB vs GB) gets a
"check your units" hint. A measured answer reads ``quizzes.measured``, filled by the
lab's measurement cell with ``quizzes.record(bandwidth_GBps=bw)``.
``quizzes.answer("lab01.q3", "26 GB")`` marks an answer without widgets (tests).

Predict, then measure: every lab asks at least two predictions. A prediction is a
``Numeric(..., predict=True, needs=(<measurement keys>,), rtol<=0.2)`` whose prompt names
the formula or the earlier measurement to use and states the tolerance. In the solution,
a cell tagged ``predict:<id>`` BEFORE the cell that measures and calls ``quizzes.record``
gives the reference prediction, computed from earlier cells' variables::

    quizzes.predict("lab01.q15", f"{bandwidth_GBps * 1e9 / weight_bytes:.0f} tok/s")

The lab gets ``quizzes.predict("lab01.q15", "")``: the student types a prediction between
the quotes and runs the cell. ``predict`` reads it (units as any ``Numeric``), keeps the
FIRST answer, shows a later different one as a change (the first stays the one marked),
and says it is marked after the measurement. After the measurement cell,
``quizzes.show("lab01")`` (or ``"lab01.q15"``) marks the kept prediction against the
measurement instead of asking again ("you predicted X; your measurement gives Y: +12%
off, within the 20% allowed: right"); it shows a text box only if nothing was predicted.
A first prediction given after the measurement was recorded in the same kernel is marked
"late" by the grader. tests/test_quiz_predictions.py checks that every lab has two, each
``predict:`` cell before the first cell recording each of its ``needs``;
tests/test_predict_measure.py that a prediction 10× off is marked wrong.

Answers count once: for every question, the student's FIRST readable answer (predicted,
Checked in the widget, or given to ``quizzes.answer``) is kept and is what the grader
marks (see 6).
Every bank is tested automatically (tests/test_quizzes_core.py): each question must
accept its own expected answer.

4. Notebooks under nbval (``make test``)
----------------------------------------
Every solution notebook runs under ``pytest --nbval-lax``: all cells must run
without error, and only cells containing the comment ``# NBVAL_CHECK_OUTPUT`` have
their output compared to the saved one. Mark only deterministic cells (``calc``
results, check lines, token ids). ``tests/nbval_sanitize.cfg`` masks memory
addresses and numbers followed by a measured unit (tok/s, GB/s, ms, s, FLOP/s, ×,
%) and long floats; print deterministic numbers with at most 4 decimals and
measured ones with their unit. Save solution notebooks WITH outputs.

5. Grading (``make grade``)
---------------------------
``python -m quizzes.grade SUBMISSIONS/`` matches each submitted ``*NN-topic*.ipynb``
to ``labs/NN-topic.ipynb``, builds a fresh copy of the lab with only the student's
``exercise:`` cells, runs it (per-cell timeout), and scores each exercise by the
fraction of its ``check:`` cells that ran without error. Each quiz question the lab
shows or predicts is worth 1 point, for its FIRST answer (see 6): predictions are marked
against the measurements of the graded run (the grader appends a cell that reports
``quizzes.measured``), other questions that read measurements against the values the
student saw when answering. A second submission cannot replace a first answer: the
grader keeps the first answers it has seen per student and lab in ``OUT/answers.json``.
Output: ``scores.csv`` (a line per submission: totals, then a column per exercise and
per question, e.g. ``kv_append``, ``lab02.q9``), ``details.csv`` (a line per submission ×
exercise or question: status, detail, the first answer), per-submission feedback files
and the graded notebooks.

6. Where answers are kept (``quizzes/kept.py``)
-----------------------------------------------
Per question, one entry: ``{"qid", "kind": "prediction"|"answer", "first": {"text",
"value", "at", "after_measurement", ["measured"]}, "latest": {...}, "changes"}``. It is
kept in the kernel; in a sidecar file next to the notebook, ``.<notebook>.answers.json``
(when Jupyter names the notebook through ``JPY_SESSION_NAME``, or in the file
``QUIZZES_ANSWERS`` names; ``QUIZZES_ANSWERS=off`` for none), so a kernel restart does not
reset it; and in the notebook itself: the output of the ``predict:`` cell, the result of
``quizzes.answer`` and the "kept for grading" line under a quiz (which Check updates in
place through its display id) carry ``{"minillm_quiz": {"version": 1, "answers":
{qid: entry}}}`` in their output metadata. That metadata is what the grader reads from a
submitted ``.ipynb`` (the earliest first answer per question wins); a kernel also reads it
back from the saved notebook on first use. The marks in the notebook and the grader's come
from one function, ``predictions.mark_entry``.
"""

from __future__ import annotations

import sys as _sys

from . import checks
from .predictions import answer, predict
from .questions import Result, expected, measured, record

check = checks  # ``from quizzes import check`` is how notebooks spell it
_sys.modules.setdefault(__name__ + ".check", checks)


def show(spec) -> None:
    """Display quiz widgets for a bank ("lab01"), a question ("lab01.q3") or a list."""
    from .ui import show as _show

    _show(spec)


__all__ = ["check", "checks", "answer", "expected", "predict", "show", "record", "measured", "Result"]
