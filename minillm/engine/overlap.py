"""Async scheduling: launch step N+1 before reading step N's sampled ids back (vLLM v1).

A decode step on a GPU is host-bound: the host's share (schedule, build the inputs, read the
ids back, append them, stop checks, outputs) is added to every step while the GPU waits.

    sync   host: schedule N | launch N | read N ......| append N | schedule N+1 | launch N+1
           GPU :            |          | run N        |          |              |
    async  host: schedule N+1 | launch N+1 | read N | append N, outputs N | schedule N+2 ...
           GPU :   ... run N  ............ | run N+1 ..........................

`launch_step` schedules and launches a step with the one before still in flight: each
sampling request gets a placeholder token (`Request.num_pending_tokens`, see
`minillm.engine.scheduler` for what may and may not read one), and the step's ids stay on
the device (`SampledIds`), where the next step's decode rows take their input tokens
from. `resolve_step` then reads the ids back (`ReadBack`: one copy, started at launch),
writes them over the placeholders, and runs the stop checks. Seeded sampling draws the
same numbers as the synchronous engine: each request's generator is drawn at launch, in
the same order, for its own rows.

A request that stops on a token value (a stop id, EOS) is found to stop only when that
token resolves, after the next step was launched: that step computed one more token for
it, which `resolve_step` drops. Reaching max_tokens is known at launch: the request is
retired then, and never scheduled again.

If the launch fails, the scheduler undoes the new step (`Scheduler.undo`, as `run_step`
does) and the caller resolves the step still in flight before the error propagates, so
nothing is lost and no placeholder is left behind. On a CPU the same code runs with no
real overlap (everything is synchronous there): that is how the CPU tests cover it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .request import Request
from .scheduler import Scheduler, SchedulerOutput
from .staging import ReadBack
from .step import StepResult, advance, run_forward


@dataclass
class SampledIds:
    """A launched step's sampled ids, on the device: ids[k] is the token of the k-th
    sampling row, and `index` maps each sampling sequence (its seq_id) to its k."""
    ids: torch.Tensor
    index: dict

    def source(self, seq_id) -> int:
        try:
            return self.index[seq_id]
        except KeyError:
            raise RuntimeError(f"sequence {seq_id!r} has a placeholder input token but did "
                               f"not sample in the step in flight: only that step's tokens "
                               f"may be pending when the next is scheduled") from None


@dataclass
class InFlight:
    """A launched step whose sampled ids are not read back yet."""
    step: StepResult
    rows: list[tuple[Request, int]]  # (request, position of its placeholder in its output)
    sampled: SampledIds
    read_back: ReadBack


def launch_step(scheduler: Scheduler, execute: Callable[[SchedulerOutput, Any], Any],
                sample: Callable[[Any, list[tuple[Request, int]]], torch.Tensor],
                clock: Callable[[], float], prev: InFlight | None) -> InFlight | None:
    """Schedule and launch a step while `prev` is in flight; None if nothing to run.

    execute(scheduled[, prev's SampledIds]) -> what `sample` reads; sample(result,
    [(request, row), ...]) -> one token id per pair, on the device (not read back)."""
    out = scheduler.schedule()
    if not out.seqs:
        return None
    result = run_forward(scheduler, out, execute if prev is None else
                         lambda o: execute(o, prev.sampled))
    step = StepResult(out, clock())
    rows = advance(scheduler, step)
    ids = sample(result, rows)
    reqs = [req for req, _ in rows]
    positions = scheduler.append_placeholders(reqs)
    return InFlight(step, list(zip(reqs, positions)),
                    SampledIds(ids, {req.seq_id: k for k, req in enumerate(reqs)}),
                    ReadBack(ids))


def resolve_step(scheduler: Scheduler, flight: InFlight,
                 clock: Callable[[], float]) -> StepResult:
    """Read the step's ids back and apply them: its `sampled` is the (request, token) pairs
    kept, `now` the time the host learned them (the tokens' times in the metrics)."""
    tokens = flight.read_back.tolist()
    step = flight.step
    step.now = clock()
    step.sampled = scheduler.resolve_tokens(
        [(req, pos, t) for (req, pos), t in zip(flight.rows, tokens)], step.now)
    return step
