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

Invariants:
- Inputs are fresh on every call (a new base seed, printed on failure; pass
  ``seed=`` to reproduce) and never all zeros (``randn`` draws are nonzero).
- The student's function gets copies of the inputs (``case.call`` deep-copies by
  default), so an in-place bug cannot corrupt the reference computation.
- Every failure message says what differs, where, by how much, and what to try.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import secrets
import sys
import traceback
from typing import Any, Callable

import numpy as np

__all__ = [
    "CheckFailed",
    "NotImplementedYet",
    "Case",
    "register",
    "registry",
    "compare",
    "describe",
]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CheckFailed(AssertionError):
    """A check found a difference. Shown in Jupyter as its message only."""

    def _render_traceback_(self) -> list[str]:  # IPython hook: replaces the traceback
        return str(self).splitlines()


class NotImplementedYet(CheckFailed):
    """The student's function is still the stub that raises NotImplementedError."""


class _Difference(Exception):
    """Raised inside a case by compare/expect; the runner adds the case header."""


# ----------------------------------------------------------------- describing values


def _is_tensor(x: Any) -> bool:
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


def describe(x: Any) -> str:
    """Short description of a value: 'float32[4, 7]', 'int 5', 'list[3]'."""
    if _is_tensor(x):
        dev = "" if x.device.type == "cpu" else f" on {x.device}"
        return f"{str(x.dtype).replace('torch.', '')}[{', '.join(map(str, x.shape))}]{dev}"
    if isinstance(x, np.ndarray):
        return f"ndarray {x.dtype}[{', '.join(map(str, x.shape))}]"
    if isinstance(x, bool) or x is None:
        return repr(x)
    if isinstance(x, (int, float, np.integer, np.floating)):
        return f"{type(x).__name__} {x!r}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(describe(v) for v in x[:3]) + (", ..." if len(x) > 3 else "")
        return f"{type(x).__name__}[{len(x)}]({inner})"
    if isinstance(x, dict):
        return f"dict with keys {sorted(map(str, x))[:6]}"
    if isinstance(x, str):
        return repr(x if len(x) < 40 else x[:37] + "...")
    return type(x).__name__


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return repr(v.item() if hasattr(v, "item") else v)


def _index(flat: int, shape: tuple[int, ...]) -> str:
    if not shape:
        return "[]"
    return "[" + ", ".join(str(int(i)) for i in np.unravel_index(flat, shape)) + "]"


# ----------------------------------------------------------------- comparison


def _as_numpy(x: Any) -> np.ndarray:
    if _is_tensor(x):
        x = x.detach().to("cpu")
        if x.is_floating_point() and x.dtype.itemsize < 4:  # bf16/fp16 have no exact numpy twin
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _shape_hint(got: tuple[int, ...], want: tuple[int, ...]) -> str:
    if len(got) == len(want) and sorted(got) == sorted(want) and got != want:
        return " The same sizes in another order: a transpose or a permute in the wrong place?"
    if int(np.prod(got)) == int(np.prod(want)):
        return " Same number of elements: a reshape/view in the wrong order?"
    if len(got) == len(want) - 1:
        return " One dimension missing: did a sum/max drop a dim (keepdim=True)?"
    if len(got) == len(want) + 1 and 1 in got:
        return " One extra dimension of size 1: squeeze it, or index it away."
    return ""


