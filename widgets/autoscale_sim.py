"""Autoscaling on queue depth, tested against the serving simulator (Lab 09).

A fleet of replicas, each Lab 05's simulated engine (the real ``Scheduler`` and
``BlockManager`` on a clock advanced by a ``StepModel``), behind a load balancer that sends
each arrival to the ready replica holding the fewest requests. Every ``rule.interval_s`` the
autoscaler (``minillm.serve.autoscale.ScaleRule``) reads the fleet's requests in flight
(waiting + running: the queue depth with its batch) and asks for more or fewer replicas. A
new replica takes traffic only ``startup_s`` after it was asked for: the time to load the
model and warm up, until its readiness probe passes. A replica scaled down stops receiving
traffic, finishes what it holds, and is gone.

    arrivals = piecewise_poisson([(2.0, 30), (10.0, 60), (2.0, 30)])   # (req/s, seconds)
    fixed = simulate_fleet(arrivals, step_model, max_num_seqs=8, replicas=1)
    scaled = simulate_fleet(arrivals, step_model, max_num_seqs=8, rule=ScaleRule(8, 1, 4),
                            startup_s=20)
    scaled.summary()       # p50 / p99 TTFT and E2E, replica-seconds (what you pay for)

Invariants: deterministic given its arguments; every request completes with exactly
``output_len`` tokens; no request is routed to a replica before it is ready or after it was
scaled down; the replica count stays within the rule's [min, max]; with ``rule=None`` and
one replica the result equals ``batching_sim.simulate`` on the same arrivals (the same
scheduler on the same clock: tests/test_autoscale.py checks it).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from minillm import calc

from .batching_sim import _TOKEN  # the one simulator's sampled token: one replica matches it
from .serving_sim import StepModel

__all__ = ["piecewise_poisson", "FleetResult", "simulate_fleet", "draw_fleet"]



def piecewise_poisson(phases, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process whose rate changes: ``phases`` is
    [(rate req/s, duration s), ...] in order."""
    rng, out, start = np.random.default_rng(seed), [], 0.0
    for rate, duration in phases:
        if not (rate > 0 and duration > 0):
            raise ValueError(f"each phase needs rate > 0 and duration > 0, got ({rate}, {duration})")
        t = start
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= start + duration:
                break
            out.append(t)
        start += duration
    return out


class _Replica:
    def __init__(self, k: int, created: float, ready_at: float, max_num_seqs: int,
                 max_num_batched_tokens: int, num_blocks: int, block_size: int, step: StepModel):
        from minillm.engine.scheduler import Scheduler
        from minillm.paged.block_manager import BlockManager

        self.k, self.created, self.ready_at, self.removed = k, created, ready_at, None
        self.draining = False
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sched = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, True,
                               "continuous")
        self.clock = ready_at   # when its next step may start
        self.step_model = step

    def in_flight(self) -> int:
        return len(self.sched.waiting) + len(self.sched.running)

    def ready(self, t: float) -> bool:
        return not self.draining and self.ready_at <= t + 1e-12

    def step(self) -> None:
        from minillm.engine.step import run_step

        def execute(out):
            self.clock += self.step_model.step_s(out.num_batched_tokens)

        if run_step(self.sched, execute, lambda _, rows: [_TOKEN] * len(rows),
                    lambda: self.clock) is None:
            raise RuntimeError("the scheduler found nothing to run while requests wait")


@dataclasses.dataclass
class FleetResult:
    ttft: list                  # s, per request in arrival order
    e2e: list
    times: np.ndarray           # the autoscaler's evaluation times (s)
    replicas: np.ndarray        # replicas asked for at each evaluation (starting ones included)
    ready: np.ndarray           # replicas taking traffic at each evaluation
    in_flight: np.ndarray       # the fleet's waiting + running requests at each evaluation
    replica_seconds: float      # Σ over replicas of (gone − asked for): what the fleet costs
    label: str

    def p(self, what: str, q: float) -> float:
        return calc.percentile(getattr(self, what), q)

    def summary(self) -> str:
        return (f"{self.label:40s} TTFT p50 {self.p('ttft', 50):6.2f} s p99 {self.p('ttft', 99):6.2f} s"
                f" | E2E p50 {self.p('e2e', 50):6.2f} s p99 {self.p('e2e', 99):6.2f} s"
                f" | {self.replica_seconds:7.0f} replica-seconds (max {int(self.replicas.max())} replicas)")


