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

`run_forward` and `advance` are the parts of a step that `minillm.engine.overlap` (async
scheduling: the next step launched before this one's ids are read back) shares with it.
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
    now: float  # when the forward pass ended (async scheduling: when its ids were read back)
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
    result = run_forward(scheduler, out, execute)
    step = StepResult(out, clock())
    rows = advance(scheduler, step)
    step.sampled = list(zip([req for req, _ in rows], sample(result, rows)))
    scheduler.append_tokens(step.sampled, step.now)
    return step


def run_forward(scheduler: Scheduler, out: SchedulerOutput,
                execute: Callable[[SchedulerOutput], Any]) -> Any:
    """execute(out); if it raises, undo the step first (see the module doc)."""
    try:
        return execute(out)
    except BaseException:
        scheduler.undo(out)
        raise


def advance(scheduler: Scheduler, step: StepResult) -> list[tuple[Request, int]]:
    """After the forward pass: count the computed tokens, fork the n > 1 samples whose
    prompt is now computed (into step.forked), and return the (request, row) pairs that
    sample, as `run_step`'s `sample` takes them."""
    scheduler.advance(step.scheduled)
    rows = []
    for row, s in enumerate([s for s in step.scheduled.seqs if s.samples]):
        group = [s.request]
        if s.request.num_pending_forks:
            children = scheduler.fork(s.request, step.now)
            step.forked += children
            group += children
        rows += [(req, row) for req in group]
    return rows