def compare(yours: Any, reference: Any, what: str = "output", *, atol: float = 1e-5, rtol: float = 1e-5,
            check_dtype: bool = True, show: bool = False) -> None:
    """Raise _Difference (turned into CheckFailed by the runner) if ``yours`` differs.

    Tensors and arrays: type, shape, dtype, device, then values (integers and
    booleans exactly; floats with |yours - ref| <= atol + rtol * |ref|, NaN only
    where the reference has NaN). Tuples, lists and dicts are compared item by
    item. ``show=True`` adds a text view of yours vs reference around the first
    mismatch (see ``show_mismatch``).
    """
    if isinstance(reference, (tuple, list)):
        if not isinstance(yours, (tuple, list)):
            raise _Difference(f"{what}: expected a {type(reference).__name__} of {len(reference)} items, "
                              f"got {describe(yours)}.")
        if len(yours) != len(reference):
            raise _Difference(f"{what}: expected {len(reference)} items, got {len(yours)}.")
        for i, (y, r) in enumerate(zip(yours, reference)):
            compare(y, r, f"{what}[{i}]", atol=atol, rtol=rtol, check_dtype=check_dtype, show=show)
        return
    if isinstance(reference, dict):
        if not isinstance(yours, dict):
            raise _Difference(f"{what}: expected a dict, got {describe(yours)}.")
        if set(yours) != set(reference):
            missing, extra = sorted(set(reference) - set(yours)), sorted(set(yours) - set(reference))
            raise _Difference(f"{what}: keys differ (missing {missing}, unexpected {extra}).")
        for k in reference:
            compare(yours[k], reference[k], f"{what}[{k!r}]", atol=atol, rtol=rtol, check_dtype=check_dtype,
                    show=show)
        return
    ref_is_array = _is_tensor(reference) or isinstance(reference, np.ndarray)
    if not ref_is_array:
        _compare_scalar(yours, reference, what, atol, rtol)
        return
    want_kind = "torch.Tensor" if _is_tensor(reference) else "numpy.ndarray"
    if _is_tensor(reference) != _is_tensor(yours) or (not _is_tensor(yours) and not isinstance(yours, np.ndarray)):
        raise _Difference(f"{what}: expected a {want_kind}, got {describe(yours)}.")
    got_shape, want_shape = tuple(yours.shape), tuple(reference.shape)
    if got_shape != want_shape:
        raise _Difference(f"{what} shape: expected {want_shape}, got {got_shape}.{_shape_hint(got_shape, want_shape)}")
    if check_dtype and yours.dtype != reference.dtype:
        raise _Difference(f"{what} dtype: expected {str(reference.dtype).replace('torch.', '')}, "
                          f"got {str(yours.dtype).replace('torch.', '')}. Convert with .to(...) or keep the input's dtype.")
    if _is_tensor(reference) and yours.device != reference.device:
        raise _Difference(f"{what} device: expected {reference.device}, got {yours.device}.")
    a, b = _as_numpy(yours), _as_numpy(reference)
    if a.dtype.kind in "biu" and b.dtype.kind in "biu":
        bad = a != b
        tolerance = "exact match required (integers)"
    else:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        bad = ~np.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
        tolerance = f"allowed |yours − reference| ≤ {atol:g} + {rtol:g}·|reference|"
    if not bad.any():
        return
    n_bad = int(bad.sum())
    first = int(np.flatnonzero(bad.ravel())[0])
    af, bf = a.ravel(), b.ravel()
    lines = [f"{what} values differ from the reference in {n_bad} of {bad.size} elements.",
             f"  first mismatch at {_index(first, got_shape)}: yours {_fmt(af[first])}, reference {_fmt(bf[first])}"]
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        err = np.abs(a.astype(np.float64) - b.astype(np.float64))
        err = np.where(np.isnan(err), np.inf, err).ravel()
        worst = int(np.argmax(err))
        lines.append(f"  max error {err[worst]:.3g} at {_index(worst, got_shape)}; {tolerance}")
        if np.isnan(af).any() and not np.isnan(bf).any():
            lines.append("  yours contains NaN: a division by zero, or exp() of a large number (subtract the max first)?")
    else:
        lines.append(f"  {tolerance}")
    if show:
        from .mismatch import show_mismatch

        lines.append(show_mismatch(yours, reference, atol=atol, rtol=rtol).text())
    raise _Difference("\n".join(lines))


