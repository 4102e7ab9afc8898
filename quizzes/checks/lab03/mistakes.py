"""When does a known mistake explain a student's numbers? The test the lab 03 checks use
before they name a mistake in a failure message.

A mistake is named only when its output (computed on the student's inputs) equals the
student's everywhere it is a number, and differs from the reference somewhere there: a
mistake that would not show on these inputs is never blamed.

Also here, because that test is made of them: ``_isclose``/``_same`` (closeness in
float64, NaN equal to NaN) and ``_is_tensor``, which the lab 03 checks share.
"""

from __future__ import annotations


def _isclose(a, b, atol: float, rtol: float):
    import torch

    return torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=True)


def _same(a, b, atol: float, rtol: float) -> bool:
    return tuple(a.shape) == tuple(b.shape) and bool(_isclose(a, b, atol, rtol).all())


def _reproduces(yours, variant, reference, atol: float, rtol: float) -> bool:
    """Does ``variant`` (a known mistake) explain ``yours``? It must equal yours wherever
    the variant is a number, and differ from the reference somewhere there."""
    import torch

    if tuple(yours.shape) != tuple(variant.shape):
        return False
    defined = ~torch.isnan(variant.double())
    if not bool(defined.any()):
        return False
    if bool(_isclose(variant[defined], reference[defined], atol, rtol).all()):
        return False  # this mistake would not show on these inputs
    return bool(_isclose(yours[defined], variant[defined], atol, rtol).all())


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)
