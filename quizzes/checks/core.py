"""The check framework: run a student's function against a reference on fresh
random inputs and explain any difference.

A lab registers checks with ``@register``; the student calls them as
``check.<name>(their_function)``. One check function describes ONE random case;
the framework runs it ``cases`` times with different seeds:

    @register(cases=3)
    def softmax(case, fn):
        "softmax(x) over the last dimension."
        x = case.randn(case.size(1, 5), case.size(2, 33)) * 3
        case.compare(case.call(fn, x), torch.softmax(x, dim=-1), atol=1e-6)

Outcomes:
- success: prints one line, ``✓ softmax: matches the reference on 3 random cases``;
- failure: raises ``CheckFailed`` (an AssertionError, so nbval and the grader see
  it). In IPython/Jupyter it renders as the message alone, without a traceback.
  A stub that still raises NotImplementedError raises ``NotImplementedYet``.

The hint ladder: wrong attempts are counted per check name in this kernel session
(``attempts``). Every wrong attempt shows what is different plus, when the check can see
one, ``Diagnosis:`` the kind of slip (a flipped sign, a unit slip, a named constant factor,
a constant offset or a term equal to an input, a transpose; ``diagnosis.py``) and
``Hint:`` the check's ``nudge``; the second and later wrong attempts add ``Concept:`` its
``concept`` (the idea, never the formula). A stub's own ``# HINT:`` line is shown while it
is unimplemented; that is not an attempt.

Invariants:
- Inputs are fresh on every call (a new base seed, printed on failure; pass
  ``seed=`` to reproduce) and never all zeros (``randn`` draws are nonzero).
- The student's function gets copies of the inputs (``case.call`` deep-copies by
  default), so an in-place bug cannot corrupt the reference computation.
- Every failure message says what differs, where, by how much, and what to try.

This module holds the outcomes (``CheckFailed``, ``NotImplementedYet``), ``Case`` and
``register``. Comparing values is ``comparison.compare``, describing them
``values.describe``, the side-by-side view ``mismatch.show_mismatch``, what a student's
function raised ``raised.raised_message``. Imports run one way: core -> comparison ->
mismatch -> values, and core -> raised; none of them imports core.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import secrets
from typing import Any, Callable

import numpy as np

from .comparison import _Difference, compare
from .raised import raised_message
from .values import describe

__all__ = [
    "CheckFailed",
    "NotImplementedYet",
    "Case",
    "register",
    "registry",
    "attempts",
    "compare",
    "describe",
]

class CheckFailed(AssertionError):
    """A check found a difference. Shown in Jupyter as its message only."""

    def _render_traceback_(self) -> list[str]:  # IPython hook: replaces the traceback
        return str(self).splitlines()


class NotImplementedYet(CheckFailed):
    """The student's function is still the stub that raises NotImplementedError."""


# ----------------------------------------------------------------- one random case


def _fresh_seed() -> int:
    env = os.environ.get("QUIZZES_SEED")
    return int(env) if env else secrets.randbits(31)


class Case:
    """One random case of a check: random inputs, the student's call, comparisons."""

    def __init__(self, check: str, index: int, total: int, seed: int):
        self.check, self.index, self.total, self.seed = check, index, total, seed
        self.rng = np.random.default_rng(seed)
        self._gen = None
        self.inputs: list[str] = []  # descriptions of the last call's arguments
        self.arguments: list[tuple[str, Any]] = []  # the last call's arguments by name (the originals)

    # random inputs ------------------------------------------------------------
    @property
    def gen(self):
        """A torch.Generator seeded for this case."""
        if self._gen is None:
            import torch

            self._gen = torch.Generator().manual_seed(self.seed)
        return self._gen

    def size(self, low: int, high: int) -> int:
        """A random size in [low, high] (inclusive): catches hard-coded shapes."""
        return int(self.rng.integers(low, high + 1))

    def choice(self, options: Any) -> Any:
        options = list(options)
        return options[int(self.rng.integers(len(options)))]

    def randn(self, *shape: int, dtype: Any = None, device: Any = None):
        """Standard normal tensor (never all zeros)."""
        import torch

        x = torch.randn(*shape, generator=self.gen, dtype=torch.float32)
        return x.to(dtype=dtype or torch.float32, device=device or "cpu")

    def rand(self, *shape: int, dtype: Any = None, device: Any = None):
        import torch

        x = torch.rand(*shape, generator=self.gen, dtype=torch.float32)
        return x.to(dtype=dtype or torch.float32, device=device or "cpu")

    def randint(self, low: int, high: int, shape: tuple[int, ...], device: Any = None):
        import torch

        return torch.randint(low, high, tuple(shape), generator=self.gen).to(device or "cpu")

    # the student's code --------------------------------------------------------
    def call(self, fn: Any, *args: Any, copy_args: bool = True, **kwargs: Any) -> Any:
        """Call the student's function; turn its errors into clear messages."""
        if not callable(fn):
            raise _Difference(
                f"expected a function, got {describe(fn)}. Pass the function itself, "
                f"e.g. check.{self.check}(my_fn), not my_fn(...).")
        self.arguments = _bound_args(fn, args, kwargs)
        self.inputs = [f"{k}: {describe(v)}" for k, v in self.arguments]
        if copy_args:
            args, kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as exc:
            raise NotImplementedYet(_not_implemented_message(self.check, exc)) from None
        except (_Difference, CheckFailed):
            raise
        except Exception as exc:
            raise _Difference(raised_message(exc)) from None

    def compare(self, yours: Any, reference: Any, what: str = "output", **kw: Any) -> None:
        compare(yours, reference, what, inputs=self.arguments, **kw)

    def expect(self, condition: bool, message: str) -> None:
        """Fail with ``message`` (which should say what is wrong and what to do) unless condition."""
        if not condition:
            raise _Difference(message)


