"""The launch wall: what a batch-1 decode step costs beyond its bytes, predicted from the
operations the host issues, then measured (Lab 01, section 8).

A decode step of a small model has two floors:

- the **bytes floor**: weight bytes ÷ bandwidth (the memory wall of Lab 01's sections 2-5);
- the **launch floor**: operations per step × the cost of one (``calc.launch_floor_s``).
  Every operation the host issues costs it microseconds (Python, PyTorch's dispatcher and,
  on a GPU, the kernel launch) however little the operation does. On a GPU the step's
  Triton kernels count apart: Triton's launcher is Python that binds and specializes every
  argument of every call, and minillm's wrappers check theirs, so one costs the host
  several PyTorch operations (the H100 of 2026-11-27: 1,252 operator calls at 9.5 µs are
  11.9 ms of a 19.5 ms eager step, and its ~95 Triton launches the rest, ~80 µs each).
  A compiled step's kernels count apart as well: Inductor's generated code launches them
  with no dispatcher and no argument binding in Python, cheaper than either, but not free.

On a CPU one core issues an operation and then runs it, so a step costs about the sum of
the floors. On a GPU the host queues kernels while the device runs earlier ones, so a step
costs about the larger floor (``calc.step_floor_s``). SmolLM2 launches ~900 kernels per
token, which at ~5 µs each is ~50× the time its bf16 weights take at 3 TB/s: on a GPU,
batch-1 decode is launch-bound. The fixes cut what the host issues per step:
``torch.compile`` fuses the glue between the weight products into fewer kernels and takes
Python out of the step; a CUDA graph replays the whole step with one launch
(``generate(..., cuda_graph=True)``, ``minillm.decode_graph``).

A replayed step meets a third floor, on a GPU only: the **kernel floor**, kernels per step ×
what one tiny kernel costs the device even when the host launches nothing
(``measure_kernel_cost``: its start, its drain and the gap before the next). On the H200
of 2026-11-28 SmolLM2's graph step ran 283 kernels (torch attention) in 0.90 ms, 3.2 µs a
kernel on average and 14× its bytes floor of 0.062 ms: the step is bound by how many
kernels it has, which is why fusing them (the decode GEMV: four a layer) still pays inside
a graph. (How close the tiny kernel's cost comes to that average is still to be measured.)

What is measured, on the model's device, in the model's dtype:

- ``measure_launch_cost``: seconds per tiny operation issued from Python (``torch.add`` of a
  one-element tensor into a preallocated one), the median over bursts of ``ops`` of them,
  the device drained around each burst (``time_fn``); ``measure_kernel_cost`` (CUDA): the
  device seconds per such kernel replayed from a CUDA graph; ``measure_triton_call``: the
  same for the step's most frequent Triton call (a layer's add + RMSNorm + gate|up decode
  GEMV, ``fused.norm_linear``, on one row) less its own operator calls (the step's count
  has them already), on CUDA only;
  ``measure_compiled_launch_cost`` (CUDA): the host seconds per launch from compiled code,
  the difference between two compiled chains of tiny kernels over the difference of their
  launches (what each more launch costs: Inductor's wrapper and launcher, no dispatcher);
- ``count_step_ops`` (``step_counts.py``): per decode step, the profiler's operator calls
  (``host_ops``: from Python, and from compiled code), the host's launches, the kernels
  that run, and among the launches minillm's Triton ones and those from compiled code;
- the step time: ``(t(1 + S tokens) − t(1 token)) ÷ S``, each time the best of ``rounds``
  (``timing.decode_tok_s``).

Invariants: every variant generates from the same prompt with greedy sampling and
``ignore_eos``, so each does the same work; a variant is warmed up (compiled, captured)
before it is timed or counted; CUDA-graph variants run only on CUDA (a CPU has no graphs).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from .. import calc
from ..devices import device_name, synchronize
from ..timing import decode_tok_s, time_fn, time_graph
from .step_counts import StepCounts, count_host_ops, count_step_ops, profile_counts
from .steps import matmul_params

#: name -> generate() options. CUDA-graph variants need CUDA.
VARIANTS = {
    "eager": dict(compile=False, cuda_graph=False),
    "compiled": dict(compile=True, cuda_graph=False),
    "CUDA graph": dict(compile=False, cuda_graph=True),
    "compiled + CUDA graph": dict(compile=True, cuda_graph=True),
}


def default_variants(device: torch.device, quick: bool = False) -> tuple[str, ...]:
    """What Lab 01 measures on ``device``: eager, compiled and (on CUDA) graph-replayed;
    ``quick`` leaves out the compiled ones (torch.compile takes 15-40 s the first time)."""
    cuda = device.type == "cuda"
    names = ["eager"] + ([] if quick else ["compiled"])
    if cuda:
        names += ["CUDA graph"] + ([] if quick else ["compiled + CUDA graph"])
    return tuple(names)


def _seconds_per_call(fn, calls: int, repeats: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` over bursts of ``calls`` calls in a row (``time_fn``: the
    median burst, the device drained around each): what the host pays per call, however
    little the call does."""

    def burst():
        for _ in range(calls):
            fn()

    return time_fn(burst, warmup=1, repeats=repeats, device=device) / calls


