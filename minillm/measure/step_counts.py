"""What one decode step issues to its device and what then runs there, counted with
``torch.profiler`` (the launch wall's counts, ``launch.py``).

``count_step_ops`` counts per decode step of ``generate``, the prefill cancelled (a
(1 + S)-token generation minus a 1-token one, over S):

- ``host_ops``: the operator calls from Python (the profiler's top-level operators: each
  pays the dispatch cost, views that launch nothing included), and those that compiled
  code makes (its extern products, e.g. ``aten::mm``);
- ``launches``: what the host issues to the device: kernel launches on CUDA
  (cudaLaunchKernel, and cuLaunchKernelEx for Triton's; a CUDA-graph replay counts once),
  the operator calls on a CPU (``host_ops``);
- ``kernels``: what then runs: GPU kernels and copies on CUDA, every operator event on a
  CPU (nested ones included);
- ``triton_launches``: the GPU kernels that are minillm's Triton kernels
  (``triton_kernel_names``), each launched by Triton's own launcher from Python, outside
  any operator (none in a CUDA-graph replay, none on a CPU);
- ``compiled_launches``: the launches that code compiled by ``torch.compile`` issues
  itself, under no operator call (inside a "Torch-Compiled Region": Inductor's generated
  kernels; none on a CPU, where the compiled code runs its loops itself).

Invariants: a kernel counts once (minillm's Triton kernels launched by compiled code are
compiled launches, not Triton ones); a step is counted warm (compiled, captured: the
caller warms the variant up first), so a count holds no compilation.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Sequence

import torch

from ..devices import synchronize

_LAUNCH_API = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchKernelEx|LaunchKernelExC|GraphLaunch|"
                         r"LaunchCooperativeKernel)")
_COMPILED_REGION = "Torch-Compiled Region"  # the profiler's event around a call of compiled code


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """Per decode step, from the profiler (see the module docstring)."""

    host_ops: float   # operator calls from Python (top-level) and from compiled code
    launches: float   # what the host issues: launches (CUDA) / operator calls (CPU)
    kernels: float    # what runs: GPU kernels and copies (CUDA) / every operator event (CPU)
    triton_launches: float = 0.0  # minillm's Triton kernels launched from Python (CUDA, eager)
    compiled_launches: float = 0.0  # launches from torch.compile'd code (CUDA)


def count_step_ops(model, prompt_ids: Sequence[int], steps: int = 8, **generate_options) -> StepCounts:
    """The profiler's launches and kernels per decode step of ``generate(model, prompt_ids,
    ..., **generate_options)``, the prefill cancelled. Warm the variant up first."""
    from ..generate import generate

    graph = replays_graph(generate_options, model.device)
    one, many = (dataclasses.astuple(profile_counts(
        lambda n=n: generate(model, prompt_ids, n, ignore_eos=True, **generate_options), 1,
        model.device, graph)) for n in (1, 1 + steps))
    return StepCounts(*((b - a) / steps for a, b in zip(one, many)))


def count_host_ops(fn, calls: int = 8) -> float:
    """Operator calls from Python per call of ``fn`` (the profiler's top-level operators,
    as ``count_step_ops`` counts a step's), over ``calls`` calls after one untimed."""
    fn()
    return profile_counts(fn, calls, torch.device("cpu")).host_ops


def replays_graph(generate_options: dict, device: torch.device) -> bool:
    """Whether ``generate(..., **generate_options)`` on ``device`` decodes by replaying a CUDA
    graph, as generate resolves it (``cuda_graph=None``: yes on CUDA with the default cache
    functions). A replay launches no Triton kernel from Python."""
    from ..decode_graph import plain_cache, use_cuda_graph

    if device.type != "cuda":
        return False
    plain = plain_cache(generate_options.get("use_cache", True),
                        generate_options.get("append_fn"), generate_options.get("attend_fn"))
    return use_cuda_graph(generate_options.get("cuda_graph"), device, plain)


def triton_kernel_names() -> frozenset[str]:
    """The names of minillm's @triton.jit kernels (those of the modules imported so far):
    on CUDA each runs as a kernel of that name, e.g. ``_decode_gemv_kernel``."""
    import sys

    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return frozenset()
    names = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("minillm.kernels") or mod is None:
            continue
        for v in vars(mod).values():
            while isinstance(getattr(v, "fn", None), KernelInterface):  # an autotuner's kernel
                v = v.fn
            if isinstance(v, KernelInterface) and getattr(v, "__name__", None):
                names.add(v.__name__)
    return frozenset(names)


def _is_op(e) -> bool:
    """An operator call (``aten::mm``, ``minillm::small_m_linear``): the dispatcher names its
    events namespace::name; record functions (a compiled region, Inductor's kernels) and
    the CUDA API's calls are named otherwise."""
    return "::" in e.name


def _place(e) -> tuple[bool, bool]:
    """(whether ``e`` runs inside a compiled region, whether an operator call inside that
    region holds it)."""
    under_op, p = False, e.cpu_parent
    while p is not None:
        if p.name.startswith(_COMPILED_REGION):
            return True, under_op
        under_op = under_op or _is_op(p)
        p = p.cpu_parent
    return False, under_op


def _counts(events, cuda: bool, graph: bool = False) -> StepCounts:
    """The counts of one profile (``events``: the profiler's ``events()``).

    Inside a compiled region two things issue work: the operator calls the compiled code
    makes (its extern products, e.g. ``aten::mm`` to cuBLAS: each dispatched, so each an
    operator call like one from Python, its launches its own), and Inductor's generated
    kernels, launched by its generated code under no operator (``compiled_launches``). A
    kernel counts once: minillm's Triton kernels that compiled code launches (the profiler
    hangs a kernel on the event that launched it, ``kernels``) are compiled launches, not
    Triton ones."""
    from torch.autograd import DeviceType

    host = [e for e in events if e.device_type == DeviceType.CPU]
    top = sum(1 for e in host if e.cpu_parent is None and not _LAUNCH_API.match(e.name))
    inside, region_ops, region_launches = [], 0, 0
    for e in host:
        within, under_op = _place(e)
        if within:
            inside.append(e)
            if not under_op:
                region_launches += bool(_LAUNCH_API.match(e.name))
                region_ops += _is_op(e)
    ops = top + region_ops
    if not cuda:
        return StepCounts(ops, ops, len(host))
    launches = sum(1 for e in host if _LAUNCH_API.match(e.name))
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    names = frozenset() if graph else triton_kernel_names()  # a replay launches none
    triton = (sum(1 for e in kernels if e.name in names)
              - sum(1 for e in inside for k in getattr(e, "kernels", ()) if k.name in names))
    return StepCounts(ops, launches, len(kernels), triton, region_launches)


def profile_counts(fn, calls: int, device: torch.device, graph: bool = False) -> StepCounts:
    """``_counts`` of ``calls`` calls of ``fn`` on ``device`` (its kernels too, on CUDA), per
    call; ``graph``: ``fn`` replays a CUDA graph."""
    # Kineto (the profiler's engine) prints a line to stderr at every start and stop unless
    # told otherwise before its first use; its own log level 6 keeps a lab's output clean.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    counts = _counts(prof.events(), cuda, graph)
    return StepCounts(*(v / calls for v in dataclasses.astuple(counts)))
