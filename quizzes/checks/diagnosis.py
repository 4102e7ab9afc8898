"""``diagnose``: when a student's value differs from the reference, say what kind of
difference it is, if it is a simple one: the first rung of the hint ladder (see ``core``).

What it can see, in this order:
- the sign is flipped (yours = −reference);
- a unit slip (yours = 10³, 10⁶, 10⁹ or 10¹² × the reference, or 1/that; GiB against GB;
  a percentage against a fraction);
- a constant factor, named (2×, 1/2, √2, 0.7071×): for arrays, the same factor everywhere;
  for a single number, only a simple factor (an integer or 1/integer up to 16, or √2);
- a constant offset (yours − reference is the same everywhere: a missing or extra additive
  term), or a difference equal to one of the inputs of the case (``inputs``);
- a transposed shape (``diagnose_shape``): yours is the reference with its last two
  dimensions swapped.

It names the kind of slip, never the formula. Returns "" when the difference is not simple.
Invariants: never raises (anything odd gives ""); reads values through ``values._as_numpy``
(no torch import here).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..units import BINARY_SLIPS, DECIMAL_SLIPS
from .values import _as_numpy, _is_tensor

__all__ = ["diagnose", "diagnose_shape", "name_factor"]


def _numeric(x: Any) -> np.ndarray | None:
    try:
        if _is_tensor(x) or isinstance(x, np.ndarray):
            a = _as_numpy(x)
        elif isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
            a = np.asarray(float(x))
        else:
            return None
        if a.dtype.kind not in "biuf":
            return None
        a = a.astype(np.float64)
        return a if np.isfinite(a).all() else None
    except Exception:
        return None


def _close(a: np.ndarray, b: np.ndarray, rtol: float = 1e-3) -> bool:
    scale = max(float(np.abs(b).max(initial=0.0)), float(np.abs(a).max(initial=0.0)), 1e-30)
    return bool(np.allclose(a, b, rtol=rtol, atol=1e-6 * scale))


def name_factor(c: float, single: bool = False) -> str:
    """A sentence naming yours/reference = c, or "" when c is not a simple factor.
    ``single``: c comes from one number, so only simple factors count (any ratio would fit)."""
    if c == 0 or not np.isfinite(c):
        return ""
    if c < 0:
        rest = name_factor(-c, single)
        return f"the sign is flipped, and {rest}" if rest else ""
    for f, word in DECIMAL_SLIPS.items():
        for k, direction in ((f, "larger"), (1 / f, "smaller")):
            if abs(c / k - 1) < 1e-3:
                return f"yours is {word} times {direction} than the reference: a unit slip (s and ms, bytes and GB, ...)?"
    for f, word in BINARY_SLIPS.items():
        if abs(c / f - 1) < 1e-4 or abs(c * f - 1) < 1e-4:
            return f"yours is off by {c:.4g}×: {word}? This course uses 10⁹ bytes per GB."
    if abs(c / 100 - 1) < 1e-3 or abs(c * 100 - 1) < 1e-3:
        return "yours is 100 times off: a percentage where a fraction is wanted, or the other way round?"
    for n in range(2, 17):
        if abs(c / n - 1) < 1e-3:
            return f"yours is {n}× the reference: off by a constant factor of {n} (too large)."
        if abs(c * n - 1) < 1e-3:
            return f"yours is 1/{n} of the reference: off by a constant factor of {n} (too small)."
    for n in (2, 3):
        r = n ** 0.5
        if abs(c / r - 1) < 1e-3 or abs(c * r - 1) < 1e-3:
            return (f"yours is {c:.4g}× the reference, a factor of √{n}: a square root too many, or one missing?")
    if single:
        return ""
    return f"yours is {c:.4g}× the reference everywhere: right up to a constant factor."


def diagnose(yours: Any, reference: Any, inputs: Sequence[tuple[str, Any]] = ()) -> str:
    """What kind of difference yours − reference is, or "" (see the module docstring)."""
    a, r = _numeric(yours), _numeric(reference)
    if a is None or r is None or a.shape != r.shape or not np.abs(r).max(initial=0.0) > 0:
        return ""
    single = a.size == 1
    if _close(a, -r):
        return "the sign is flipped: yours is −1 × the reference."
    nz = np.abs(r) > 1e-12 * np.abs(r).max()
    if nz.any():
        c = float((a[nz] * r[nz]).sum() / (r[nz] * r[nz]).sum())
        if abs(c - 1) > 1e-3 and _close(a, c * r):
            word = name_factor(c, single)
            if word:
                return word
    if single:
        return ""
    d = a - r
    for name, x in inputs:
        if tuple(getattr(x, "shape", (None,))) != d.shape:  # cheap test first: inputs may be large
            continue
        xv = _numeric(x)
        if xv is None or xv.shape != d.shape or not np.abs(xv).max(initial=0.0) > 0:
            continue
        if _close(d, -xv):
            return f"yours − reference = −{name} exactly: a term made of {name} is missing."
        if _close(d, xv):
            return f"yours − reference = {name} exactly: one term too many, made of {name}."
    if np.ptp(d) <= 1e-6 * max(float(np.abs(r).max()), 1e-30) and abs(float(d.mean())) > 1e-6 * float(np.abs(r).max()):
        return (f"yours − reference = {float(d.mean()):.4g} everywhere: a constant offset, so a missing or extra "
                "additive term.")
    return ""


def diagnose_shape(yours: Any, reference: Any) -> str:
    """"" unless yours is the reference with its last two dimensions swapped."""
    a, r = _numeric(yours), _numeric(reference)
    if a is None or r is None or a.ndim < 2 or a.shape == r.shape or a.shape != r.shape[:-2] + r.shape[-2:][::-1]:
        return ""
    if _close(np.swapaxes(a, -1, -2), r):
        return "yours is the reference transposed: its last two dimensions are swapped."
    return ""
