"""Where one step's time goes: the device's kernels by name, and the host's Python by function.

A step is any zero-argument callable that does one unit of work (one decode token, one
engine step). Two views of it, each over a handful of calls:

    profile_kernels(step, steps)   torch.profiler: the kernels the device ran (on CUDA:
                                   kernels, copies and memsets; on a CPU, where there are
                                   no kernels, the step's top-level CPU operators, so the
                                   CPU dry run takes the same path), aggregated by
                                   `kernel_breakdown`
    profile_host(step, steps)      cProfile: the host's own time (tottime) per function,
                                   aggregated by `host_breakdown`

Each returns one JSON-ready "part" (its ``kind`` is "kernels" or "host"); a row of
benchmarks/gpu_check.py carries its parts under ``"breakdown"`` and gpu_check_report
prints each as a small table.

Invariants of the pure functions (tested in tests/test_step_breakdown.py):
- every number is per step: totals over the profiled calls divided by ``steps``;
- GPU busy time is the union of the kernels' [start, end) intervals (`busy_us`): kernels
  that overlap (two streams, or nested CPU operators) are counted once;
- a kernel's share is its own summed time over the busy time; shares of overlapping
  kernels may add up to more than 1, of a single stream's kernels to 1;
- the top list is ordered by total time, longest first (ties by name), and is grouped by
  the kernel's full name: two kernels whose shortened names collide keep distinct labels.

A process that profiles CUDA graphs calls `init_profiler_for_cuda_graphs()` before it
captures any (benchmarks/gpu_check.py does, first thing on CUDA).

Costs: the profiler adds a few µs per event, so a profiled step's wall time is longer than
an unprofiled one (the kernels' own durations are not affected); cProfile roughly doubles
pure-Python time. Read the tables as where the time goes, not how long a step takes.

Also used by benchmarks/gpu_step_profile.py (the idle share of eager and graph steps).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import re
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_NAME_WIDTH = 60  # characters of a kernel's label; cuBLAS and ATen names run to 300


# ----------------------------------------------------------------------------- pure functions


def busy_us(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


_NAMESPACES = re.compile(r"(?:\(anonymous namespace\)::|\b[A-Za-z_]\w*::)+")


def _without_arguments(signature: str) -> str:
    """A demangled C++ signature without its trailing parameter list."""
    if not signature.endswith(")"):
        return signature
    depth = 0
    for i in range(len(signature) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(signature[i], 0)
        if depth == 0:
            return signature[:i].rstrip()
    return signature


def _simplified(name: str) -> str:
    """A kernel's name as it reads best: a demangled C++ signature ("void ns::kernel<...>(args)",
    ATen's and CUTLASS's) loses its return type, parameter list and namespaces but keeps its
    template arguments (ATen's elementwise kernels differ only there); any other name
    (Triton's, cuBLAS's, "Memcpy DtoH (Device -> Pinned)", "aten::mm") stays as it is."""
    name = " ".join(name.split())
    if name.startswith("void "):
        name = _NAMESPACES.sub("", _without_arguments(name[5:]))
    return name


def short_kernel_name(name: str, width: int = KERNEL_NAME_WIDTH) -> str:
    """`name` simplified, then cut to `width` characters (an ellipsis marks the cut)."""
    name = _simplified(name)
    return name if len(name) <= width else name[:width - 1] + "…"


def _labels(names: list[str], width: int) -> list[str]:
    """Distinct short labels for distinct full names, in order: a label that collides with
    an earlier one keeps the end of the name instead (head…tail), and if that collides too,
    gets " #k" (the k-th kernel of that label)."""
    labels, seen = [], {}
    for name in names:
        label = short_kernel_name(name, width)
        if label in seen:
            full, half = _simplified(name), (width - 1) // 2
            if len(full) > width:
                label = full[:half] + "…" + full[-(width - 1 - half):]
        if label in seen:
            seen[label] += 1
            label = f"{label} #{seen[label]}"
        seen.setdefault(label, 1)
        labels.append(label)
    return labels


def kernel_breakdown(kernels, steps: int, top: int = 10,
                     width: int = KERNEL_NAME_WIDTH) -> dict:
    """The kernels of `steps` steps, from profiler events as (name, start_us, end_us):

    kernels_per_step, busy_us_per_step (the union of the intervals), kernel_us_per_step (the
    sum of the durations: above busy where kernels overlap), and ``top``: the `top` names by
    total time, each {"kernel": label, "per_step": count, "us_per_step", "share": of busy},
    then ``others``: the kernels outside the top list ({"kernels", "per_step", "us_per_step"}).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the profiled calls); got {steps}")
    kernels = list(kernels)
    totals: dict[str, list] = {}  # full name -> [count, summed µs]
    for name, start, end in kernels:
        t = totals.setdefault(name, [0, 0.0])
        t[0] += 1
        t[1] += end - start
    busy = busy_us((start, end) for _, start, end in kernels)
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))
    shown, rest = ranked[:top], ranked[top:]
    labels = _labels([name for name, _ in shown], width)
    return {"steps": steps, "kernels_per_step": len(kernels) / steps,
            "busy_us_per_step": busy / steps,
            "kernel_us_per_step": sum(t[1] for t in totals.values()) / steps,
            "distinct_kernels": len(totals),
            "top": [{"kernel": label, "per_step": count / steps, "us_per_step": us / steps,
                     "share": us / busy if busy > 0 else None}
                    for label, (_, (count, us)) in zip(labels, shown)],
            "others": {"kernels": len(rest), "per_step": sum(t[0] for _, t in rest) / steps,
                       "us_per_step": sum(t[1] for _, t in rest) / steps}}


