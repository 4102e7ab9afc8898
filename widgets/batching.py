"""Static against continuous batching, driven by the real scheduler (Lab 05).

No model runs here: ``simulate`` drives ``minillm.engine.Scheduler`` over a real
``BlockManager`` exactly as ``LLMEngine.step`` does (schedule -> advance -> append the
sampled tokens), but a step's "forward pass" only advances a simulated clock by

    step time = step_ms + ms_per_token · (tokens batched in the step)

and every sampled token is the same non-stop id. Everything else (admission, chunked
prefill under ``max_num_batched_tokens``, ``max_num_seqs``, block allocation, preemption,
the static policy, the per-request ttft/itl/e2e) is the engine's own code, so the slots chart
shows what the engine would do, in simulated seconds that do not depend on this machine.

    widgets.batching.view()                     # sliders: arrival rate, max batch, chunk size
    widgets.batching.latency_vs_load_data(...)  # the queueing curve against calc.mm1_mean_latency

Pure functions: ``poisson_arrivals``, ``simulate``, ``batching_data``,
``latency_vs_load_data``; figures: ``draw_batching``, ``draw_latency_vs_load``; view:
``BatchingView`` (CSS class ``minillm-batching``).

Invariants: a simulation is deterministic given its arguments (seeded arrivals; the
scheduler has no randomness); the idle clock jumps to the next arrival, so a step is only
recorded when something runs; token counts are conserved (every request generates exactly
its ``max_tokens``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np

from minillm import calc

from ._common import COLORS, FigureView, new_figure

__all__ = ["WORKLOAD", "load_workload", "poisson_arrivals", "StepRecord", "SimResult", "simulate",
           "BatchingData", "batching_data", "draw_batching", "LoadPoint", "LatencyLoadData",
           "latency_vs_load_data", "draw_latency_vs_load", "BatchingView", "view"]

WORKLOAD = Path(__file__).resolve().parents[1] / "benchmarks" / "workload.json"
_TOKEN = 5  # the id every simulated step "samples": any id that is not a stop token


@functools.lru_cache(maxsize=4)
def _workload(path: str) -> tuple[tuple[int, int], ...]:
    reqs = json.loads(Path(path).read_text())["requests"]
    return tuple((len(r["prompt_ids"]), int(r["max_tokens"])) for r in reqs)


def load_workload(n: int | None = None, path=WORKLOAD) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of the first ``n`` requests of benchmarks/workload.json."""
    lens = list(_workload(str(path)))
    return lens if n is None else lens[:n]


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process: exponential gaps of mean 1/rate. rate = inf:
    everyone at t = 0 (a closed batch)."""
    if rate_per_s <= 0:
        raise ValueError(f"arrival rate must be > 0 requests/s, got {rate_per_s}")
    if math.isinf(rate_per_s):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, n)
    return np.cumsum(gaps).tolist()


@dataclasses.dataclass
class StepRecord:
    start: float                    # simulated seconds
    duration: float
    slots: dict                     # slot index -> request index running in it this step
    num_batched_tokens: int
    num_decode_tokens: int          # requests that produced a token this step
    num_used_blocks: int
    num_kv_tokens: int              # token slots reserved by running requests
    block_owner: list | None = None  # per block: request index holding it (-1: free), if recorded
    block_fill: list | None = None   # per block: tokens it holds for its (first) owner


@dataclasses.dataclass
class SimResult:
    policy: str
    steps: list
    arrival: list                   # per request, seconds
    first_token: list               # per request, seconds (None if unfinished)
    finish: list
    num_tokens_out: list
    ttft: list
    mean_itl: list
    e2e: list
    makespan: float                 # first arrival .. last finish
    num_preemptions: int
    num_slots: int

    @property
    def total_output_tokens(self) -> int:
        return int(sum(self.num_tokens_out))

    @property
    def throughput(self) -> float:
        """Generated tokens per simulated second over the whole run."""
        return self.total_output_tokens / self.makespan if self.makespan > 0 else 0.0

    @property
    def busy_time(self) -> float:
        return sum(s.duration for s in self.steps)

    @property
    def utilization(self) -> float:
        """Slot-steps that produced a token / slot-steps available while the engine ran."""
        if not self.steps:
            return 0.0
        return sum(s.num_decode_tokens for s in self.steps) / (len(self.steps) * self.num_slots)


def simulate(requests, arrivals=None, *, policy: str = "continuous", max_num_seqs: int = 8,
             max_num_batched_tokens: int = 512, chunked_prefill: bool = True,
             num_blocks: int | None = None, block_size: int = 16, step_ms: float = 10.0,
             ms_per_token: float = 0.0, record_blocks: bool = False,
             max_steps: int = 200_000) -> SimResult:
    """Run ``requests`` [(prompt_len, output_len), ...] arriving at ``arrivals`` (s; default
    all at 0) through the real Scheduler and BlockManager on a simulated clock.

    ``num_blocks`` None: enough for every request at full length (no preemption).
    """
    from minillm.engine.request import Request, SamplingParams
    from minillm.engine.scheduler import Scheduler
    from minillm.paged.block_manager import BlockManager

    n = len(requests)
    arrivals = [0.0] * n if arrivals is None else list(arrivals)
    if len(arrivals) != n:
        raise ValueError(f"got {len(arrivals)} arrival times for {n} requests")
    if num_blocks is None:
        num_blocks = sum(-(-(p + o) // block_size) for p, o in requests) + 1
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens, chunked_prefill, policy)
    order = sorted(range(n), key=lambda i: (arrivals[i], i))
    reqs, index = [], {}
    for i, (p, o) in enumerate(requests):
        if -(-(p + o) // block_size) > num_blocks:
            raise ValueError(f"request {i} needs {-(-(p + o) // block_size)} blocks; the pool has {num_blocks}")
        # distinct prompts: prefix caching is off anyway, but never share by accident
        r = Request(f"r{i}", [(7 * i + j) % 49000 + 3 for j in range(p)],
                    SamplingParams(max_tokens=o, ignore_eos=True), None, 0, arrivals[i])
        reqs.append(r)
        index[r.seq_id] = i
    steps, slot_of, free_slots = [], {}, list(range(max_num_seqs))
    t, nxt = 0.0, 0
    while nxt < n or sched.has_unfinished():
        while nxt < n and arrivals[order[nxt]] <= t + 1e-12:
            sched.add(reqs[order[nxt]])
            nxt += 1
        if not sched.has_unfinished():
            t = arrivals[order[nxt]]
            continue
        out = sched.schedule()
        if not out.seqs:  # cannot happen with a pool sized as add_request demands
            raise RuntimeError("the scheduler found nothing to run while requests wait")
        for r in out.preempted:
            free_slots.append(slot_of.pop(index[r.seq_id]))
        running = [index[r.seq_id] for r in sched.running]
        for i in running:
            if i not in slot_of:
                free_slots.sort()
                slot_of[i] = free_slots.pop(0) if free_slots else max(slot_of.values(), default=-1) + 1
        dur = (step_ms + ms_per_token * out.num_batched_tokens) / 1e3
        rec = StepRecord(t, dur, {slot_of[i]: i for i in running}, out.num_batched_tokens,
                         sum(s.samples for s in out.seqs), num_blocks - bm.num_free_blocks(),
                         sum(bm.get_num_tokens(r.seq_id) for r in sched.running))
        if record_blocks:
            owner, fill = [-1] * num_blocks, [0] * num_blocks
            for r in sched.running:
                nt = bm.get_num_tokens(r.seq_id)
                for k, b in enumerate(bm.get_block_table(r.seq_id)):
                    owner[b] = index[r.seq_id]
                    fill[b] = min(block_size, nt - k * block_size)
            rec.block_owner, rec.block_fill = owner, fill
        steps.append(rec)
        t += dur
        sched.advance(out)
        sampled = [(s.request, _TOKEN) for s in out.seqs if s.samples]
        for req in sched.append_tokens(sampled, t):
            free_slots.append(slot_of.pop(index[req.seq_id]))
        if len(steps) > max_steps:
            raise RuntimeError(f"simulation passed {max_steps} steps; lower the load")
    m = [r.metrics for r in reqs]
    itl = [(sum(x.itl) / len(x.itl)) if x.itl else 0.0 for x in m]
    return SimResult(policy, steps, arrivals, [x.token_times[0] for x in m],
                     [x.finished_time for x in m], [len(x.token_times) for x in m],
                     [x.ttft for x in m], itl, [x.e2e for x in m],
                     max(x.finished_time for x in m) - min(arrivals), sched.num_preemptions,
                     max_num_seqs)


# --------------------------------------------------------------------------- static vs continuous


@dataclasses.dataclass
class BatchingData:
    static: SimResult
    continuous: SimResult
    arrival_rate: float
    max_num_seqs: int
    max_num_batched_tokens: int
    step_ms: float
    ms_per_token: float
    title: str
    summary: list = dataclasses.field(default_factory=list)


def _pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def _line(r: SimResult) -> str:
    return (f"{r.policy}: {r.throughput:.0f} tok/s, slot utilization {100 * r.utilization:.0f}%, "
            f"TTFT median {_pct(r.ttft, 50) * 1e3:.0f} ms (p90 {_pct(r.ttft, 90) * 1e3:.0f} ms), "
            f"ITL median {_pct(r.mean_itl, 50) * 1e3:.1f} ms (p90 of the per-request means "
            f"{_pct(r.mean_itl, 90) * 1e3:.1f} ms), E2E median {_pct(r.e2e, 50):.2f} s")


def batching_data(arrival_rate: float = 8.0, max_num_seqs: int = 8,
                  max_num_batched_tokens: int = 512, num_requests: int = 32, seed: int = 0,
                  step_ms: float = 10.0, ms_per_token: float = 0.02, requests=None) -> BatchingData:
    """The same workload (the first ``num_requests`` of benchmarks/workload.json, Poisson
    arrivals at ``arrival_rate`` req/s) through the static and the continuous scheduler."""
    reqs = load_workload(num_requests) if requests is None else list(requests)
    arr = poisson_arrivals(len(reqs), arrival_rate, seed)
    kw = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              step_ms=step_ms, ms_per_token=ms_per_token)
    st = simulate(reqs, arr, policy="static", **kw)
    co = simulate(reqs, arr, policy="continuous", **kw)
    title = (f"{len(reqs)} requests, Poisson {arrival_rate:g} req/s, max {max_num_seqs} seqs, "
             f"{max_num_batched_tokens} tokens/step; step = {step_ms:g} ms + {ms_per_token:g} ms/token")
    summary = [_line(st), _line(co),
               f"continuous / static throughput: {co.throughput / st.throughput:.2f}×"]
    return BatchingData(st, co, arrival_rate, max_num_seqs, max_num_batched_tokens, step_ms,
                        ms_per_token, title, summary)


def _draw_slots(ax, r: SimResult, t_end: float, cmap):
    for s in r.steps:
        for slot, i in s.slots.items():
            ax.broken_barh([(s.start, s.duration)], (slot - 0.4, 0.8), color=cmap(i % 20), lw=0)
    ax.set_xlim(0, t_end)
    ax.set_ylim(-0.6, r.num_slots - 0.4)
    ax.set_ylabel("slot")
    ax.set_title(f"{r.policy}: utilization {100 * r.utilization:.0f}%, "
                 f"{r.throughput:.0f} tok/s (simulated)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)


def draw_batching(data: BatchingData, fig=None):
    """Slots over time, static above continuous (colour = request), and the cumulative
    tokens generated by each."""
    import matplotlib

    fig = fig or new_figure(12, 7)
    axes = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1, 0.8]})
    t_end = max(data.static.makespan, data.continuous.makespan) + max(data.static.arrival)
    cmap = matplotlib.colormaps["tab20"]
    _draw_slots(axes[0], data.static, t_end, cmap)
    _draw_slots(axes[1], data.continuous, t_end, cmap)
    for r, color in ((data.static, COLORS["bound"]), (data.continuous, COLORS["machine"])):
        t = [s.start + s.duration for s in r.steps]
        axes[2].plot(t, np.cumsum([s.num_decode_tokens for s in r.steps]), color=color, label=r.policy)
    axes[2].scatter(data.static.arrival, [0] * len(data.static.arrival), marker="|", color="black",
                    label="arrivals")
    axes[2].set_ylabel("tokens generated")
    axes[2].set_xlabel("simulated time (s)")
    axes[2].legend(fontsize=8)
    axes[2].grid(True, alpha=0.3)
    fig.suptitle(data.title, fontsize=10)
    return fig


# --------------------------------------------------------------------------- queueing


@dataclasses.dataclass
class LoadPoint:
    rho: float
    arrival_rate: float
    measured_mean_s: float
    mm1_mean_s: float


@dataclasses.dataclass
class LatencyLoadData:
    points: list
    service_rate: float
    mean_output: float
    step_ms: float
    num_requests: int
    title: str
    summary: list = dataclasses.field(default_factory=list)


def latency_vs_load_data(rhos=(0.1, 0.3, 0.5, 0.7, 0.8, 0.9), num_requests: int = 1000,
                         mean_output: int = 20, step_ms: float = 10.0, seed: int = 0) -> LatencyLoadData:
    """Mean time in system against utilization, measured with the real scheduler.

    One slot (max_num_seqs = 1) and geometric output lengths (mean ``mean_output`` tokens,
    one step each, prompts of 1 token so prefill is one step too) make the engine a
    single server with near-exponential service of mean ``mean_output · step``: an M/M/1
    queue, whose mean latency is ``calc.mm1_mean_latency``.
    """
    rng = np.random.default_rng(seed)
    outs = rng.geometric(1.0 / mean_output, num_requests).tolist()
    reqs = [(1, int(o)) for o in outs]
    mu = 1.0 / (float(np.mean(outs)) * step_ms / 1e3)  # the sample's own service rate
    points = []
    for i, rho in enumerate(rhos):
        lam = rho * mu
        r = simulate(reqs, poisson_arrivals(num_requests, lam, seed + 1 + i), max_num_seqs=1,
                     step_ms=step_ms, num_blocks=max(-(-(o + 1) // 16) for o in outs) + 1)
        points.append(LoadPoint(rho, lam, float(np.mean(r.e2e)), calc.mm1_mean_latency(lam, mu)))
    summary = [f"mean service time {np.mean(outs):.1f} steps × {step_ms:g} ms = {1e3 / mu:.0f} ms (μ = {mu:.2f} req/s), "
               f"{num_requests} requests per point"]
    summary += [f"ρ = {p.rho:.2f}: measured {p.measured_mean_s * 1e3:.0f} ms, "
                f"M/M/1 {p.mm1_mean_s * 1e3:.0f} ms" for p in points]
    return LatencyLoadData(points, mu, mean_output, step_ms, num_requests,
                           "Mean latency against utilization: the real scheduler vs M/M/1", summary)


def draw_latency_vs_load(data: LatencyLoadData, fig=None):
    fig = fig or new_figure(8, 4.5)
    ax = fig.subplots()
    rho = np.linspace(0.02, 0.97, 200)
    ax.plot(rho, 1e3 / (data.service_rate * (1 - rho)), color=COLORS["grey"], lw=2,
            label="M/M/1: W = 1 / (μ − λ)  (calc.mm1_mean_latency)")
    ax.plot([p.rho for p in data.points], [p.measured_mean_s * 1e3 for p in data.points], "o-",
            color=COLORS["measured"], label="measured: real Scheduler, simulated clock")
    ax.axvline(0.8, color=COLORS["bound"], ls=":", lw=1)
    ax.text(0.805, 0.9, "ρ = 0.8", transform=ax.get_xaxis_transform(), color=COLORS["bound"], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1e3 / (data.service_rate * 0.05))
    ax.set_xlabel("utilization ρ = λ / μ")
    ax.set_ylabel("mean time in system (ms)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)
    ax.set_title(data.title, fontsize=10)
    return fig


# --------------------------------------------------------------------------- the view


class BatchingView(FigureView):
    """Controls: ``arrival_rate`` (FloatLogSlider, req/s), ``max_num_seqs`` (IntSlider),
    ``max_num_batched_tokens`` (SelectionSlider)."""

    css = "minillm-batching"

    def __init__(self, arrival_rate: float = 8.0, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 512, num_requests: int = 32, **kwargs):
        import ipywidgets as w

        self.num_requests, self.kwargs = num_requests, kwargs
        controls = {
            "arrival_rate": w.FloatLogSlider(value=arrival_rate, base=2, min=-2, max=6, step=0.5,
                                             description="arrival rate (req/s)"),
            "max_num_seqs": w.IntSlider(value=max_num_seqs, min=1, max=32, description="max batch"),
            "max_num_batched_tokens": w.SelectionSlider(
                options=[64, 128, 256, 512, 1024, 2048, 4096], value=max_num_batched_tokens,
                description="chunk (tokens/step)"),
        }
        super().__init__(controls)

    def compute(self) -> BatchingData:
        c = self.controls
        return batching_data(c["arrival_rate"].value, c["max_num_seqs"].value,
                             c["max_num_batched_tokens"].value, self.num_requests, **self.kwargs)

    def draw(self, data):
        return draw_batching(data)


def view(**kwargs) -> BatchingView:
    """``display(widgets.batching.view())``; keyword arguments set the start."""
    return BatchingView(**kwargs)


# --------------------------------------------------------------------------- the real engine


def tiny_workload(n: int = 24, seed: int = 0, vocab_size: int = 128) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) for the tiny random model: prompts of 8-32 tokens, outputs
    of 8-48 tokens, and every eighth request a long one of 200 (the straggler static batching
    waits for)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, vocab_size, int(rng.integers(8, 33))).tolist()
        out.append((prompt, 200 if i % 8 == 7 else int(rng.integers(8, 49))))
    return out


def run_engine(model, requests, policy: str, max_num_seqs: int = 8, max_num_batched_tokens: int = 512) -> dict:
    """Run ``requests`` [(prompt_ids, max_tokens)] through a real LLMEngine (all queued at
    once); return steps, generated tokens, wall seconds, tok/s and mean TTFT/ITL."""
    import time

    from minillm.engine import LLMEngine, SamplingParams

    eng = LLMEngine(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    scheduling=policy, enable_prefix_caching=False)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=t0)
    while eng.has_unfinished_requests():
        eng.step()
    wall = time.perf_counter() - t0
    m = list(eng.finished_metrics.values())
    st = eng.stats()
    itl = [x for r in m for x in r.itl]
    return {"policy": policy, "steps": st["num_steps"], "tokens": st["num_generated_tokens"],
            "wall_s": wall, "tok_per_s": st["num_generated_tokens"] / wall,
            "mean_ttft_s": float(np.mean([r.ttft for r in m])), "mean_itl_s": float(np.mean(itl)),
            "tokens_per_step": st["num_generated_tokens"] / st["num_steps"]}
