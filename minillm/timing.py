"""Time a callable: the median of repeated calls, with asynchronous GPU work included.

On CUDA each call is timed by CUDA events after the launch queue is drained; elsewhere by
``time.perf_counter``, synchronizing CUDA (if in use) or MPS around each call. Every speed
the course reports is a median from ``time_fn`` (re-exported as ``minillm.perf.time_fn``).

``time_graph`` times the GPU work of calls too small to outrun their own launch: a call of
a few microseconds of GPU work costs tens of microseconds of Python and kernel launch, so
``time_fn`` (and triton's ``do_bench``) measure the host there, not the kernel. Captured
once into a CUDA graph and replayed, the calls run back to back on the GPU, and the time
per call is the GPU's.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from .devices import _resolve
from .graph_capture import capture_guard


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


def time_graph(fns: Sequence[Callable[[], object]], replays: int = 5, device=None) -> float:
    """Seconds per call of the GPU work of ``fns``, captured in order into one CUDA graph.

    Each callable is called once first, on a side stream and outside the capture (Triton
    compiles, and buffers made on a first call, such as split-K counters, are allocated
    then); then all of them are captured into one ``torch.cuda.CUDAGraph``, replayed once
    untimed, and ``replays`` replays are timed by CUDA events: the median over
    ``len(fns)``. Pass several calls (about 20 or more) so that the replay's own launch is
    amortised, and, for memory-bound calls, inputs that do not all fit in the L2 cache (as
    many copies as it takes) so that each call reads from memory as it would in a model.

    Every callable must be capturable: no host synchronization (``.item()``, ``.tolist()``,
    a CPU tensor made from a GPU one) and no new CUDA stream. Off CUDA (a CPU, a dry run)
    there is no graph: the median of ``replays`` eager passes over ``fns`` (after one
    untimed pass), divided the same way, by ``time_fn``.
    """
    fns = list(fns)
    if not fns or not all(callable(f) for f in fns):
        raise ValueError(f"fns must be a non-empty sequence of callables; got {fns!r}.")
    if isinstance(replays, bool) or not isinstance(replays, int) or replays < 1:
        raise ValueError(f"replays must be an integer >= 1; got {replays!r}.")
    dev = None if device is None else _resolve(device)

    def run_all():
        for f in fns:
            f()

    if dev is None or dev.type != "cuda":
        return time_fn(run_all, warmup=1, repeats=replays, device=dev) / len(fns)
    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            run_all()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with capture_guard(collect=False), torch.cuda.graph(graph):  # one per timing
            run_all()
        # The replays timed as any call is: the first (it uploads the graph) as warm-up.
        seconds = time_fn(graph.replay, warmup=1, repeats=replays, device=dev)
        del graph  # its memory pool goes back to the allocator
    return seconds / len(fns)


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
