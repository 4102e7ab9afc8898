"""Describing and converting the values a check compares: ``describe`` (a short text such
as 'float32[4, 7]' for messages) and ``_as_numpy`` (a tensor or array as a numpy array,
for element-wise comparison and display).

Used by ``comparison`` (the messages of ``compare``), ``mismatch`` (the side-by-side view)
and ``core`` (the inputs listed when a case fails). Depends on nothing else in the package.

Invariant: torch is never imported here. A value counts as a tensor only if torch is
already loaded, so describing plain numbers and arrays stays cheap.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["describe"]


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


def _as_numpy(x: Any) -> np.ndarray:
    if _is_tensor(x):
        x = x.detach().to("cpu")
        if x.is_floating_point() and x.dtype.itemsize < 4:  # bf16/fp16 have no exact numpy twin
            x = x.float()
        return x.numpy()
    return np.asarray(x)

