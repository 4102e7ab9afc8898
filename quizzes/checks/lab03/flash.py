"""Lab 03 check ``flash_inner_loop``: the student's ``@triton.jit`` inner loop, run inside
minillm's lab kernel (``minillm.kernels.lab.flash_attention_lab``), against naive attention
in float64.

Triton cannot compile a ``raise``, so a stub is found in the source and never launched.
Errors from the Triton interpreter are unwrapped to the student's own. Mistakes are named
with the same tile loop as ``tiled_attention`` (``attention.py``), walked with the lab
kernel's tiles.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import warnings

import numpy as np

from ..core import Case, register
from .attention import _ATT_TOL, _attention_inputs, _attention_mistakes, _compare_attention
from .mistakes import _is_tensor

__all__ = ["flash_inner_loop"]


_STUB = re.compile(r"^\s*raise\s+NotImplementedError\s*\((.*)\)\s*$", re.MULTILINE)


def _source(fn) -> str:
    try:
        return inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return getattr(fn, "src", "") or ""


def _stub_hint(fn) -> str | None:
    """The hint of a ``raise NotImplementedError("...")`` stub in fn's source, else None.

    Triton cannot compile a raise, so the stub is detected here and never launched."""
    m = _STUB.search(_source(fn))
    if m is None:
        return None
    try:
        return str(ast.literal_eval(m.group(1))) if m.group(1).strip() else ""
    except (ValueError, SyntaxError):
        return ""


def _unwrap_interpreter_error(exc: BaseException) -> BaseException:
    """Triton's interpreter wraps errors raised inside a kernel; return the original."""
    if type(exc).__name__ == "InterpreterError":
        inner = exc.__cause__ or exc.__context__
        while inner is not None and type(inner).__name__ == "InterpreterError":
            inner = inner.__cause__ or inner.__context__
        if inner is not None:
            return inner
    return exc


def _tolerance_for_device() -> dict:
    from minillm.kernels import interpreter_enabled

    # Compiled on a GPU an fp32 tl.dot runs on TF32 tensor cores (~1e-3 relative error);
    # the interpreter computes in exact fp32.
    return dict(_ATT_TOL) if interpreter_enabled() else dict(atol=2e-2, rtol=2e-2)


@register(
    cases=3,
    nudge="Go through one iteration as the warm-up cell does: the tile's key indices, the pointer "
          "tile, masked loads, the scores, the −inf mask (past seq_len, and the causal one), then the "
          "update of Section 3. Compare your loop with your PyTorch tiled_attention.",
    concept="The Triton loop is Exercise 2's loop written for one block of 16 query rows: the same "
            "online-softmax state per row, carried in registers, with memory reached only through "
            "masked loads of K and V tiles.")
def flash_inner_loop(case: Case, fn) -> None:
    """Your @triton.jit attn_inner_loop, run inside minillm's lab kernel
    (minillm.kernels.lab.flash_attention_lab, 16 x 16 tiles), against naive attention
    (float64), causal and not; T is not a multiple of 16 in the first case, and the last
    case has one very large score per row (overflow safety)."""
    import torch

    from minillm.kernels import interpreter_enabled, naive_attention
    from minillm.kernels.lab import LAB_BLOCK_M, LAB_BLOCK_N, flash_attention_lab, is_triton_function

    hint = _stub_hint(fn)
    if hint is not None:
        raise NotImplementedError(hint)
    case.expect(callable(fn) and is_triton_function(fn),
                f"expected your inner loop, a function decorated with @triton.jit; got "
                f"{type(fn).__name__}. Put @triton.jit on the line above `def attn_inner_loop(...)`, "
                "run that cell, and pass the function itself: check.flash_inner_loop(attn_inner_loop).")
    h, d = case.size(1, 2), case.choice([16, 32])
    t = case.size(LAB_BLOCK_M + 1, 3 * LAB_BLOCK_M)
    if case.index == 0 and t % LAB_BLOCK_N == 0:
        t -= 1
    device = "cpu" if interpreter_enabled() else "cuda"
    big = case.index == case.total - 1
    q, k, v = _attention_inputs(case, 1, h, t, d, big, device)
    scale = 1.0 / math.sqrt(d)
    tol = _tolerance_for_device()

    def run_lab_kernel(q, k, v, causal):
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy NaN noise
                return flash_attention_lab(q, k, v, fn, causal=causal)
        except Exception as exc:  # show the student's own error, not the interpreter's wrapper
            inner = _unwrap_interpreter_error(exc)
            if inner is exc:
                raise
            raise inner from None

    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    for causal in (True, False):
        ref = naive_attention(qc.double(), kc.double(), vc.double(), causal=causal).float()
        yours = case.call(run_lab_kernel, q, k, v, causal)
        yours = yours.cpu() if _is_tensor(yours) else yours
        hi = None
        if causal:  # the scaffold's loop bound: query row i walks tiles below min(start_m + BLOCK_M, T)
            hi = torch.clamp((torch.arange(t) // LAB_BLOCK_M + 1) * LAB_BLOCK_M, max=t)
        _compare_attention(case, yours, ref,
                           lambda: _attention_mistakes(qc, kc, vc, causal, scale, LAB_BLOCK_N, "triton", hi),
                           f"output (causal={causal}, T={t}, D={d}{', large scores' if big else ''})",
                           tol, big, "triton")