def _bound_args(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    try:
        return list(inspect.signature(fn).bind_partial(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):
        return [(f"arg{i}", v) for i, v in enumerate(args)] + list(kwargs.items())


def _not_implemented_message(check: str, exc: BaseException) -> str:
    msg = f"✗ {check}: not implemented yet — fill in the cell above, run it, then run this check again."
    hint = str(exc).strip()
    if hint:
        msg += f"\n  Hint: {hint}"
    return msg


# ----------------------------------------------------------------- registration

registry: dict[str, Callable[..., None]] = {}
#: Wrong attempts per check name in this kernel session (the hint ladder's counter).
attempts: dict[str, int] = {}
#: The framework's own modules: the package never loads them as a lab's checks, and a
#: check may not take their names (they are attributes of ``quizzes.checks``).
INFRA_MODULES = frozenset({"core", "comparison", "mismatch", "values", "diagnosis"})
_RESERVED = {"register", "registry", "compare", "describe", "show_mismatch", "Case", "CheckFailed",
             "NotImplementedYet", "available", "attempts"} | INFRA_MODULES


def _ladder(check_name: str, diagnosis: str, nudge: str, concept: str) -> str:
    """The hint lines under a wrong attempt (counted here): diagnosis and nudge, then the concept."""
    attempts[check_name] = attempts.get(check_name, 0) + 1
    lines = []
    if diagnosis:
        lines.append(f"\n  Diagnosis: {diagnosis}")
    if nudge:
        lines.append(f"\n  Hint: {nudge}")
    if concept and attempts[check_name] >= 2:
        lines.append(f"\n  Concept: {concept}")
    elif concept:
        lines.append("\n  (Wrong again? The next failure adds the concept behind this exercise.)")
    return "".join(lines)


def register(fn: Callable | None = None, *, cases: int = 3, name: str | None = None,
             success: str = "matches the reference on {n} random cases", hint: str = "", nudge: str = "",
             concept: str = "") -> Any:
    """Register ``fn(case, *student_objects)`` as ``check.<name>``. Usable bare or with arguments.

    The hint ladder (shown under a wrong attempt's failure, never under an unimplemented stub,
    whose own ``# HINT:`` line says where to start):
    ``nudge``: from the first wrong attempt on, "Hint: ...": what to look at (which quantity,
    which dimension, which unit), not how to compute it.
    ``concept``: from the second wrong attempt on, "Concept: ...": the idea behind the
    exercise. Neither may contain the formula or a line of the solution (tests/test_hints.py).
    ``hint``: the old name of ``concept`` (still accepted).
    """
    if hint and concept:
        raise ValueError("give concept= (hint= is its old name), not both")
    concept = concept or hint

    def wrap(body: Callable) -> Callable[..., None]:
        check_name = name or body.__name__
        if check_name in _RESERVED or check_name.startswith("_"):
            raise ValueError(f"check name {check_name!r} is reserved; pick another")
        if check_name in registry and registry[check_name].__wrapped__.__module__ != body.__module__:
            other = registry[check_name].__wrapped__.__module__
            raise ValueError(f"two checks are named {check_name!r} ({other} and {body.__module__}); rename one")

        @functools.wraps(body)
        def run(*student: Any, seed: int | None = None, cases: int = cases) -> None:
            base = _fresh_seed() if seed is None else int(seed)
            for i in range(cases):
                case = Case(check_name, i, cases, base + i)
                try:
                    body(case, *student)
                except NotImplementedYet:
                    raise
                except NotImplementedError as exc:  # the author called the stub directly
                    raise NotImplementedYet(_not_implemented_message(check_name, exc)) from None
                except _Difference as diff:
                    head = f"✗ {check_name}: case {i + 1} of {cases} (seed {case.seed})"
                    body_text = str(diff)
                    inputs = f"\n  inputs: {', '.join(case.inputs)}" if case.inputs else ""
                    tail = f"\n  reproduce: check.{check_name}(..., seed={case.seed}, cases=1)"
                    after = _ladder(check_name, diff.diagnosis, nudge, concept)
                    raise CheckFailed(f"{head}: {body_text}{inputs}{after}{tail}") from None
                except CheckFailed:
                    raise
                except Exception as exc:  # a bug in the check itself, not in the student's code
                    raise CheckFailed(
                        f"✗ {check_name}: the check itself failed ({type(exc).__name__}: {exc}). "
                        "This is a bug in the course, not in your code; please report it.") from exc
            print(f"✓ {check_name}: {success.format(n=cases)}")

        run.__doc__ = (body.__doc__ or f"Check {check_name}.") + (
            f"\n\nUsage: check.{check_name}(your_function). Runs {cases} random cases; "
            "pass seed=N to reproduce a failure.")
        run.nudge, run.concept = nudge, concept  # read by tests/test_hints.py
        registry[check_name] = run
        return run

    return wrap(fn) if fn is not None else wrap
