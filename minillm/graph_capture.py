"""What every CUDA graph capture in the package holds to: no garbage collection inside it.

Why: while a stream captures, CUDA refuses most calls that are not launches on it, and one
refused call invalidates the whole capture. Freeing an earlier CUDA graph is such a call
(`cudaGraphExecDestroy`: "operation not permitted when stream is capturing"). An engine or
a decode graph that nothing references any more often sits in a reference cycle, so it is
freed only when Python's cyclic collector runs, and that can happen at any allocation,
inside a capture too. PyTorch's `torch.cuda.graph` used to run `gc.collect()` before each
capture, but from 2.x it does so only under `torch.compiler.config.force_cudagraph_gc`.
Measured on an H200 (2026-11-28): a second engine's decode capture, after a test had
dropped the first, failed with six such refusals.

`capture_guard()` collects once before the captures (the dead graphs are freed while that
is still allowed) and keeps the collector off until they end, errors included. Turning the
collector off is what prevents the failure; the collection only frees dead graphs sooner,
and costs 0.06-0.1 s with the benchmarks' imports loaded, so a timing helper that captures
once per measurement skips it (`collect=False`). Reference counting still frees garbage
without cycles at once: the capturing code itself must not drop its last reference to a
graph while capturing (none here does).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def capture_guard(collect: bool = True) -> Iterator[None]:
    """Collect now (unless ``collect`` is False), then no cyclic garbage collection until
    the block ends (restored as it was, errors included). Wrap every capture, or a loop of
    captures, in it."""
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
