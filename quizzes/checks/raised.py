"""What a student's function raised, in a check's words (``Case.call``): the error, and the
line of the student's code it came from.

A compiled @triton.jit function (a GPU; Triton's interpreter raises the error itself)
arrives as Triton's nested compile errors rather than the error, so those are unwrapped to
the student's own error and line. Imports nothing of the check framework.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raised_message(exc: BaseException) -> str:
    """'your function raised NameError: ...' and where, for an error from the student's code.

    A compiled @triton.jit function (on a GPU; the interpreter raises the error itself)
    reports a mistake as nested compile errors (``CompilationError`` or a subclass, such as
    a failed ``tl.static_assert``): the kernel's, at the call of the student's function,
    caused by the one at the student's own line, whose cause or context is the error itself
    (NameError, a shape's ValueError). Name that error, and show the innermost compile
    error: with two or more, its source excerpt is the student's line. With one, the error
    arose in the kernel around the student's function (what it returned did not fit, say),
    and the message says so rather than blame a line of theirs.
    """
    chain, root = [], exc
    while _is_triton_compile_error(root):
        chain.append(root)
        nxt = root.__cause__ if root.__cause__ is not None else root.__context__
        if nxt is None:
            break
        root = nxt
    if not chain:
        msg = f"your function raised {type(exc).__name__}: {exc}"
        where = _student_frame(exc.__traceback__)
        return msg + (f"\n  at {where}" if where else "")
    inner = chain[-1]
    if root is inner:  # no Python error under it: the compile error's own words
        return f"your function failed to compile (Triton): {inner}"
    if len(chain) == 1:
        return (f"Triton could not compile the kernel around your function: "
                f"{type(root).__name__}: {root} (check what your function takes and returns)"
                f"\n  Triton's compile error, in the kernel:\n{inner}")
    return (f"your function raised {type(root).__name__}: {root}\n"
            f"  Triton's compile error, at your line:\n{inner}")


def _is_triton_compile_error(exc: BaseException) -> bool:
    return any(c.__name__ == "CompilationError" and c.__module__.startswith("triton")
               for c in type(exc).__mro__)


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