def short_path(path: str, root: Path = ROOT) -> str:
    """A source path as a reader finds it: inside site-packages (or dist-packages) from
    there ("torch/nn/modules/module.py"), in the repository from its root
    ("minillm/model.py"), in the standard library from there ("threading.py"); else as is."""
    p = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in p:  # first: a virtual environment may live inside the repository
            return p.rsplit(marker, 1)[1]
    for base in (str(root), sysconfig.get_paths()["stdlib"]):
        base = base.replace("\\", "/").rstrip("/") + "/"
        if p.startswith(base):
            return p[len(base):]
    return p


def function_label(file: str, line: int, func: str, root: Path = ROOT) -> str:
    """"file:line(function)", or "{built-in method x}" for C functions (file "~")."""
    if file == "~" and line == 0:
        return "{" + func[1:-1] + "}" if func.startswith("<") and func.endswith(">") else func
    return f"{short_path(file, root)}:{line}({func})"


def _profiler_own(file: str, func: str) -> bool:
    return file == "~" and "_lsprof.Profiler" in func  # cProfile's disable(), not the step's


def host_breakdown(stats, steps: int, top: int = 12, root: Path = ROOT) -> dict:
    """The host's own time of `steps` steps from a cProfile result (a ``pstats.Stats``, or
    its ``.stats`` dict {(file, line, function): (primitive calls, calls, tottime, cumtime,
    callers)}): host_us_per_step (the summed own time: every profiled µs once), and
    ``top``: the `top` functions by own time, each {"function": "file:line(function)",
    "calls_per_step", "us_per_step", "share": of host_us_per_step}."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the profiled calls); got {steps}")
    raw = getattr(stats, "stats", stats)
    funcs = sorted(((function_label(file, line, func, root), calls, own)
                    for (file, line, func), (_, calls, own, _, _) in raw.items()
                    if not _profiler_own(file, func)),
                   key=lambda f: (-f[2], f[0]))
    total = sum(own for _, _, own in funcs)
    return {"steps": steps, "host_us_per_step": total * 1e6 / steps, "functions": len(funcs),
            "top": [{"function": label, "calls_per_step": calls / steps,
                     "us_per_step": own * 1e6 / steps, "share": own / total if total > 0 else None}
                    for label, calls, own in funcs[:top]]}


# ----------------------------------------------------------------------------- wrappers


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _synchronize(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def init_profiler_for_cuda_graphs() -> None:
    """Start and stop the profiler once, before the process captures its first CUDA graph.
    A graph captured before the profiler's first use may crash (an illegal memory access,
    which poisons the CUDA context) or be recorded wrongly when it is profiled later
    (pytorch/pytorch#75504); torch's own workaround, `_init_for_cuda_graphs`, is an empty
    profiler session first (pytorch/pytorch#100441), and this calls it. A no-op without
    CUDA; without that private function, the same empty session by hand."""
    if not _cuda():
        return
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        from torch.profiler._utils import _init_for_cuda_graphs
    except ImportError:
        from torch.autograd.profiler import profile

        def _init_for_cuda_graphs():
            with profile():
                pass
    _init_for_cuda_graphs()


def profile_steps(step, steps: int, warmup: int = 1, cuda: bool | None = None):
    """(events, wall µs): `steps` calls of `step` under torch.profiler (CPU activity, and
    CUDA's where `cuda`, by default when a CUDA device is present), after `warmup` calls
    outside it, the device synchronized before and after."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # Kineto's start/stop lines off the log
    from torch.profiler import ProfilerActivity, profile

    cuda = _cuda() if cuda is None else cuda
    for _ in range(warmup):
        step()
    _synchronize(cuda)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _synchronize(cuda)
        wall_us = (time.perf_counter() - t0) * 1e6
    return prof.events(), wall_us


def device_kernels(events, cuda: bool) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of what the device ran: on CUDA every device event (kernels,
    copies, memsets); on a CPU the top-level CPU operators (the ones the step called, not
    those they call in turn: Python's launches, as kernels are on a GPU)."""
    from torch.autograd import DeviceType

    if cuda:
        chosen = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        chosen = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    return [(e.name, e.time_range.start, e.time_range.end) for e in chosen]


def profile_kernels(step, steps: int, top: int = 10, warmup: int = 1) -> dict:
    """A "kernels" part: `kernel_breakdown` of `steps` profiled calls of `step`, with the
    profiled wall time per step and the seconds this took."""
    t0, cuda = time.perf_counter(), _cuda()
    events, wall_us = profile_steps(step, steps, warmup, cuda)
    return {"kind": "kernels",
            "events": ("CUDA kernels, copies and memsets" if cuda else
                       "CPU operators, top level (no GPU here: they stand in for kernels)"),
            **kernel_breakdown(device_kernels(events, cuda), steps, top),
            "wall_us_per_step": wall_us / steps,
            "seconds": round(time.perf_counter() - t0, 2)}


def profile_host(step, steps: int, top: int = 12, warmup: int = 1) -> dict:
    """A "host" part: `host_breakdown` of `steps` calls of `step` under cProfile (after
    `warmup` calls outside it, the device synchronized before it), with the wall time per
    step under cProfile and the seconds this took. Time the host spends waiting for the
    device (a sync, a copy to the host) is the own time of the call that waits."""
    t0, cuda = time.perf_counter(), _cuda()
    for _ in range(warmup):
        step()
    _synchronize(cuda)
    prof = cProfile.Profile()
    t1 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    wall_us = (time.perf_counter() - t1) * 1e6
    return {"kind": "host", "events": "host Python and C calls, own time (cProfile)",
            **host_breakdown(pstats.Stats(prof), steps, top),
            "wall_us_per_step": wall_us / steps,
            "seconds": round(time.perf_counter() - t0, 2)}


# ----------------------------------------------------------------------------- steps


def generate_step(model, prompt_ids, cuda_graph: bool, max_new_tokens: int = 512,
                  compile: bool = False):
    """One batch-1 decode token per call: `generate_stream` kept open and advanced by next().
    The prefill runs here; through a CUDA graph the first call after it queues two replays
    (`DecodeGraph.greedy` runs one step ahead) and every later call one, so profile after a
    warm-up call. Allow max_new_tokens for the warm-up and the profiled calls."""
    import minillm

    stream = minillm.generate_stream(model, prompt_ids, max_new_tokens, ignore_eos=True,
                                     cuda_graph=cuda_graph, compile=compile)
    next(stream)  # the prefill
    return stream.__next__
