"""Time a callable: the median of repeated calls, with asynchronous GPU work included.

On CUDA each call is timed by CUDA events after the launch queue is drained; elsewhere by
``time.perf_counter``, synchronizing CUDA (if in use) or MPS around each call. Every speed
the course reports is a median from ``time_fn`` (re-exported as ``minillm.perf.time_fn``).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from .devices import _resolve


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "mps":
        torch.mps.synchronize()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], warmup: int = 2, repeats: int = 10, device=None) -> float:
    """Median wall time of ``fn()`` in seconds, over ``repeats`` calls after ``warmup`` calls.

    With a CUDA ``device`` each call is timed by CUDA events around it (GPU time, launch
    queue drained first). Otherwise by ``time.perf_counter``, synchronizing CUDA (if it is
    in use) or MPS before and after each call so asynchronous work is not missed.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0; got {warmup!r}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1; got {repeats!r}.")
    dev = None if device is None else _resolve(device)
    times = []
    if dev is not None and dev.type == "cuda":
        with torch.cuda.device(dev):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize(dev)
            for _ in range(repeats):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)  # ms -> s
    else:
        for _ in range(warmup):
            fn()
        for _ in range(repeats):
            _synchronize(dev)
            t0 = time.perf_counter()
            fn()
            _synchronize(dev)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_tok_s(t_one, t_all, new_tokens: int) -> float:
    """Decode tok/s with the prefill cancelled, from repeated timings of a generation of 1
    token (`t_one`) and of `new_tokens` tokens (`t_all`): (n − 1) / (min t_all − min t_one).

    Each time is taken at its best (other programs on the cores only ever add time), not the
    best of per-round differences: a stall in one 1-token run would shrink a difference
    towards zero and report an absurd speed. If the two still come out in the wrong order,
    the prefill cannot be cancelled and the result is n / min t_all, a lower bound."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to cancel the prefill, got {new_tokens!r}")
    best_one, best_all = min(t_one), min(t_all)
    if best_all > best_one:
        return (new_tokens - 1) / (best_all - best_one)
    return new_tokens / best_all
