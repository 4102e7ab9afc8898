"""The Lab 05 simulator: the real scheduler and block manager on a simulated clock.

``simulate`` runs ``minillm.engine.step.run_step``, the step ``LLMEngine.step`` runs, with a
"forward pass" that only advances the clock by ``step_ms + ms_per_token · tokens`` and a
sampler that always returns one non-stop token. ``widgets.batching`` draws what it records.

Invariants: a simulation is deterministic given its arguments; the idle clock jumps to the
next arrival, so a step is only recorded when something runs; every request generates
exactly its ``max_tokens``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np

__all__ = ["WORKLOAD", "load_workload", "poisson_arrivals", "StepRecord", "SimResult",
           "simulate"]

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
    from minillm.engine.step import run_step
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
    clock = [0.0]  # simulated seconds

    def execute(out):
        """The "forward pass": record the step as scheduled, then advance the clock."""
        for r in out.preempted:
            free_slots.append(slot_of.pop(index[r.seq_id]))
        running = [index[r.seq_id] for r in sched.running]
        for i in running:
            if i not in slot_of:
                free_slots.sort()
                slot_of[i] = free_slots.pop(0) if free_slots else max(slot_of.values(), default=-1) + 1
        dur = (step_ms + ms_per_token * out.num_batched_tokens) / 1e3
        rec = StepRecord(clock[0], dur, {slot_of[i]: i for i in running}, out.num_batched_tokens,
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
        clock[0] += dur

    nxt = 0
    while nxt < n or sched.has_unfinished():
        while nxt < n and arrivals[order[nxt]] <= clock[0] + 1e-12:
            sched.add(reqs[order[nxt]])
            nxt += 1
        if not sched.has_unfinished():
            clock[0] = arrivals[order[nxt]]
            continue
        # The engine's own step, with a clock and a sampler in place of the model.
        step = run_step(sched, execute, lambda _, rows: [_TOKEN] * len(rows), lambda: clock[0])
        if step is None:  # cannot happen with a pool sized as add_request demands
            raise RuntimeError("the scheduler found nothing to run while requests wait")
        for req, _ in step.sampled:
            if req.is_finished:
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
