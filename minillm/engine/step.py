"""One step of the engine loop, shared by `LLMEngine.step` and Lab 05's simulator.

    schedule -> execute (the forward pass) -> advance num_computed_tokens
             -> fork the n > 1 samples whose prompt is now computed -> sample one token per
                sampling sequence -> append the tokens (stop checks; finish and free)

`run_step` takes the forward pass and the sampler as functions, so the engine plugs in its
`ModelRunner` and per-request sampling while `widgets.batching.simulate` plugs in a clock
that advances by a modelled step time and a sampler that always returns one token. The
scheduling, block allocation, preemption and finishing are then the same code in both.

If `execute` raises, the step is undone (`Scheduler.undo`) before the error propagates:
nothing is lost and the engine can go on.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .request import Request
from .scheduler import Scheduler, SchedulerOutput


@dataclass
class StepResult:
    scheduled: SchedulerOutput
    now: float                                       # when the forward pass ended
    sampled: list[tuple[Request, int]] = field(default_factory=list)  # (request, token)
    forked: list[Request] = field(default_factory=list)  # samples 1..n-1 born this step


def run_step(scheduler: Scheduler, execute: Callable[[SchedulerOutput], Any],
             sample: Callable[[Any, list[tuple[Request, int]]], list[int]],
             clock: Callable[[], float]) -> StepResult | None:
    """One step; None if the scheduler found nothing to run.

    execute(scheduled) -> what `sample` reads (the engine: logits of the sampling rows).
    sample(result, [(request, row), ...]) -> one token per request, where row is the index
    of its sequence among the scheduled sequences that sample (forked samples share their
    parent's row)."""
    out = scheduler.schedule()
    if not out.seqs:
        return None
    try:
        result = execute(out)
    except BaseException:
        scheduler.undo(out)
        raise
    step = StepResult(out, clock())
    scheduler.advance(out)
    rows = []
    for row, s in enumerate([s for s in out.seqs if s.samples]):
        group = [s.request]
        if s.request.num_pending_forks:
            children = scheduler.fork(s.request, step.now)
            step.forked += children
            group += children
        rows += [(req, row) for req in group]
    step.sampled = list(zip([req for req, _ in rows], sample(result, rows)))
    scheduler.append_tokens(step.sampled, step.now)
    return step