def _compare_scalar(yours: Any, reference: Any, what: str, atol: float, rtol: float) -> None:
    if _is_tensor(yours) and yours.numel() == 1:
        yours = yours.item()
    if isinstance(yours, np.ndarray) and yours.size == 1:
        yours = yours.item()
    if isinstance(reference, (bool, np.bool_)) or isinstance(reference, str) or reference is None:
        if yours != reference:
            raise _Difference(f"{what}: expected {reference!r}, got {_fmt(yours) if yours is not None else None}.")
        return
    if not isinstance(yours, (int, float, np.integer, np.floating)) or isinstance(yours, bool):
        raise _Difference(f"{what}: expected a number, got {describe(yours)}.")
    if isinstance(reference, (int, np.integer)) and not isinstance(reference, bool):
        if yours != reference:
            raise _Difference(f"{what}: expected {reference}, got {_fmt(yours)}.")
        return
    if not np.isclose(float(yours), float(reference), rtol=rtol, atol=atol, equal_nan=True):
        raise _Difference(f"{what}: expected {_fmt(reference)}, got {_fmt(yours)} "
                          f"(error {abs(float(yours) - float(reference)):.3g}; allowed {atol:g} + {rtol:g}·|reference|).")


# ----------------------------------------------------------------- one random case


def _fresh_seed() -> int:
    env = os.environ.get("QUIZZES_SEED")
    return int(env) if env else secrets.randbits(31)


def _student_frame(tb: Any) -> str:
    """'line 4 of your code: return x / s' for the deepest frame outside library code."""
    lib_roots = tuple({_PKG_DIR, sys.prefix, sys.base_prefix, os.path.dirname(os.__file__)})
    found = None
    for fs in traceback.extract_tb(tb):
        fname = os.path.abspath(fs.filename) if not fs.filename.startswith("<") else fs.filename
        if fname.startswith(lib_roots) and "ipykernel_" not in fname:
            continue
        found = fs
    if found is None:
        return ""
    where = "your code" if ("ipykernel_" in found.filename or found.filename.startswith("<")) else os.path.basename(found.filename)
    line = f": {found.line.strip()}" if found.line else ""
    return f"line {found.lineno} of {where} ({found.name}){line}"


class Case:
    """One random case of a check: random inputs, the student's call, comparisons."""

    def __init__(self, check: str, index: int, total: int, seed: int):
        self.check, self.index, self.total, self.seed = check, index, total, seed
        self.rng = np.random.default_rng(seed)
        self._gen = None
        self.inputs: list[str] = []  # descriptions of the last call's arguments

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
        self.inputs = _describe_args(fn, args, kwargs)
        if copy_args:
            args, kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as exc:
            raise NotImplementedYet(_not_implemented_message(self.check, exc)) from None
        except (_Difference, CheckFailed):
            raise
        except Exception as exc:
            where = _student_frame(exc.__traceback__)
            msg = f"your function raised {type(exc).__name__}: {exc}"
            if where:
                msg += f"\n  at {where}"
            raise _Difference(msg) from None

    def compare(self, yours: Any, reference: Any, what: str = "output", **kw: Any) -> None:
        compare(yours, reference, what, **kw)

    def expect(self, condition: bool, message: str) -> None:
        """Fail with ``message`` (which should say what is wrong and what to do) unless condition."""
        if not condition:
            raise _Difference(message)


def _describe_args(fn: Callable, args: tuple, kwargs: dict) -> list[str]:
    names: list[str]
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
        return [f"{k}: {describe(v)}" for k, v in bound.arguments.items()]
    except (TypeError, ValueError):
        names = [f"arg{i}" for i in range(len(args))]
        return [f"{n}: {describe(v)}" for n, v in zip(names, args)] + [f"{k}: {describe(v)}" for k, v in kwargs.items()]


def _not_implemented_message(check: str, exc: BaseException) -> str:
    msg = f"✗ {check}: not implemented yet — fill in the cell above, run it, then run this check again."
    hint = str(exc).strip()
    if hint:
        msg += f"\n  Hint: {hint}"
    return msg


# ----------------------------------------------------------------- registration

registry: dict[str, Callable[..., None]] = {}
_RESERVED = {"register", "registry", "compare", "describe", "show_mismatch", "Case", "CheckFailed",
             "NotImplementedYet", "core", "mismatch", "available"}


def register(fn: Callable | None = None, *, cases: int = 3, name: str | None = None,
             success: str = "matches the reference on {n} random cases") -> Any:
    """Register ``fn(case, *student_objects)`` as ``check.<name>``. Usable bare or with arguments."""

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
                    raise CheckFailed(f"{head}: {body_text}{inputs}{tail}") from None
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
        registry[check_name] = run
        return run

    return wrap(fn) if fn is not None else wrap
