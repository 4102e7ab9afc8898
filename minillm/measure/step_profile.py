"""Where the time of one batch-1 decode step goes, by ``torch.profiler`` (Lab 01, section 9).

``profile_decode_step(model, prompt_ids, steps)`` runs the eager decode steps of
``generate_stream`` under the PyTorch profiler (the prefill runs before the profiler starts)
and splits the profiled time of a step into three bins:

- **weights**: every weight product, i.e. every call of a ``minillm.layers.Linear`` (the
  121 projections and the LM head). Each call is wrapped in a profiler range named
  ``minillm::Linear`` (``hook_linears``), because on a CPU the product runs in a C++
  extension that the profiler would not see as an operator; on CUDA the decode GEMV's
  products (each with the glue before it) are wrapped too;
- **attention**: every call of the attention backend over the cache (``dense``,
  ``paged_decode``, ``varlen``), and of the C++ decode kernel that a CPU's contiguous cache
  may take instead (``attention.cpu_decode.ContiguousDecode``), wrapped in a range named
  ``minillm::attention``;
- **rest**: the step's wall time minus the two: norms, RoPE, SiLU, residual adds, the KV
  write, sampling, and the Python and dispatch around all of them.

``top_ops`` lists the operators (and the two ranges) by their self time per step: the
time spent in the operator itself, not in the operators it calls.

Invariants: times are per decode step (the profiled time over ``steps`` steps, divided by
``steps``); the bins add up to ``step_s``; the model is left as it was (hooks removed,
attention backend restored), even when the profiled generation raises. The times are host
(CPU) times. On a CPU that is where the work runs. On a GPU it is what the host spends
issuing the work (Lab 01's launch wall), which is why the lab profiles the eager step. The
profiler adds its own cost to every operator, so ``step_s`` is longer than an unprofiled
step and the bins are best read as shares.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import torch

from ..devices import synchronize

WEIGHTS_RANGE = "minillm::Linear"
ATTENTION_RANGE = "minillm::attention"
BINS = ("weights", "attention", "rest")


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """One profiled decode step (seconds per step; see the module docstring)."""

    step_s: float                                # profiled wall time of one step
    bins: dict                                   # {"weights", "attention", "rest"} -> seconds
    top_ops: tuple                               # ((name, self seconds, calls), ...) per step
    steps: int
    device: str

    def share(self, name: str) -> float:
        """The fraction of the profiled step in bin ``name``."""
        if name not in self.bins:
            raise KeyError(f"a bin is one of {list(self.bins)}; got {name!r}")
        return self.bins[name] / self.step_s

    def table(self, top: int = 8) -> str:
        """The ``top`` operators by self time per step, then the three bins."""
        lines = [f"{'operator (self time per decode step)':<46}{'ms':>8}{'calls':>7}{'share':>7}",
                 "-" * 68]
        for name, seconds, calls in self.top_ops[:top]:
            lines.append(f"{name[:45]:<46}{seconds * 1e3:>8.2f}{calls:>7.0f}{seconds / self.step_s:>7.0%}")
        lines.append("-" * 68)
        for name in BINS:
            lines.append(f"{'bin: ' + name:<46}{self.bins[name] * 1e3:>8.2f}{'':>7}{self.share(name):>7.0%}")
        lines.append(f"{'profiled step':<46}{self.step_s * 1e3:>8.2f}")
        return "\n".join(lines)


class _LabelledBackend:
    """The model's attention backend, each computing call inside a profiler range."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in ("dense", "paged_decode", "varlen") or not callable(attr):
            return attr

        return _labelled(attr)


def _labelled(fn):
    """`fn`, each call inside a profiler range named ATTENTION_RANGE."""
    def labelled(*args, **kwargs):
        with torch.profiler.record_function(ATTENTION_RANGE):
            return fn(*args, **kwargs)
    return labelled