def measure_launch_cost(device=None, ops: int = 1000, repeats: int = 5) -> float:
    """Seconds per tiny operation issued from Python on ``device`` (None: the default): what
    the host pays per operation, whatever the operation does."""
    from ..devices import resolve_device

    dev = resolve_device(device)
    x = torch.zeros(1, device=dev)
    y = torch.empty_like(x)
    return _seconds_per_call(lambda: torch.add(x, 1.0, out=y), ops, repeats, dev)


def measure_kernel_cost(device=None, kernels: int = 200, replays: int = 5) -> float | None:
    """Seconds of device time per tiny kernel (``add_`` on a one-element tensor) replayed from
    a CUDA graph of ``kernels`` of them: what each kernel of a step costs the GPU however
    little it does, once no host launches it. None off CUDA (a CPU runs each operation as
    the host issues it: ``measure_launch_cost`` holds it)."""
    from ..devices import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        return None
    x = torch.zeros(1, device=dev)
    return time_graph([lambda: x.add_(1.0)] * kernels, replays=replays, device=dev)


def measure_triton_call(model, calls: int = 200,
                        repeats: int = 5) -> tuple[float, float] | None:
    """(seconds, operator calls) per Triton launch as ``model``'s eager decode step issues
    one, on its device: a burst of the step's most frequent Triton call, the first layer's
    add + RMSNorm + gate|up product on one row (``fused.norm_linear``: the decode GEMV, with
    minillm's wrapper and Triton's launcher around it), and the operator calls its wrapper
    makes (reshapes, output allocations: the step's own count holds them already, so
    `LaunchWall.triton_launch_s` charges a launch only what it costs beyond them). None off
    CUDA (a CPU step launches no Triton kernel: its glue is C++ and PyTorch) or for a model
    with no such layer."""
    if model.device.type != "cuda":
        return None
    from ..layers import fused

    layer = next((m for m in model.modules() if hasattr(m, "post_attention_norm")), None)
    if layer is None:
        return None
    norm, gate_up = layer.post_attention_norm, layer.mlp.gate_up_proj
    x = torch.randn(1, 1, model.config.hidden_size, device=model.device, dtype=model.dtype)
    delta = torch.randn_like(x)

    def call():
        fused.norm_linear(x, delta, norm.weight, norm.eps, gate_up)

    with torch.inference_mode():
        return (_seconds_per_call(call, calls, repeats, model.device),
                count_host_ops(call, calls=8))


def _reduction_chain(n: int):
    """x -> x + x.sum(0), then + its sum(1), ... n times: each reduction needs all of the one
    before, along the other axis, so Inductor cannot fuse two of them (about a kernel each)."""

    def chain(x):
        for i in range(n):
            x = x + x.sum(i % 2, keepdim=True)
        return x

    return chain


def measure_compiled_launch_cost(device=None, short: int = 2, long: int = 10, calls: int = 100,
                                 repeats: int = 5) -> float | None:
    """Host seconds per launch that code compiled by ``torch.compile`` issues on ``device``
    (None: the default): two compiled chains of tiny reductions (``short`` and ``long``
    reductions), timed per call over bursts of ``calls`` and profiled for their launches;
    the difference in time over the difference in launches, so that what every call pays
    once (the guards, the wrapper) cancels. None off CUDA (a CPU's compiled code runs its
    loops itself: it launches nothing), when the longer chain launched no more (the
    compiler fused what this counts on it not fusing), or when it took no longer (noise
    larger than what it measures)."""
    from ..devices import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        return None
    x = torch.zeros(8, 8, device=dev)
    seconds, launches = {}, {}
    for n in (short, long):
        fn = torch.compile(_reduction_chain(n), dynamic=False)
        fn(x), fn(x)  # compile, then once more warm
        seconds[n] = _seconds_per_call(lambda: fn(x), calls, repeats, dev)
        launches[n] = profile_counts(lambda: fn(x), 8, dev).compiled_launches
    more, longer = launches[long] - launches[short], seconds[long] - seconds[short]
    return longer / more if more >= 1 and longer > 0 else None


