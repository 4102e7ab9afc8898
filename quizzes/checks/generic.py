"""Checks any lab may use, with plain PyTorch references. Also the examples the
machinery's own tests run (tests/test_checks_core.py, tests/fixtures/00-demo.ipynb).

Each check is one random case; the framework repeats it with fresh seeds.
"""

from __future__ import annotations

from .core import Case, register


@register(cases=3)
def softmax(case: Case, fn) -> None:
    """Your softmax(x) over the last dimension against torch.softmax, on inputs with
    large entries (a softmax that skips subtracting the max overflows)."""
    import torch

    x = case.randn(case.size(1, 5), case.size(2, 33)) * 4
    x[0, 0] = 90.0  # exp(90) overflows float32: only a max-subtracted softmax survives
    case.compare(case.call(fn, x), torch.softmax(x, dim=-1), atol=1e-6, rtol=1e-5)


@register(cases=3)
def matvec(case: Case, fn) -> None:
    """Your matvec(W, x) = W @ x for W of shape (n, k), x of shape (k,): one decode step's
    work for one weight matrix."""
    import torch

    n, k = case.size(1, 48), case.size(1, 64)
    w, x = case.randn(n, k), case.randn(k)
    case.compare(case.call(fn, w, x), w @ x, atol=1e-4, rtol=1e-4)


@register(cases=3)
def greedy_pick(case: Case, fn) -> None:
    """Your greedy_pick(logits) for logits of shape (batch, vocab): the index of the
    largest logit per row, as an int64 tensor of shape (batch,)."""
    logits = case.randn(case.size(1, 6), case.size(5, 300))
    case.compare(case.call(fn, logits), logits.argmax(dim=-1), what="token ids")
