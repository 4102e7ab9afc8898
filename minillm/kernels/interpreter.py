"""Where minillm's Triton kernels run: compiled for a CUDA GPU, or in Triton's CPU interpreter.

Without a CUDA GPU the kernels run in Triton's interpreter (numpy on CPU tensors). The
interpreter is chosen when each ``@triton.jit`` function is *defined*, and that includes
triton's own helpers (``tl.zeros``, ``tl.max``, ``tl.sum`` ...), defined when ``triton`` is
first imported. So this module sets ``TRITON_INTERPRET=1`` (unless the user set it) before
importing triton; every kernel module imports it first (``minillm.kernels`` does, before
any of them). ``import torch`` alone does not import triton, but ``import torch._dynamo``
and ``import transformers`` do: if one of them ran first on a CPU-only machine, the helpers
were built for the compiler and every kernel call would fail deep inside Triton. That case
(and ``TRITON_INTERPRET=0`` on a CPU-only machine) is detected: importing warns, and
calling a kernel raises a RuntimeError that says what to do (set ``TRITON_INTERPRET=1`` or
import minillm first, then restart the process). The variable is process-wide: Triton code
defined later in the same process is interpreted too (on a CPU-only machine it could not
run otherwise).

This is the kernels' set-up state, in one small module that the kernel modules import
(``minillm.kernels`` re-exports it): nothing here imports a kernel.
"""

from __future__ import annotations

import os
import sys
import warnings

from ..devices import cuda_requested

# CUDA in use: a GPU is visible and MINILLM_DEVICE does not choose the CPU (with
# MINILLM_DEVICE=cpu on a GPU machine the kernels get CPU tensors: the interpreter runs them).
_HAS_CUDA = cuda_requested()
_TRITON_WAS_IMPORTED = "triton" in sys.modules
_USER_SETTING = os.environ.get("TRITON_INTERPRET")
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (must come after the environment is set)


def _interpret_setting() -> bool:
    """Triton's own setting: do ``@triton.jit`` kernels defined now run in the interpreter?"""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Read once, here: minillm's kernels are defined right after this module, in the mode of
# this moment, whatever TRITON_INTERPRET says later. A constant is also what torch.compile
# can trace. Triton's knob calls a C++ getenv (triton 3.7) that Dynamo cannot trace, so
# asking it (the argument checks of every attention call do) breaks the graph of a
# compiled step there (`tests/test_kernels.py`). A break inside each layer makes the layer
# a frame of its own, which Dynamo recompiles per layer_idx: the H100 run of 2026-11-27
# hit Dynamo's recompile limit (8) on `forward_open`, so the later layers ran uncompiled
# (that this break was the one there is still to be confirmed on a GPU).
_INTERPRETER = _interpret_setting()


def interpreter_enabled() -> bool:
    """True when minillm's Triton kernels run in Triton's CPU interpreter (decided at import)."""
    return _INTERPRETER


def _triton_helpers_interpreted() -> bool:
    """Were triton.language's own @jit helpers (tl.zeros ...) built for the interpreter?"""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(triton.language.zeros, InterpretedFunction)
    except (ImportError, AttributeError):  # another triton layout: judge by import order
        return not (_TRITON_WAS_IMPORTED and _USER_SETTING is None)


def _setup_problem() -> str | None:
    if _HAS_CUDA:
        return None
    if not _INTERPRETER:
        return (f"no CUDA GPU is available, so the Triton kernels must run in Triton's CPU "
                f"interpreter, but TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} "
                "switches it off. Unset TRITON_INTERPRET (minillm then sets it to 1 itself) or "
                "set TRITON_INTERPRET=1, and restart the Python process.")
    if not _triton_helpers_interpreted():
        return ("no CUDA GPU is available and triton was imported before minillm.kernels "
                "(torch._dynamo imports it, and so does importing a transformers model class) without TRITON_INTERPRET=1, so "
                "triton.language was built for the GPU compiler and the CPU interpreter cannot "
                "run these kernels. Restart the Python process and either import minillm "
                "before anything else or set the environment variable TRITON_INTERPRET=1 "
                "before starting Python.")
    return None


SETUP_PROBLEM = _setup_problem()
if SETUP_PROBLEM is not None:
    warnings.warn("minillm.kernels: " + SETUP_PROBLEM, RuntimeWarning, stacklevel=2)


def require_working_setup() -> None:
    """Raise the set-up problem found at import time, if any (called by every kernel)."""
    if SETUP_PROBLEM is not None:
        raise RuntimeError("minillm.kernels: " + SETUP_PROBLEM)