def time_decode_step(model, prompt_ids: Sequence[int], steps: int = 16, rounds: int = 3,
                     **generate_options) -> float:
    """Seconds per decode step of ``generate(..., **generate_options)``: the best time of a
    (1 + steps)-token generation minus the best of a 1-token one, over ``steps``."""
    from ..generate import generate

    def timed(n):
        synchronize(model.device)
        t0 = time.perf_counter()
        generate(model, prompt_ids, n, ignore_eos=True, **generate_options)
        synchronize(model.device)
        return time.perf_counter() - t0

    t_one, t_all = [], []
    for _ in range(rounds):
        t_one.append(timed(1))
        t_all.append(timed(1 + steps))
    return 1.0 / decode_tok_s(t_one, t_all, 1 + steps)


@dataclasses.dataclass(frozen=True)
class StepRun:
    """One way of running the decode step: its measured time and its profiler counts."""

    name: str
    step_s: float
    host_ops: float
    launches: float
    kernels: float
    triton_launches: float = 0.0
    compiled_launches: float = 0.0


class LaunchWall:
    """The two floors of a batch-1 decode step of ``model`` on its device, and the steps
    measured there: ``count(name)`` profiles one variant, ``measure(name)`` times it too and
    adds a row to ``runs``; ``table()`` and ``summary()`` report them.

    ``bandwidth_bytes_per_s``: what the bytes floor divides by (the machine profile's
    matvec stream, decode's honest ceiling, measured on the same device)."""

    def __init__(self, model, bandwidth_bytes_per_s: float, *, prompt_len: int = 16,
                 steps: int = 16, count_steps: int = 8, rounds: int = 3, seed: int = 0):
        dev = model.device
        self.model, self.steps, self.count_steps, self.rounds = model, steps, count_steps, rounds
        g = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
        self.device, self.device_name = str(dev), device_name(dev)
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.weight_bytes = float(matmul_params(model.config) * model.dtype.itemsize)
        if not (isinstance(bandwidth_bytes_per_s, (int, float)) and 0 < bandwidth_bytes_per_s < float("inf")):
            raise ValueError(f"bandwidth_bytes_per_s must be a number of bytes/s > 0 (e.g. "
                             f"perf.measure_machine().matvec_bytes_per_s); got {bandwidth_bytes_per_s!r}")
        self.bandwidth = float(bandwidth_bytes_per_s)
        self.overlapped = dev.type == "cuda"  # the host issues while the device runs
        self.launch_s = measure_launch_cost(dev)
        self.kernel_s = measure_kernel_cost(dev)  # device s per kernel; None off CUDA
        self.triton_call = measure_triton_call(model)  # (s, operator calls); None off CUDA
        # host s per launch from compiled code: measured by the first count of a step that
        # has such launches (it compiles two tiny functions: seconds); None until then
        self.compiled_launch_s: float | None = None
        self.runs: list[StepRun] = []
        self.notes: list[str] = []
        self._counts: dict[str, StepCounts] = {}

    @property
    def triton_launch_s(self) -> float | None:
        """What one Triton launch costs the host beyond its wrapper's operator calls (the
        step's operator count holds those at `launch_s` each), at least 0; None off CUDA."""
        if self.triton_call is None:
            return None
        seconds, ops = self.triton_call
        return max(0.0, seconds - ops * self.launch_s)

    @property
    def bytes_floor_s(self) -> float:
        return self.weight_bytes / self.bandwidth

    def _options(self, name: str) -> dict:
        if name not in VARIANTS:
            raise ValueError(f"a variant is one of {list(VARIANTS)}; got {name!r}")
        options = VARIANTS[name]
        if options["cuda_graph"] and not self.overlapped:
            raise ValueError(f"{name!r} needs a CUDA device (CUDA graphs); this model is on "
                             f"{self.device}")
        return options

    def count(self, name: str) -> StepCounts:
        """The profiler's counts per step of variant ``name`` (warmed up first: compiled,
        captured); cached."""
        if name not in self._counts:
            from ..generate import generate

            options = self._options(name)
            generate(self.model, self.prompt, 1 + self.steps, ignore_eos=True, **options)
            counts = count_step_ops(self.model, self.prompt, self.count_steps, **options)
            if counts.compiled_launches and self.compiled_launch_s is None:
                self.compiled_launch_s = measure_compiled_launch_cost(self.model.device)
            self._counts[name] = counts
        return self._counts[name]

    def measure(self, name: str) -> StepRun:
        """Count and time variant ``name``; its row is added to ``runs``."""
        counts = self.count(name)
        step = time_decode_step(self.model, self.prompt, self.steps, self.rounds,
                                **self._options(name))
        run = StepRun(name, step, counts.host_ops, counts.launches, counts.kernels,
                      counts.triton_launches, counts.compiled_launches)
        self.runs = [r for r in self.runs if r.name != name] + [run]
        return run

    def launch_floor_s(self, run) -> float:
        """What the host takes to issue one step of ``run`` (a StepRun or StepCounts): its
        operator calls × the cost of one, plus on CUDA its Triton launches × theirs and its
        launches from compiled code × theirs (on a CPU every operator call is a launch, and
        there are no others)."""
        floor = calc.launch_floor_s(run.host_ops, self.launch_s)
        if self.triton_launch_s and run.triton_launches:
            floor += calc.launch_floor_s(run.triton_launches, self.triton_launch_s)
        if self.compiled_launch_s and run.compiled_launches:
            floor += calc.launch_floor_s(run.compiled_launches, self.compiled_launch_s)
        return floor

    def kernel_floor_s(self, run) -> float:
        """What the device takes to run one step of ``run``'s kernels (a StepRun or
        StepCounts) if each cost it only what a tiny one does; 0 off CUDA."""
        return 0.0 if self.kernel_s is None else run.kernels * self.kernel_s

    def predicted_s(self, run) -> float:
        return calc.step_floor_s(self.bytes_floor_s, self.launch_floor_s(run), self.overlapped,
                                 self.kernel_floor_s(run))

    def run(self, name: str) -> StepRun:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(f"no {name!r} run measured here; measured: {[r.name for r in self.runs]}")

    def table(self) -> str:
        how = "the largest floor" if self.overlapped else "the two floors added"
        triton = self.triton_launch_s is not None  # CUDA: the Triton launches' own column
        kernel = self.kernel_s is not None  # CUDA: the kernel floor's column
        compiled = self.compiled_launch_s is not None  # CUDA, a compiled step counted
        head = (f"{'decode step (batch 1)':<22}{'ops':>6}{'launches':>9}{'kernels':>9}"
                + (f"{'triton':>8}" if triton else "") + (f"{'compiled':>10}" if compiled else "")
                + f"{'launch floor':>14}" + (f"{'kernel floor':>14}" if kernel else "")
                + f"{'bytes floor':>13}{'predicted':>11}{'measured':>10}"
                f"{'tok/s':>8}")
        cost = (f"one launch costs {self.launch_s * 1e6:.2f} µs"
                + (f", one Triton launch {self.triton_launch_s * 1e6:.1f} µs" if triton else "")
                + (f", one launch from compiled code {self.compiled_launch_s * 1e6:.1f} µs"
                   if compiled else "")
                + (f", one kernel in a graph {self.kernel_s * 1e6:.2f} µs of the device"
                   if kernel else ""))
        floor = ("; launch floor = ops × one launch" if triton or compiled else "")
        floor += " + triton × one Triton launch" if triton else ""
        floor += " + compiled × one launch from compiled code" if compiled else ""
        lines = [f"{self.device} ({self.device_name}), {self.dtype}: {cost}; "
                 f"{self.weight_bytes / 1e6:.0f} MB of weights at "
                 f"{self.bandwidth / 1e9:.1f} GB/s; predicted = {how}{floor}", head, "-" * len(head)]
        for r in self.runs:
            lines.append(f"{r.name:<22}{r.host_ops:>6.0f}{r.launches:>9.0f}{r.kernels:>9.0f}"
                         + (f"{r.triton_launches:>8.0f}" if triton else "")
                         + (f"{r.compiled_launches:>10.0f}" if compiled else "")
                         + f"{self.launch_floor_s(r) * 1e3:>11.2f} ms"
                         + (f"{self.kernel_floor_s(r) * 1e3:>11.2f} ms" if kernel else "")
                         + f"{self.bytes_floor_s * 1e3:>10.2f} ms"
                         f"{self.predicted_s(r) * 1e3:>8.2f} ms{r.step_s * 1e3:>7.2f} ms"
                         f"{1 / r.step_s:>8.1f}")
        return "\n".join(lines + self.notes)

    def summary(self) -> list[str]:
        """What this device's numbers say: which floor binds the eager step, and what each
        other variant bought."""
        lines = []
        if any(r.name == "eager" for r in self.runs):
            eager = self.run("eager")
            launch, nbytes = self.launch_floor_s(eager), self.bytes_floor_s
            if launch > nbytes:
                lines.append(f"On {self.device}, the eager step's launch floor ({launch * 1e3:.2f} ms) "
                             f"is {launch / nbytes:.1f}× its bytes floor ({nbytes * 1e3:.2f} ms): "
                             f"batch-1 decode here is launch-bound, not memory-bound.")
            else:
                lines.append(f"On {self.device}, the eager step's bytes floor ({nbytes * 1e3:.2f} ms) "
                             f"is {nbytes / launch:.1f}× its launch floor ({launch * 1e3:.2f} ms): "
                             f"batch-1 decode here is memory-bound; the launches add "
                             f"{launch / (launch + nbytes):.0%} on top.")
            lines.append(f"The eager step reaches {nbytes / eager.step_s:.0%} of the bandwidth "
                         f"ceiling ({1 / eager.step_s:.1f} of {1 / nbytes:.0f} tok/s).")
            for r in self.runs:
                if r.name != "eager":
                    lines.append(f"{r.name}: {eager.step_s / r.step_s:.2f}× eager's speed, "
                                 f"{r.launches:.0f} launches per step instead of "
                                 f"{eager.launches:.0f}, {nbytes / r.step_s:.0%} of the ceiling.")
        for r in self.runs:  # a replayed step on a GPU: where its kernels' count binds
            kernels = self.kernel_floor_s(r)
            if VARIANTS[r.name]["cuda_graph"] and kernels > max(self.bytes_floor_s,
                                                                 self.launch_floor_s(r)):
                lines.append(f"{r.name}: its {r.kernels:.0f} kernels × {self.kernel_s * 1e6:.2f} µs "
                             f"each on the device are {kernels * 1e3:.2f} ms, "
                             f"{kernels / self.bytes_floor_s:.1f}× the bytes floor: with the "
                             f"launches gone, the number of kernels binds (fusing them lowers it).")
        return lines


