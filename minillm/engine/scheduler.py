"""The scheduler: which requests run this step, and how many tokens each (vLLM v1 style).

Every request has one counter, `num_computed_tokens`, and wants it to reach `num_tokens`
(prompt + generated so far). A step has a budget of `max_num_batched_tokens` tokens and
`max_num_seqs` sequences. `schedule()` spends it in this order:

  1. running requests with one token left (decodes), oldest first: 1 token each;
  2. running requests with an unfinished prompt (chunked prefill): the next chunk;
  3. waiting requests, first come first served (continuous mode): a prefix-cache hit
     advances num_computed_tokens for free, then a first chunk.

Blocks are reserved per step, for the tokens that step computes (slots up to
num_computed_tokens + num_new_tokens), not for a whole prompt at admission. Admission keeps
`watermark_blocks` free (unless nothing is running), so a new prompt does not take the
blocks the running requests need next. Without `chunked_prefill` a prompt is scheduled
whole or waits. One step may mix decodes and prefill chunks: the model runner flattens them
all into one forward pass.

Prefix caching within a step: the full blocks a step will compute are offered to the
prefix cache when they are scheduled, not after the step ran. The forward pass writes
every layer's K/V for all the step's tokens before that layer attends, so a request
admitted later in the same step (one system prompt, many questions, submitted together)
hits the blocks its neighbour is computing now. Only admission (3) looks the cache up, and
nothing is preempted after it in a step, so no block is freed between being offered and
being written. If the forward pass fails, `undo` puts the step's requests back and takes
those offers back.

Preemption by recompute: when a running request needs a block and the pool is empty, the
NEWEST running request not yet scheduled this step is freed and put back at the FRONT of
the waiting queue with num_computed_tokens = 0 (its generated tokens are kept and
recomputed with the prompt). A decode may preempt itself when it is the newest; a prefill
chunk with nobody left to preempt waits for the next step. No request is admitted in a
step that preempted or left a chunk waiting. The oldest request can always progress,
because the engine rejects, at add time, any request that could not fit the pool alone.

`policy="static"`: a batch of up to max_num_seqs is admitted only when no request is
running (its prompts reserved whole), and runs until every member finishes (the baseline
continuous batching beats).

Async scheduling (`minillm.engine.overlap`): step N+1 is scheduled while step N's sampled
ids are still on the device, as placeholders (`Request.num_pending_tokens`, at most one
step's worth when schedule() runs: the steps before N are resolved). A placeholder is
only ever the input token of a decode, which the runner takes from step N's ids on the
device. What reads token values never sees one: a block completed by a placeholder is not
offered at schedule time but by the request's next `append_slots` (its value is known
then); admission (`allocate` hashes the whole prompt) takes only requests without one,
which holds because a request preempted with a pending token waits at least until the
next schedule(), by which time step N is resolved (no admission follows a preemption in
the same step). `append_placeholders` retires a request that reached max_tokens at once
(blocks freed, never scheduled again); `resolve_tokens` writes the values in, runs the
stop checks and drops the rows of requests that ended meanwhile (a stop found by step N
ends a request that step N+1 already computed: that row's token is discarded).

Invariants: between steps a RUNNING request holds a block table with a slot for every
computed token; a WAITING one holds none; len(running) <= max_num_seqs except for n > 1
samples forked after their prompt (they join the batch they were born in).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..paged.block_manager import BlockManager
from ..paged.block_pool import OutOfBlocksError
from .config import EngineConfig
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
    """`config` (an EngineConfig) or the keyword options; the EngineConfig checks them."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, chunked_prefill: bool = True,
                 policy: str = "continuous", *, config: EngineConfig | None = None):
        if config is None:
            config = EngineConfig(max_num_seqs=max_num_seqs, chunked_prefill=chunked_prefill,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  scheduling=policy, block_size=block_manager.block_size,
                                  num_blocks=block_manager.num_blocks)
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = (config.max_num_seqs,
                                                          config.max_num_batched_tokens)
        self.chunked_prefill, self.policy = config.chunked_prefill, config.scheduling
        self.watermark_blocks = config.watermark_blocks()
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
        if self.policy == "static" and not self.running:
            self._admit_static_batch()
        scheduled: set[int] = set()  # ids of the requests scheduled so far this step
        blocked = False              # a prefill chunk found no blocks: admit nobody

        # 1. Decodes (one token left), oldest first; 2. then prefill chunks. A request
        # preempted on the way (status WAITING now) is skipped; a running one's token counts
        # do not change within schedule(), so each is classified once.
        decode_reqs, chunk_reqs = [], []
        for req in self.running:
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1:
                decode_reqs.append(req)
            elif remaining > 1:
                chunk_reqs.append(req)
        for decodes, reqs in ((True, decode_reqs), (False, chunk_reqs)):
            for req in reqs:
                if budget == 0 or req.status is not RequestStatus.RUNNING:
                    continue
                remaining = req.num_tokens - req.num_computed_tokens
                if not decodes and not self.chunked_prefill and remaining > budget:
                    continue
                n = min(remaining, budget)
                if not self._reserve(req, n, out, scheduled):
                    if req.status is RequestStatus.RUNNING:
                        blocked = True  # a chunk that must wait: nobody was left to preempt
                        continue
                    if decodes:
                        break  # req preempted itself as the newest: nothing after it is left
                    continue
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                scheduled.add(id(req))
                budget -= n
                self._offer_blocks(req, n)

        # 3. Admit waiting requests, first come first served, while budget and blocks last.
        if self.policy == "continuous" and not out.preempted and not blocked:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if not self.chunked_prefill and req.num_tokens > budget:
                    break  # whole prompt or nothing; the queue stays FIFO
                if not self._admit(req, budget, self.watermark_blocks if self.running else 0):
                    break
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                budget -= n
                self._offer_blocks(req, n)
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens' K/V are written. Count them."""
        for s in out.seqs:
            s.request.num_computed_tokens += s.num_new_tokens

    def undo(self, out: SchedulerOutput) -> None:
        """The step's forward pass failed: put its requests back at the front of the queue,
        as if preempted, and take back the blocks offered to the prefix cache for it (their
        KV was never written). The engine is then as consistent as before the step. (With
        async scheduling a request put back may still hold the placeholder of the step in
        flight; the engine resolves that step before the error propagates, so it has none
        by the next schedule(), as `_admit` requires.)"""
        for s in reversed(out.seqs):
            req = s.request
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
                self.block_manager.free(req.seq_id, num_computed_tokens=s.start)
                req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
                self.waiting.appendleft(req)

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

    def append_placeholders(self, reqs: list[Request]) -> list[int]:
        """Async scheduling: the step just launched sampled a token for each of `reqs`, on
        the device. Append a placeholder each and return their positions in the outputs.
        A request that reaches max_tokens is done whatever the value: it is retired now
        (FINISHED, blocks freed, never scheduled again), its output waits for the value."""
        positions = []
        for req in reqs:
            positions.append(len(req.output_token_ids))
            if req.append_pending():
                self._release(req)
                req.status, req.finish_reason = RequestStatus.FINISHED, "length"
        return positions

    def resolve_tokens(self, rows: list[tuple[Request, int, int]],
                       now: float) -> list[tuple[Request, int]]:
        """Async scheduling: a step's ids are read back. Write each (request, position,
        token) over its placeholder and finish the requests that are done; return the
        (request, token) kept. The rows of requests that ended after the step was launched
        (a stop found by the step before, an abort) have no placeholder left: dropped."""
        kept = []
        for req, pos, token in rows:
            if not req.is_pending(pos):
                continue
            kept.append((req, token))
            if req.resolve_token(pos, token, now):
                self.finish(req, req.finish_reason, now)
        return kept

    def finish(self, req: Request, reason: str, now: float) -> None:
        """End req now and free its blocks. Placeholders it still holds are dropped (their
        steps' results are discarded). With a step in flight that computes req, freeing is
        safe: any later write into those blocks comes from a later step, queued after it
        on the same stream."""
        self._release(req)
        req.drop_pending()
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.metrics.finished_time = now

    def _release(self, req: Request) -> None:
        """Take req out of running (freeing its blocks) or waiting."""
        if req.status is RequestStatus.RUNNING:
            self.block_manager.free(req.seq_id)
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)

    # ---- helpers -----------------------------------------------------------------------
    def _reserve(self, req: Request, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Give the running req slots for its next n tokens, preempting the newest running
        requests not scheduled this step while the pool is short. False if it got none:
        it was the newest itself (a decode then preempts itself, a chunk waits)."""
        bm, end = self.block_manager, req.num_computed_tokens + n
        new_slots = end - bm.get_num_tokens(req.seq_id)
        if new_slots <= 0:
            return True  # reserved already (static mode reserves whole prompts)
        tokens = req.token_prefix(end)
        while True:
            try:  # short of blocks, append_slots raises and changes nothing
                out.copy_on_write += bm.append_slots(req.seq_id, tokens, new_slots)
                return True
            except OutOfBlocksError:
                victim = next(r for r in reversed(self.running) if id(r) not in scheduled)
                if victim is req and n > 1:
                    return False
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return False

    def _offer_blocks(self, req: Request, n: int) -> None:
        """Offer the full blocks this step completes to the prefix cache (see module doc).
        The full blocks before them were offered by the steps (or the admission) that
        scheduled their tokens, so a step that completes no block has nothing to offer:
        15 decode steps in 16, at block_size 16. A block whose last token is a placeholder
        (async scheduling) is not offered: the request's next `append_slots` caches it."""
        c, bs = req.num_computed_tokens, self.block_manager.block_size
        if (c + n) // bs == c // bs:
            return
        end = min(c + n, req.num_tokens - req.num_pending_tokens)
        if end // bs > c // bs:
            self.block_manager.cache_blocks(req.seq_id, req.token_prefix(req.num_tokens), end)

    def _admit(self, req: Request, token_budget: int | None = None, watermark: int = 0) -> bool:
        """Allocate blocks for req's cached prefix and its first `token_budget` tokens
        (None: all of them), leaving `watermark` blocks free, and move it to running
        (False: no room)."""
        assert not req.num_pending_tokens, \
            f"{req!r} was admitted with a placeholder token: its step is not resolved"
        try:
            num_cached = self.block_manager.allocate(req.seq_id, req.all_token_ids,
                                                     token_budget, watermark)
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
