"""Collectives that count themselves: every message a rank sends goes through here and is
written to the active `CommLedger`.

The parallel layers never call `torch.distributed` directly; they call `all_reduce`,
`gather_to_first`, `broadcast`, `send` and `recv` below, which do the collective on the
default process group, time it, and record one `CommRecord` on this rank's ledger (if one
is active, see `use_ledger`). So the ledger is a complete list of what this rank put on the
wire, and a test can compare it with the `calc` formula byte for byte.

Invariant: `num_bytes` is the size of the tensor this rank hands to the operation (the
message), not the ring's traffic: an all-reduce of [T, d] fp32 is recorded as T · d · 4
whatever the world size (`calc.ring_allreduce_bytes` turns it into traffic).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class CommRecord:
    op: str                  # "all_reduce", "gather", "broadcast", "send", "recv"
    num_bytes: int           # bytes of the tensor this rank handed to the operation
    shape: tuple
    dtype: str
    phase: str | None        # "prefill", "decode", "pipeline", ... (set by CommLedger.step)
    step: int | None = None  # index of the CommLedger.step it belongs to
    time_s: float = 0.0      # wall time spent inside the call on this rank


class CommLedger:
    """Every collective of this rank, in order, tagged with the step and phase it ran in.

        ledger = CommLedger()
        with use_ledger(ledger), ledger.step("prefill"):
            model(ids)
        ledger.num_allreduces("prefill"), ledger.bytes("all_reduce", "prefill")
    """

    def __init__(self):
        self.records: list[CommRecord] = []
        self.phase: str | None = None
        self.step_index: int | None = None
        self._steps = 0

    @contextlib.contextmanager
    def step(self, phase: str):
        """Tag the collectives inside the block with `phase` and a new step index."""
        saved = self.phase, self.step_index
        self.phase, self.step_index = phase, self._steps
        self._steps += 1
        try:
            yield self
        finally:
            self.phase, self.step_index = saved

    def add(self, op: str, tensor: torch.Tensor, time_s: float) -> None:
        self.records.append(CommRecord(op, tensor.numel() * tensor.element_size(),
                                       tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                       self.phase, self.step_index, time_s))

    def select(self, op: str | None = None, phase: str | None = None,
               step: int | None = None) -> list[CommRecord]:
        return [r for r in self.records if (op is None or r.op == op)
                and (phase is None or r.phase == phase) and (step is None or r.step == step)]

    def num_allreduces(self, phase: str | None = None) -> int:
        return len(self.select("all_reduce", phase))

    def bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.num_bytes for r in self.select(op, phase))

    def time_s(self, op: str | None = None, phase: str | None = None) -> float:
        """Wall time this rank spent inside collectives (waiting for slower ranks included)."""
        return sum(r.time_s for r in self.select(op, phase))

    def steps(self) -> list[int]:
        return sorted({r.step for r in self.records if r.step is not None})

    def summary(self) -> str:
        """One row per (phase, op): count, bytes per message, total bytes, time."""
        rows: dict[tuple, list[CommRecord]] = {}
        for r in self.records:
            rows.setdefault((r.phase, r.op), []).append(r)
        lines = [f"{'phase':10s} {'op':10s} {'count':>6s} {'bytes each':>12s} "
                 f"{'total bytes':>12s} {'time ms':>9s}"]
        for (phase, op), rs in rows.items():
            sizes = sorted({r.num_bytes for r in rs})
            each = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,}..{sizes[-1]:,}"
            lines.append(f"{phase or '-':10s} {op:10s} {len(rs):6d} {each:>12s} "
                         f"{sum(r.num_bytes for r in rs):12,d} "
                         f"{1e3 * sum(r.time_s for r in rs):9.2f}")
        return "\n".join(lines)


_ACTIVE: CommLedger | None = None


@contextlib.contextmanager
def use_ledger(ledger: CommLedger):
    """Record this process's collectives in `ledger` inside the block."""
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, ledger
    try:
        yield ledger
    finally:
        _ACTIVE = saved


def active_ledger() -> CommLedger | None:
    return _ACTIVE


def _timed(op: str, tensor: torch.Tensor, call):
    # Under NCCL a collective returns once it is queued: the seconds are the host's unless
    # the compute stream is drained before and after (the queued compute is not the
    # collective's; its end is when the stream has it). An isend stays asynchronous: waiting
    # for it would wait for the receiver and serialize the pipeline being measured.
    settle = _ACTIVE is not None and tensor.is_cuda and op != "send"
    if settle:
        torch.cuda.current_stream(tensor.device).synchronize()
    start = time.perf_counter()
    result = call()
    if settle:
        torch.cuda.current_stream(tensor.device).synchronize()
    if _ACTIVE is not None:
        _ACTIVE.add(op, tensor, time.perf_counter() - start)
    return result


def world_size() -> int:
    """Ranks in the default group, 1 when torch.distributed is not initialized."""
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def rank() -> int:
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else 0


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place; returns it. Identical result on every rank."""
    _timed("all_reduce", tensor, lambda: tdist.all_reduce(tensor))
    return tensor


def gather_to_first(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """Rank 0 gets every rank's `tensor` (equal shapes), in rank order; others get None."""
    parts = [torch.empty_like(tensor) for _ in range(world_size())] if rank() == 0 else None
    _timed("gather", tensor, lambda: tdist.gather(tensor, parts, dst=0))
    return parts


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank `src`'s `tensor` into every rank's, in place; returns it."""
    _timed("broadcast", tensor, lambda: tdist.broadcast(tensor, src))
    return tensor


def send(tensor: torch.Tensor, dst: int):
    """Start sending `tensor` to rank `dst`; returns the request (call `.wait()`)."""
    return _timed("send", tensor, lambda: tdist.isend(tensor.contiguous(), dst))


def recv(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Receive into `tensor` from rank `src` (blocks); returns it."""
    _timed("recv", tensor, lambda: tdist.recv(tensor, src))
    return tensor