def decode_bandwidth(model) -> tuple[float, str]:
    """(bytes/s, how it was measured): the bandwidth a batch-1 decode step's weight products
    get on ``model``'s device, for the bytes floor.

    On a CPU, the step's own products timed alone (``measure_weight_stream``): each runs as
    soon as it is issued, so their time is their stream, and most are 1-4 MB matrices that
    can stream slower than one model-sized matrix. On a GPU, one model-sized matrix-vector
    stream (``perf.measure_matvec_bandwidth``): timing 121 small products there would time
    their launches, which is the other floor, not this one."""
    from ..perf import measure_matvec_bandwidth
    from .steps import measure_weight_stream

    if model.device.type == "cpu":
        op = measure_weight_stream(model)
        return op.bytes_per_s, (f"the step's {op.details['num_products']} weight products alone, one row "
                                f"each, in model order: {op.bytes_per_s / 1e9:.1f} GB/s")
    bw = max(measure_matvec_bandwidth(model.device).values())
    return bw, f"one model-sized matrix-vector stream on {model.device}: {bw / 1e9:.1f} GB/s"


def measure_launch_wall(model, variants: Sequence[str] | None = None, *,
                        bandwidth_bytes_per_s: float, quick: bool = False,
                        **options) -> LaunchWall:
    """``LaunchWall(model, bandwidth_bytes_per_s, **options)`` with each of ``variants``
    (None: ``default_variants(model.device, quick)``) measured."""
    wall = LaunchWall(model, bandwidth_bytes_per_s, **options)
    for name in variants or default_variants(model.device, quick):
        wall.measure(name)
    return wall
