"""``compare``: is a student's value the reference's, and if not, what exactly differs.

Checks call it as ``case.compare(yours, reference, ...)``. A difference raises
``_Difference`` with the message alone; the runner in ``core`` adds the case header, the
inputs and the seed, and turns it into ``CheckFailed``.

Order of the questions asked, so the first message names the first thing to fix: the
type (tensor, array, number, list, dict), the shape (with a hint when the sizes are
permuted or reshaped), the dtype, the device, then the values (integers exactly, floats
within ``atol + rtol·|reference|``, NaN only where the reference has NaN).

A value difference also carries ``diagnosis`` (see ``diagnosis.diagnose``: a flipped sign,
a unit slip, a constant factor or offset, a transpose), which the runner in ``core`` shows
as the first rung of the hint ladder; it is not part of the message.

Imports ``values``, ``mismatch`` and ``diagnosis`` only; ``core`` imports this module, never
the reverse.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .diagnosis import diagnose, diagnose_shape
from .mismatch import show_mismatch
from .values import _as_numpy, _fmt, _index, _is_tensor, describe

__all__ = ["compare"]


class _Difference(Exception):
    """Raised inside a case by compare/expect; the runner adds the case header.
    ``diagnosis``: what kind of difference it is, when ``compare`` could tell ("" otherwise)."""

    diagnosis = ""

    def __init__(self, message: str, diagnosis: str = ""):
        super().__init__(message)
        if diagnosis:
            self.diagnosis = diagnosis


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
            check_dtype: bool = True, show: bool = False, inputs: Sequence[tuple[str, Any]] = ()) -> None:
    """Raise _Difference (turned into CheckFailed by the runner) if ``yours`` differs.

    Tensors and arrays: type, shape, dtype, device, then values (integers and
    booleans exactly; floats with |yours - ref| <= atol + rtol * |ref|, NaN only
    where the reference has NaN). Tuples, lists and dicts are compared item by
    item. ``show=True`` adds a text view of yours vs reference around the first
    mismatch (see ``show_mismatch``). ``inputs`` (the function's (name, value) arguments)
    lets the diagnosis name a difference equal to one of them: a missing or extra term.
    """
    if isinstance(reference, (tuple, list)):
        if not isinstance(yours, (tuple, list)):
            raise _Difference(f"{what}: expected a {type(reference).__name__} of {len(reference)} items, "
                              f"got {describe(yours)}.")
        if len(yours) != len(reference):
            raise _Difference(f"{what}: expected {len(reference)} items, got {len(yours)}.")
        for i, (y, r) in enumerate(zip(yours, reference)):
            compare(y, r, f"{what}[{i}]", atol=atol, rtol=rtol, check_dtype=check_dtype, show=show, inputs=inputs)
        return
    if isinstance(reference, dict):
        if not isinstance(yours, dict):
            raise _Difference(f"{what}: expected a dict, got {describe(yours)}.")
        if set(yours) != set(reference):
            missing, extra = sorted(set(reference) - set(yours)), sorted(set(yours) - set(reference))
            raise _Difference(f"{what}: keys differ (missing {missing}, unexpected {extra}).")
        for k in reference:
            compare(yours[k], reference[k], f"{what}[{k!r}]", atol=atol, rtol=rtol, check_dtype=check_dtype,
                    show=show, inputs=inputs)
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
        raise _Difference(f"{what} shape: expected {want_shape}, got {got_shape}.{_shape_hint(got_shape, want_shape)}",
                          diagnose_shape(yours, reference))
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
        lines.append(show_mismatch(yours, reference, atol=atol, rtol=rtol).text())
    raise _Difference("\n".join(lines), diagnose(yours, reference, inputs))


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
            raise _Difference(f"{what}: expected {reference}, got {_fmt(yours)}.", diagnose(yours, reference))
        return
    if not np.isclose(float(yours), float(reference), rtol=rtol, atol=atol, equal_nan=True):
        raise _Difference(f"{what}: expected {_fmt(reference)}, got {_fmt(yours)} "
                          f"(error {abs(float(yours) - float(reference)):.3g}; allowed {atol:g} + {rtol:g}·|reference|).",
                          diagnose(yours, reference))
