"""Hints that teach: the ladder (diagnosis + nudge on the first wrong attempt, the concept
from the second), the automatic diagnosis of simple slips, and, for every exercise of every
solution notebook, that no stub hint and no nudge/concept/hint text of its checks gives away
a formula line of its solution block.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from quizzes import check
from quizzes.checks import CheckFailed, NotImplementedYet, attempts, register, registry
from quizzes.checks.diagnosis import diagnose, diagnose_shape, name_factor
from quizzes.release import HINT, layout, strip_solutions

REPO = Path(__file__).resolve().parents[1]
LABS = sorted(p for p in (REPO / "solutions").glob("*.ipynb") if re.match(r"^\d\d-", p.name))


def failure(fn, *args, **kw) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(*args, **kw)
    return str(info.value)


# ------------------------------------------------------------------ the ladder, on a fake check


@pytest.fixture
def ladder():
    @register(cases=1, name="toy_ladder", nudge="compare the size of your result with the input's",
              concept="doubling means every element counts twice")
    def _toy(case, fn):
        x = case.randn(4, 5)
        case.compare(case.call(fn, x), 2 * x)

    attempts.pop("toy_ladder", None)
    yield check.toy_ladder
    registry.pop("toy_ladder", None)
    attempts.pop("toy_ladder", None)


def test_first_wrong_attempt_gets_diagnosis_and_nudge_second_gets_the_concept(ladder):
    def stub(x):
        raise NotImplementedError("start from the input")

    with pytest.raises(NotImplementedYet) as info:
        ladder(stub)
    assert "Hint: start from the input" in str(info.value) and "Concept" not in str(info.value)
    assert attempts.get("toy_ladder", 0) == 0  # an untouched stub is not an attempt

    first = failure(ladder, lambda x: x)
    assert "Diagnosis: yours is 1/2 of the reference: off by a constant factor of 2 (too small)." in first
    assert "Hint: compare the size of your result with the input's" in first
    assert "Concept:" not in first and "next failure adds the concept" in first
    assert first.index("Diagnosis:") < first.index("Hint:") < first.index("reproduce:")

    second = failure(ladder, lambda x: -2 * x)
    assert "Diagnosis: the sign is flipped: yours is −1 × the reference." in second
    assert "Hint: compare the size" in second and "Concept: doubling means every element counts twice" in second
    assert attempts["toy_ladder"] == 2
    ladder(lambda x: x + x)  # right: no hint printed, no exception


def test_old_hint_is_the_concept_and_both_at_once_are_refused():
    @register(cases=1, name="toy_old_hint", hint="the idea")
    def _toy(case, fn):
        case.compare(case.call(fn, case.randn(3)), 0.0 * case.randn(3) + 1.0)

    try:
        assert "Concept:" not in failure(check.toy_old_hint, lambda x: x)
        assert "Concept: the idea" in failure(check.toy_old_hint, lambda x: x)
        assert check.toy_old_hint.concept == "the idea" and check.toy_old_hint.nudge == ""
    finally:
        registry.pop("toy_old_hint", None)
        attempts.pop("toy_old_hint", None)
    with pytest.raises(ValueError, match="not both"):
        register(lambda case, fn: None, name="toy_both", hint="a", concept="b")


def test_a_missing_term_equal_to_an_input_is_named():
    @register(cases=1, name="toy_residual")
    def _toy(case, fn):
        x, w = case.randn(3, 4), case.randn(4, 4)
        case.compare(case.call(fn, x, w), x + torch.tanh(x @ w))

    def residual(x, w):
        return torch.tanh(x @ w)

    try:
        msg = failure(check.toy_residual, residual)
        assert "Diagnosis: yours − reference = −x exactly: a term made of x is missing." in msg
    finally:
        registry.pop("toy_residual", None)
        attempts.pop("toy_residual", None)


def test_a_transposed_result_is_named():
    @register(cases=1, name="toy_transpose")
    def _toy(case, fn):
        a = case.randn(3, 5)
        case.compare(case.call(fn, a), a * 3)

    try:
        msg = failure(check.toy_transpose, lambda a: (a * 3).T)
        assert "shape: expected (3, 5), got (5, 3)" in msg
        assert "Diagnosis: yours is the reference transposed: its last two dimensions are swapped." in msg
    finally:
        registry.pop("toy_transpose", None)
        attempts.pop("toy_transpose", None)


# ------------------------------------------------------------------ the diagnosis itself


rng = np.random.default_rng(7)
REF = rng.standard_normal((4, 6)) + 0.1


@pytest.mark.parametrize("yours, words", [
    (-REF, "the sign is flipped"),
    (REF * 1e3, "10³ times larger than the reference: a unit slip"),
    (REF / 1e9, "10⁹ times smaller"),
    (REF * 2**30 / 1e9, "GiB against GB"),
    (REF / 4, "1/4 of the reference"),
    (REF * 100, "a percentage where a fraction is wanted"),
    (REF * 2**0.5, "a factor of √2"),
    (REF * 0.37, "0.37× the reference everywhere"),
    (-3 * REF, "the sign is flipped, and yours is 3× the reference"),
    (REF + 0.25, "yours − reference = 0.25 everywhere: a constant offset"),
])
def test_diagnose_names_simple_slips(yours, words):
    assert words in diagnose(yours, REF)


def test_diagnose_stays_quiet_when_the_difference_is_not_simple():
    assert diagnose(REF + rng.standard_normal(REF.shape), REF) == ""
    assert diagnose(0.37, 1.0) == ""  # one number: any ratio fits, so only simple factors are named
    assert "1/2 of the reference" in diagnose(21, 42)
    assert diagnose("x", REF) == "" and diagnose(REF[:2], REF) == "" and diagnose(REF * np.nan, REF) == ""
    assert diagnose_shape(REF.T * 2, REF) == "" and "transposed" in diagnose_shape(torch.tensor(REF.T), torch.tensor(REF))
    assert name_factor(1.5, single=True) == "" and "1.5× the reference everywhere" in name_factor(1.5)


# ------------------------------------------------------------------ no hint gives a formula away


_FORMULA = re.compile(r"[-+*/@%]|\w\(")
# an operand: a name or a number, or several joined by arithmetic operators; not a callee
# (followed by "." or "("), not a keyword argument's name (followed by "=")
_OPERAND = re.compile(r"(?<![\w.])(?:\d+(?:\.\d*)?(?:e-?\d+)?|[A-Za-z_]\w*)"
                      r"(?:\s*(?:\*\*|[-+*/%@])\s*(?:\d+(?:\.\d*)?|[A-Za-z_]\w*))*(?![\w.(=])")


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text)


def skeleton(text: str) -> str:
    """Code with every operand replaced by _: torch.clamp(p / q, max=1.0) -> torch.clamp(_,max=_),
    so a hint that renames the variables (torch.clamp(ratio, max=1.0)) still shows the line."""
    return _norm(_OPERAND.sub("_", text))


def formula_lines(solution_lines: list[str]) -> dict[str, str]:
    """The normalized lines of a solution block long enough to be a formula (>= 12 characters
    without spaces, with an operator or a call), with their right-hand sides after return/=,
    and the skeletons (``skeleton``) of those with a call."""
    found: dict[str, str] = {}  # pattern -> the solution line it comes from
    for line in solution_lines:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        s = re.sub(r"\s+#.*$", "", s)
        candidates = {s}
        m = re.match(r"^return\s+(.+)$", s)
        if m:
            candidates.add(m.group(1))
        m = re.match(r"^[\w\[\]., ]+?\s*(?:[-+*/@]?=)(?!=)\s*(.+)$", s)
        if m:
            candidates.add(m.group(1))
        for c in candidates:
            n = _norm(c)
            if len(n) >= 12 and _FORMULA.search(c):
                found[n] = s
            shape = skeleton(c)
            if re.search(r"\w\(", c) and len(shape) >= 12 and len(re.sub(r"[^A-Za-z]", "", shape)) >= 5:
                found[shape] = s
    return found


def exercises(path: Path):
    """(exercise id, its solution lines, its stub's hint texts, its checks' hint texts)."""
    check.softmax  # load every lab's checks
    nb = nbformat.read(path, as_version=4)
    lay = layout(nb, path.name)
    for ex, idx in lay.exercise_cell.items():
        src = nb.cells[idx].source
        _, removed, _ = strip_solutions(src, f"{path.name}, cell {idx}")
        stub = [m.group(1) for m in (HINT.match(ln) for ln in src.splitlines()) if m]
        names = {n for i in lay.check_cells[ex] for n in re.findall(r"\bcheck\.(\w+)\(", nb.cells[i].source)}
        texts = {f"check.{n}.{attr}": getattr(registry[n], attr, "")
                 for n in names if n in registry for attr in ("nudge", "concept")}
        yield ex, removed, {f"stub # HINT line {i + 1}": t for i, t in enumerate(stub)}, texts


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_no_hint_or_stub_contains_a_line_of_the_solution(path):
    leaks = []
    for ex, solution, stub, texts in exercises(path):
        formulas = formula_lines(solution)
        for where, text in {**stub, **texts}.items():
            hits = {line for f, line in formulas.items() if text and (f in _norm(text) or f in skeleton(text))}
            leaks += [f"{ex}: {where} gives away the solution line {line!r}" for line in sorted(hits)]
    assert not leaks, f"{path.name}: hints must nudge, not give the formula:\n  " + "\n  ".join(leaks)


def test_the_leak_detector_sees_a_leak_and_ignores_short_lines():
    sol = ["    ratio = torch.clamp(p / q, max=1.0)", "    return ratio", "    x = a + b"]
    found = formula_lines(sol)
    assert _norm("torch.clamp(p / q, max=1.0)") in found
    assert all(len(f) >= 12 for f in found)  # "return ratio" and "x = a + b" are too short to be formulas
    assert any(f in _norm("Hint: use torch.clamp(p/q, max=1.0) here") for f in found)
    assert skeleton("return torch.clamp(p / q, max=1.0)").endswith("torch.clamp(_,max=_)")
    renamed = "one line, elementwise on tensors: torch.clamp(ratio, max=1.0)."
    assert any(f in skeleton(renamed) for f in found)  # renaming the variables does not hide the line
    assert not any(f in skeleton("clamp the ratio at 1, elementwise on tensors") for f in found)


def test_every_exercise_is_found_with_its_checks():
    count = 0
    for path in LABS:
        for ex, solution, _, texts in exercises(path):
            assert solution, f"{path.name}: exercise {ex} has an empty solution block"
            count += 1
    assert count >= 30