def simulate_fleet(arrivals, step_model: StepModel, *, max_num_seqs: int = 8, prompt_len: int = 32,
                   output_len: int = 16, replicas: int = 1, rule=None, startup_s: float = 0.0,
                   max_num_batched_tokens: int = 512, block_size: int = 16,
                   num_blocks: int | None = None, label: str | None = None) -> FleetResult:
    """Serve ``arrivals`` (s) of requests of ``prompt_len`` + ``output_len`` tokens with a
    fixed fleet of ``replicas`` (``rule=None``) or one that ``rule`` scales, starting from
    ``rule.min_replicas``; a replica asked for takes traffic ``startup_s`` later."""
    from minillm.engine.request import Request, SamplingParams

    arrivals = sorted(float(a) for a in arrivals)
    n = len(arrivals)
    if n == 0:
        raise ValueError("simulate_fleet needs at least one arrival")
    if num_blocks is None:  # four full batches' worth per replica: no preemption
        num_blocks = max_num_seqs * -(-(prompt_len + output_len) // block_size) * 4 + 1
    make = lambda k, t, ready: _Replica(k, t, ready, max_num_seqs, max_num_batched_tokens,  # noqa: E731
                                        num_blocks, block_size, step_model)
    start = rule.min_replicas if rule is not None else replicas
    fleet = [make(k, 0.0, 0.0) for k in range(start)]
    reqs = [Request(f"r{i}", [(7 * i + j) % 49000 + 3 for j in range(prompt_len)],
                    SamplingParams(max_tokens=output_len, ignore_eos=True), None, 0, arrivals[i])
            for i in range(n)]
    history, times, asked, ready_n, flight = [], [], [], [], []
    interval = rule.interval_s if rule is not None else 1.0
    next_tick, nxt = interval, 0
    while True:
        busy = [r for r in fleet if r.removed is None and r.sched.has_unfinished()]
        if nxt >= n and not busy:
            break
        t_arrival = arrivals[nxt] if nxt < n else math.inf
        t_step = min((r.clock for r in busy), default=math.inf)
        t = min(t_arrival, t_step, next_tick)
        if t == t_arrival:                       # route to the least-loaded ready replica
            ready = [r for r in fleet if r.removed is None and r.ready(t)]
            if not ready:                       # all starting: the oldest starting one queues it
                ready = sorted((r for r in fleet if r.removed is None and not r.draining),
                               key=lambda r: r.ready_at)[:1]
            target = min(ready, key=lambda r: (r.in_flight(), r.k))
            if not target.sched.has_unfinished():
                target.clock = max(target.clock, t)
            target.sched.add(reqs[nxt])
            nxt += 1
        elif t == t_step:
            min(busy, key=lambda r: (r.clock, r.k)).step()
        else:                                    # the autoscaler's turn (also records the fleet)
            live = [r for r in fleet if r.removed is None and not r.draining]
            total = sum(r.in_flight() for r in fleet if r.removed is None)
            if rule is not None:
                want = rule.desired(len(live), total, history, t)
                for _ in range(want - len(live)):
                    fleet.append(make(len(fleet), t, t + startup_s))
                surplus = len(live) - want
                for r in sorted(live, key=lambda r: (r.ready_at <= t, r.in_flight(), -r.k))[:max(surplus, 0)]:
                    r.draining = True            # starting ones first, then the least loaded
            for r in fleet:
                if r.draining and r.removed is None and not r.sched.has_unfinished():
                    r.removed = t
            times.append(t)
            asked.append(sum(r.removed is None and not r.draining for r in fleet))
            ready_n.append(sum(r.removed is None and r.ready(t) for r in fleet))
            flight.append(total)
            next_tick += interval
    end = max(r.metrics.finished_time for r in reqs)
    cost = sum((r.removed if r.removed is not None else end) - r.created for r in fleet)
    m = [r.metrics for r in reqs]
    return FleetResult([x.ttft for x in m], [x.e2e for x in m], np.array(times), np.array(asked),
                       np.array(ready_n), np.array(flight), cost,
                       label or (f"autoscaled {rule.min_replicas}-{rule.max_replicas}" if rule
                                 else f"{replicas} replica(s), fixed"))


def draw_fleet(result: FleetResult, fig=None):
    """The requests in flight (the autoscaler's metric) and the replicas asked for and ready,
    at each evaluation."""
    from ._view import COLORS, new_figure

    fig = fig or new_figure(10, 3.6)
    ax = fig.subplots()
    ax.plot(result.times, result.in_flight, color=COLORS["bound"], lw=1, label="requests in flight")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("requests (waiting + running)")
    bx = ax.twinx()
    bx.step(result.times, result.replicas, where="post", color=COLORS["machine"], label="replicas asked for")
    bx.step(result.times, result.ready, where="post", color=COLORS["compute"], ls="--", label="replicas ready")
    bx.set_ylabel("replicas")
    bx.set_ylim(0, max(result.replicas.max(), 1) + 1)
    ax.legend(loc="upper left", fontsize=8)
    bx.legend(loc="upper right", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{result.label}: the fleet follows the queue, one start-up late", fontsize=10)
    return fig
