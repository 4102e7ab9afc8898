"""The scheduler: which requests run this step, and how many tokens each (vLLM v1 style).

Every request has one counter, `num_computed_tokens`, and wants it to reach `num_tokens`
(prompt + generated so far). A step has a budget of `max_num_batched_tokens` tokens and
`max_num_seqs` sequences. `schedule()` spends it in this order:

  1. running requests with one token left (decodes), oldest first: 1 token each;
  2. running requests with an unfinished prompt (chunked prefill): the next chunk;
  3. waiting requests, first come first served (continuous mode): allocate blocks (a
     prefix-cache hit advances num_computed_tokens for free), then a first chunk.

Without `chunked_prefill` a prompt is scheduled whole or waits. One step may mix decodes
and prefill chunks: the model runner flattens them all into one forward pass.

Preemption by recompute: when a decode needs a new block and the pool is empty, the NEWEST
running request is freed and put back at the FRONT of the waiting queue with
num_computed_tokens = 0 (its generated tokens are kept and recomputed with the prompt).
No request is admitted in a step that preempted. The oldest request can always progress,
because the engine rejects, at add time, any request that could not fit the pool alone.

`policy="static"`: a batch of up to max_num_seqs is admitted only when no request is
running, and runs until every member finishes (the baseline continuous batching beats).

Invariants: a RUNNING request holds a block table with a slot for every computed token;
a WAITING one holds none; len(running) <= max_num_seqs except for n > 1 samples forked
after their prompt (they join the batch they were born in).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..paged.block_manager import BlockManager
from ..paged.block_pool import OutOfBlocksError
from .request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    start: int           # num_computed_tokens before this step: the first position computed
    num_new_tokens: int  # query_len: positions start .. start + num_new_tokens - 1

    @property
    def samples(self) -> bool:
        """True if this step computes the request's last token, so it samples the next."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then chunks
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, chunked_prefill: bool = True,
                 policy: str = "continuous"):
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunked_prefill, self.policy = chunked_prefill, policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: running[-1] is the newest
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        bm = self.block_manager
        if self.policy == "static" and not self.running:
            self._admit_static_batch()

        # 1. Decodes (one token left), oldest first. A decode whose next token needs a new
        #    block may preempt the newest running requests, itself last.
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.num_tokens - req.num_computed_tokens != 1:
                continue
            new_slots = req.num_computed_tokens + 1 - bm.get_num_tokens(req.seq_id)
            if new_slots > 0:
                while not bm.can_append(req.seq_id, new_slots):
                    victim = self.running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    break  # req was the newest; nothing after it is left
                out.copy_on_write += bm.append_slots(req.seq_id, req.all_token_ids, new_slots)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, 1))
            budget -= 1

        # 2. Unfinished prompts of running requests: their slots were reserved at admission.
        for req in self.running:
            if budget == 0:
                break
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining > 1 and (self.chunked_prefill or remaining <= budget):
                n = min(remaining, budget)
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                budget -= n

        # 3. Admit waiting requests, first come first served, while budget and blocks last.
        if self.policy == "continuous" and not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if not self.chunked_prefill and req.num_tokens > budget:
                    break  # whole prompt or nothing; the queue stays FIFO
                if not self._admit(req):
                    break
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                budget -= n
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens' K/V are written. Count them, and
        offer the full blocks among them to the prefix cache."""
        for s in out.seqs:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_blocks(req.seq_id, req.all_token_ids,
                                            req.num_computed_tokens)

    def fork(self, parent: Request, now: float) -> list[Request]:
        """Create the parent's pending samples 1..n-1, sharing its blocks (copy-on-write)."""
        children = []
        for index in range(1, parent.num_pending_forks + 1):
            child = parent.fork(index, now)
            child.metrics.arrival_time = parent.metrics.arrival_time
            self.block_manager.fork(parent.seq_id, child.seq_id)
            self.running.append(child)
            children.append(child)
        parent.num_pending_forks = 0
        return children

    def append_tokens(self, sampled: list[tuple[Request, int]], now: float) -> list[Request]:
        """Append each sampled token; finish (and free) the requests that are done."""
        finished = []
        for req, token in sampled:
            if req.append_token(token, now):
                self.finish(req, req.finish_reason, now)
                finished.append(req)
        return finished

    def finish(self, req: Request, reason: str, now: float) -> None:
        if req.status is RequestStatus.RUNNING:
            self.block_manager.free(req.seq_id)
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.metrics.finished_time = now

    # ---- helpers -----------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        """Allocate blocks for all of req's tokens and move it to running (False: no room)."""
        try:
            num_cached = self.block_manager.allocate(req.seq_id, req.all_token_ids)
        except OutOfBlocksError:
            return False
        self.waiting.popleft()
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.perf_counter()
        self.running.append(req)
        return True

    def _admit_static_batch(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.seq_id)
        req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
