"""The check framework (quizzes.checks): messages for every way a student's function
can be wrong, fresh inputs per call, and registration. Toy references only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from quizzes import check
from quizzes.checks import CheckFailed, NotImplementedYet, attempts, compare, register, registry, show_mismatch
from quizzes.checks.core import _Difference


def good_softmax(x):
    z = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return z / z.sum(dim=-1, keepdim=True)


def failure(fn, *args, **kw) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(*args, **kw)
    return str(info.value)


# ------------------------------------------------------------------ outcomes


def test_pass_prints_one_line(capsys):
    check.softmax(good_softmax)
    assert capsys.readouterr().out == "✓ softmax: matches the reference on 3 random cases\n"


def test_value_mismatch_names_position_values_and_tolerance():
    msg = failure(check.softmax, lambda x: good_softmax(x) * 1.01, seed=3)
    assert msg.startswith("✗ softmax: case 1 of 3 (seed 3): output values differ from the reference")
    assert "first mismatch at [0, 0]: yours" in msg and "reference" in msg
    assert "max error" in msg and "allowed |yours − reference| ≤ 1e-06 + 1e-05·|reference|" in msg
    assert "inputs: x: float32[" in msg
    assert "check.softmax(..., seed=3, cases=1)" in msg


def test_overflowing_softmax_gets_the_nan_hint():
    msg = failure(check.softmax, lambda x: torch.exp(x) / torch.exp(x).sum(-1, keepdim=True))
    assert "yours nan" in msg and "subtract the max first" in msg


def test_wrong_shape_and_dtype_say_expected_and_got():
    assert "output shape: expected (" in failure(check.softmax, lambda x: good_softmax(x)[:, :1])
    assert "got (" in failure(check.softmax, lambda x: good_softmax(x)[:, :1])
    msg = failure(check.softmax, lambda x: good_softmax(x.double()))
    assert "output dtype: expected float32, got float64" in msg
    msg = failure(check.greedy_pick, lambda logits: logits.argmax(-1).tolist())
    assert "token ids: expected a torch.Tensor, got list" in msg


def test_stub_reports_not_implemented_with_its_hint():
    def softmax(x):
        raise NotImplementedError("subtract the row max first")

    with pytest.raises(NotImplementedYet) as info:
        check.softmax(softmax)
    msg = str(info.value)
    assert msg.startswith("✗ softmax: not implemented yet — fill in the cell above")
    assert "Hint: subtract the row max first" in msg
    assert isinstance(info.value, AssertionError)  # nbval and the grader see a failure


def test_exception_in_student_code_reports_type_line_and_shapes():
    def matvec(w, x):
        rows = w.shape[0]
        return w[rows + 1] @ x  # IndexError

    msg = failure(check.matvec, matvec)
    assert "your function raised IndexError" in msg
    assert "return w[rows + 1] @ x" in msg and "(matvec)" in msg
    assert "inputs: w: float32[" in msg and ", x: float32[" in msg


def test_passing_a_value_instead_of_the_function():
    msg = failure(check.softmax, torch.zeros(3))
    assert "expected a function, got float32[3]" in msg and "check.softmax(my_fn)" in msg


def test_failures_render_without_traceback_in_ipython():
    with pytest.raises(CheckFailed) as info:
        check.softmax(lambda x: x)
    assert info.value._render_traceback_() == str(info.value).splitlines()


# ------------------------------------------------------------------ inputs


def test_inputs_are_fresh_per_call_reproducible_by_seed_and_not_zeros():
    seen = []

    def spy(x):
        seen.append(x.clone())
        return good_softmax(x)

    check.softmax(spy)
    check.softmax(spy)
    assert len(seen) == 6
    assert not torch.equal(seen[0], seen[3])  # a new call, new inputs
    assert all(s.count_nonzero() == s.numel() for s in seen)  # random normals: no zeros
    again = []
    check.softmax(lambda x: again.append(x.clone()) or good_softmax(x), seed=11)
    check.softmax(lambda x: again.append(x.clone()) or good_softmax(x), seed=11)
    assert all(torch.equal(a, b) for a, b in zip(again[:3], again[3:]))


def test_student_gets_copies_so_in_place_bugs_do_not_corrupt_the_reference():
    def softmax_then_clobber(x):
        y = good_softmax(x)
        x.zero_()
        return y

    check.softmax(softmax_then_clobber)


# ------------------------------------------------------------------ compare


def test_compare_integers_are_exact_and_floats_use_tolerance():
    compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7]))
    with pytest.raises(_Difference, match="exact match required"):
        compare(torch.tensor([1, 2]), torch.tensor([1, 3]))


def test_compare_containers_and_scalars():
    compare((torch.ones(2), 3), (torch.ones(2), 3))
    with pytest.raises(_Difference, match=r"output\[1\]: expected 3, got 4"):
        compare((torch.ones(2), 4), (torch.ones(2), 3))
    with pytest.raises(_Difference, match="expected 2 items, got 1"):
        compare([1.0], [1.0, 2.0])
    with pytest.raises(_Difference, match=r"keys differ \(missing \['v'\]"):
        compare({"k": 1}, {"k": 1, "v": 2})
    with pytest.raises(_Difference, match="expected 0.5, got 0.6"):
        compare(0.6, 0.5, "p")
    compare(torch.tensor(0.5), 0.5)  # a 0-d tensor is fine where a number is expected
    with pytest.raises(_Difference, match="expected a number, got '0.5'"):
        compare("0.5", 0.5)


def test_compare_shape_hints():
    with pytest.raises(_Difference, match="transpose"):
        compare(torch.zeros(3, 2), torch.zeros(2, 3))
    with pytest.raises(_Difference, match="keepdim=True"):
        compare(torch.zeros(4), torch.zeros(4, 3))


def test_compare_numpy_and_bfloat16():
    compare(np.arange(3.0), np.arange(3.0))
    with pytest.raises(_Difference, match="expected a numpy.ndarray"):
        compare(torch.arange(3.0), np.arange(3.0))
    x = torch.randn(4, 4).bfloat16()
    compare(x.clone(), x)


# ------------------------------------------------------------------ show_mismatch


def test_show_mismatch_marks_bad_cells_and_rows():
    ref = torch.arange(12.0).reshape(3, 4)
    yours = ref.clone()
    yours[1, 2] = 99.0
    view = show_mismatch(yours, ref)
    text = view.text()
    assert "1 of 12 elements differ" in text
    bad_lines = [ln for ln in text.splitlines() if ln.startswith("✗")]
    assert len(bad_lines) == 1 and "[1]" in bad_lines[0] and "99*" in bad_lines[0]
    html = view._repr_html_()
    assert html.count("background:#f8d7da") == 1 and "quiz-mismatch" in html
    assert "shapes differ" in show_mismatch(torch.zeros(2), torch.zeros(3)).text()


def test_show_mismatch_windows_large_inputs_around_the_first_mismatch():
    ref = torch.zeros(100, 50)
    yours = ref.clone()
    yours[70, 40] = 1.0
    text = show_mismatch(yours, ref, max_rows=5, max_cols=4).text()
    assert "rows 69-73 of 100" in text and "cols 39-42 of 50" in text
    assert "[70]" in text


def test_compare_can_include_the_view():
    with pytest.raises(_Difference, match=r"yours \(\* = differs\)"):
        compare(torch.ones(2, 2), torch.zeros(2, 2), show=True)


# ------------------------------------------------------------------ registration


def test_register_a_toy_check_and_use_it_through_check(capsys):
    @register(cases=2, name="toy_double")
    def _toy(case, fn):
        x = case.randn(case.size(1, 4))
        case.expect(x.abs().sum() > 0, "inputs must not be zeros")
        case.compare(case.call(fn, x), 2 * x)

    try:
        check.toy_double(lambda x: x + x)
        assert capsys.readouterr().out == "✓ toy_double: matches the reference on 2 random cases\n"
        assert "toy_double" in dir(check) and "toy_double" in check.available()
        with pytest.raises(CheckFailed, match="case 1 of 2"):
            check.toy_double(lambda x: x)
    finally:
        registry.pop("toy_double", None)


def test_register_hint_is_the_concept_shown_from_the_second_wrong_attempt():
    @register(cases=1, name="toy_hinted", hint="doubling: every element counts twice")
    def _toy(case, fn):
        x = case.randn(3)
        case.compare(case.call(fn, x), 2 * x)

    def stub(x):
        raise NotImplementedError("double it")

    try:
        with pytest.raises(NotImplementedYet) as info:
            check.toy_hinted(stub)
        assert "Hint: double it" in str(info.value) and "every element" not in str(info.value)
        first = failure(check.toy_hinted, lambda x: x)
        assert "Concept:" not in first and "Diagnosis: yours is 1/2 of the reference" in first
        wrong = failure(check.toy_hinted, lambda x: x)
        assert "Concept: doubling: every element counts twice" in wrong
        assert wrong.index("Concept:") < wrong.index("reproduce:")  # before the reproduce line
        check.toy_hinted(lambda x: x + x)  # a right answer prints no hint
    finally:
        registry.pop("toy_hinted", None)
        attempts.pop("toy_hinted", None)


def test_a_bug_in_the_check_itself_is_labelled_as_such():
    @register(name="toy_broken")
    def _broken(case, fn):
        raise KeyError("oops")

    try:
        msg = failure(check.toy_broken, lambda: None)
        assert "the check itself failed (KeyError" in msg and "not in your code" in msg
    finally:
        registry.pop("toy_broken", None)


def test_registration_rejects_reserved_and_duplicate_names():
    with pytest.raises(ValueError, match="reserved"):
        register(lambda case, fn: None, name="compare")

    def softmax(case, fn):
        pass

    softmax.__module__ = "quizzes.checks.lab99"
    with pytest.raises(ValueError, match="two checks are named 'softmax'"):
        register(softmax)


def test_unknown_check_lists_the_available_ones():
    with pytest.raises(AttributeError, match="no check named 'kv_apend'.*softmax"):
        check.kv_apend


def test_import_quizzes_does_not_import_torch():
    code = "import sys, quizzes; quizzes.check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_a_triton_compile_error_names_the_students_own_error(tmp_path):
    # On a GPU a @triton.jit mistake arrives as Triton's compile errors nested around the
    # student's NameError (the H100 run of 2026-11-27: "raised CompilationError: at 20:20"
    # pointing at the lab kernel's call, not at the student's line). Compiled here for sm_90
    # with Triton's real front end, no GPU needed: a NameError in the student's function, a
    # failed tl.static_assert in it (a CompilationError subclass), and a function returning
    # two values where the kernel unpacks three (the error is the kernel's, not theirs).
    pytest.importorskip("triton")
    code = textwrap.dedent('''
        import torch
        torch.cuda.is_available = lambda: True  # compiled kernels, not interpreted ones
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from quizzes.checks.raised import raised_message

        @triton.jit
        def undefined(acc):
            acc = acc + undefined_name
            return acc, acc, acc

        @triton.jit
        def asserts(acc):
            tl.static_assert(acc.shape[0] == 32, "BLOCK must be 32")
            return acc, acc, acc

        @triton.jit
        def two_values(acc):
            return acc, acc

        @triton.jit
        def kernel(X, LOOP: tl.constexpr, N: tl.constexpr):
            offs = tl.arange(0, N)
            a, b, c = LOOP(tl.load(X + offs))
            tl.store(X + offs, a + b + c)

        for loop in (undefined, asserts, two_values):
            try:
                triton.compile(ASTSource(kernel, {"X": "*fp32", "LOOP": "constexpr",
                                                  "N": "constexpr"}, {"LOOP": loop, "N": 16}),
                               target=GPUTarget("cuda", 90, 32))
            except Exception as exc:
                print("=====", type(exc).__name__)
                print(raised_message(exc))
    ''')
    script = tmp_path / "compile_student_loop.py"  # @triton.jit needs its source in a file
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0",
                              "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = [c.split("\n", 1) for c in out.stdout.split("===== ")[1:]]
    assert [kind for kind, _ in cases] == ["CompilationError"] * 3, out.stdout  # as received
    named, asserted, arity = (msg for _, msg in cases)
    assert named.startswith("your function raised NameError: undefined_name is not defined")
    assert "at your line" in named and "acc = acc + undefined_name" in named, named
    assert asserted.startswith("your function failed to compile (Triton): at 2:4:"), asserted
    assert "BLOCK must be 32" in asserted and "def asserts(acc):" in asserted, asserted
    assert arity.startswith("Triton could not compile the kernel around your function"), arity
    assert "your line" not in arity and "a, b, c = LOOP(" in arity, arity


def test_an_ordinary_error_is_reported_as_raised():
    from quizzes.checks.raised import raised_message

    try:
        {}["k"]
    except KeyError as exc:
        assert raised_message(exc).startswith("your function raised KeyError: 'k'")