class _Undo:
    """A handle whose ``remove()`` undoes one change (as a hook's handle does)."""

    def __init__(self, undo):
        self.remove = undo


def hook_linears(model) -> list:
    """Label every weight product of ``model`` with a profiler range (WEIGHTS_RANGE): each
    Linear's forward wrapped on its instance, and the decode GEMV's products, which run no
    module's forward (on CUDA a layer's norm + q|k|v, norm + gate|up and SiLU·up + down are
    one kernel each: `fused.PRODUCT_RANGE`). Not forward hooks: a hooked Linear must keep
    its own call, which turns the GEMV off, and the profile would time another step than the
    one that runs. Returns handles (call .remove() on each). Also used by
    benchmarks/decode_profile.py."""
    from ..layers import fused
    from ..layers.linear import Linear

    def labelled(forward):
        def forward_in_range(*args, **kwargs):
            with torch.profiler.record_function(WEIGHTS_RANGE):
                return forward(*args, **kwargs)
        forward_in_range.labels_only = True  # the GEMV may still replace the call
        return forward_in_range

    handles = []
    for module in model.modules():
        if isinstance(module, Linear) and "forward" not in vars(module):
            module.forward = labelled(module.forward)
            handles.append(_Undo(lambda m=module: vars(m).pop("forward", None)))
    before = fused.PRODUCT_RANGE
    fused.PRODUCT_RANGE = WEIGHTS_RANGE

    def restore():
        fused.PRODUCT_RANGE = before
    handles.append(_Undo(restore))
    return handles


def _outermost(events, name: str) -> float:
    """Total inclusive host µs of the events called ``name`` that are not inside another one."""
    total = 0.0
    for e in events:
        if e.name != name:
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name == name:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            total += e.cpu_time_total
    return total


def profile_decode_step(model, prompt_ids: Sequence[int], steps: int = 8, top: int = 12) -> StepProfile:
    """Profile ``steps`` eager decode steps of ``generate_stream(model, prompt_ids, ...)``
    (greedy, ``ignore_eos``, no CUDA graph) after a warm-up; see the module docstring."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1 (decode steps to profile); got {steps!r}")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep Kineto's start/stop lines out of the lab
    from torch.profiler import ProfilerActivity, profile

    from ..generate import generate_stream

    from ..attention.cpu_decode import ContiguousDecode

    original, kernel_call = model.attn_backend, ContiguousDecode.__call__
    handles = []
    try:
        model.attn_backend = _LabelledBackend(original)  # (not set_attn_backend: keep any compiled step)
        ContiguousDecode.__call__ = _labelled(kernel_call)
        handles = hook_linears(model)
        warm = generate_stream(model, prompt_ids, 2 + steps, ignore_eos=True, cuda_graph=False)
        for _ in warm:  # warm-up: the same steps, unprofiled
            pass
        stream = generate_stream(model, prompt_ids, 1 + steps, ignore_eos=True, cuda_graph=False)
        next(stream)  # the prefill and the first token, outside the profile
        synchronize(model.device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                next(stream)
            synchronize(model.device)
            wall_us = (time.perf_counter() - t0) * 1e6
        stream.close()
    finally:
        for h in handles:
            h.remove()
        model.attn_backend = original
        ContiguousDecode.__call__ = kernel_call
    events = prof.events()
    weights_us = _outermost(events, WEIGHTS_RANGE)
    attention_us = _outermost(events, ATTENTION_RANGE)
    per_step = 1e-6 / steps
    bins = {"weights": weights_us * per_step, "attention": attention_us * per_step,
            "rest": max(wall_us - weights_us - attention_us, 0.0) * per_step}
    step_s = sum(bins.values())
    ops = sorted(((a.key, a.self_cpu_time_total * per_step, a.count / steps)
                  for a in prof.key_averages()), key=lambda r: -r[1])
    return StepProfile(step_s=step_s, bins=bins, top_ops=tuple(ops[:top]), steps=steps,
                       device=str(model.device))
