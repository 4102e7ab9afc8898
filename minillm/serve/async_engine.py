"""AsyncEngine: the one owner of an `LLMEngine` inside the server.

One background task runs the engine loop. Each turn it hands the worker thread (a single
thread, so the engine is never touched from two threads at once) the requests to add and
the ones to abort, and the worker applies them, runs one `engine.step()` and takes a stats
snapshot. Meanwhile the event loop keeps serving HTTP. The outputs come back to the event
loop, which turns them into text (`detok`) and puts them on each request's asyncio queue.

The HTTP layer only calls `submit` (returns a `RequestStream`), reads the stream, and calls
`abort`. It knows nothing of blocks: admission control reads the snapshot.

Admission (in `submit`, answered at once): while draining -> 503; a request that could not
fit the KV pool even alone -> 400; more than `max_queue_len` waiting -> 503; a prompt that
the free blocks (less those the waiting prompts will take) cannot hold -> 503.

Probes (Kubernetes): `liveness_problem()` is None while the engine loop task runs and no
step has run longer than `stall_timeout_s` (a stuck step means restart the process);
`readiness_problem()` is None once the warm-up generation (`warm_up`, started with the
server) has finished and while the server is live and not draining (only then should a load
balancer send it traffic). Each returns the reason as text otherwise.

Invariants: an aborted request is removed from the engine, its blocks freed, before the
next step runs; every stream ends with each sample finished ("stop"/"length"/"abort") or
with an error, so no reader waits forever.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..devices import make_current
from ..engine.request import SamplingParams
from .config import ServeConfig
from .detok import IncrementalDetokenizer, TokenTable
from .errors import APIError, internal_error, invalid, overloaded
from .metrics import ServerMetrics

log = logging.getLogger("minillm.serve")


@dataclass
class Delta:
    """What a request's queue carries: new text of sample `index`, and its end."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once this sample ended
    error: APIError | None = None     # the whole request failed (the stream ends)


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    num_tokens: int = 0               # generated tokens counted in usage
    last_token_time: float | None = None
    finish_reason: str | None = None


@dataclass
class RequestStream:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    count_metrics: bool
    samples: list[_Sample]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    async def deltas(self):
        """Yield Deltas until every sample finished (or an error, which is yielded last)."""
        open_samples = len(self.samples)
        while open_samples:
            delta = await self.queue.get()
            yield delta
            if delta.error is not None:
                return
            open_samples -= delta.finish_reason is not None


def is_device_error(exc: BaseException) -> bool:
    """Is ``exc`` a CUDA error (an illegal address, a device-side assert)? After one, the
    CUDA context is unusable: every later step raises too, so a server must stop reporting
    itself live and be restarted. A Python error in the engine is not sticky."""
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("CUDA error")


class AsyncEngine:
    def __init__(self, engine, tokenizer, config: ServeConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.tokens = TokenTable(tokenizer)
        self.block_size = engine.config.block_size
        self.streams: dict[str, RequestStream] = {}   # in flight (added or pending)
        self._pending_adds: list[RequestStream] = []
        self._adding: list[RequestStream] = []  # handed to the engine thread this turn
        self._pending_aborts: set[str] = set()
        # The engine thread makes the model's GPU its current device: a new thread starts at
        # cuda:0, where Triton would launch the kernels of a model on cuda:1.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minillm-engine",
                                            initializer=make_current,
                                            initargs=(engine.model.device,))
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.warmed = False                   # the warm-up generation has finished
        self.warmup_error: str | None = None
        self._step_since: float | None = None  # monotonic start of the step in flight
        self.device_error: str | None = None  # a CUDA error: every later step would fail too
        self.snapshot = self._snapshot()
        metrics.update_engine(self.snapshot, 0)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._wake = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self._task = self.loop.create_task(self._run(), name="engine-loop")

    def warm_up(self, prompt_ids: list[int], max_tokens: int = 2) -> None:
        """Run one short greedy generation in the background (the first step pays for kernel
        selection, allocations, caches); `warmed` turns True when it finishes."""
        stream = self.submit(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             count_metrics=False, shed=False)

        async def wait() -> None:
            async for delta in stream.deltas():
                if delta.error is not None:
                    self.warmup_error = delta.error.message
                    return
            self.warmed = True

        self.loop.create_task(wait(), name="warm-up")

    def liveness_problem(self) -> str | None:
        """None when the engine loop runs and its current step (if any) is not stalled."""
        if self._task is None or self._task.done():
            return "the engine loop is not running"
        if self.device_error is not None:
            return (f"the device failed ({self.device_error}); a CUDA error is sticky: "
                    "restart the process")
        since = self._step_since
        if since is not None and time.monotonic() - since > self.config.stall_timeout_s:
            return (f"the engine step in flight has run for {time.monotonic() - since:.1f} s, "
                    f"over stall_timeout_s={self.config.stall_timeout_s}")
        return None

    def readiness_problem(self) -> str | None:
        """None when a load balancer may send this server traffic."""
        if self.draining:
            return "draining: the server admits no new requests"
        problem = self.liveness_problem()
        if problem is not None:
            return problem
        if self.warmup_error is not None:
            return f"the warm-up generation failed: {self.warmup_error}"
        if not self.warmed:
            return "warming up: the first generation has not finished"
        return None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting; wait up to timeout_s for in-flight requests; abort the rest.
        Returns how many were aborted."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.streams)
        for rid in left:
            self.abort(rid)
        deadline = time.monotonic() + 5.0  # the aborts are applied at the next turn
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return len(left)

    # ---- the HTTP layer's calls --------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, stop=(), *,
               count_metrics: bool = True, shed: bool = True,
               arrival_time: float | None = None) -> RequestStream:
        cfg, snap = self.config, self.snapshot
        if self.draining:
            raise self._shed("the server is shutting down and admits no new requests; "
                             "retry against another replica", "draining")
        too_big = self.engine.config.pool_fit_error(len(prompt_ids), params.max_tokens)
        if too_big:
            raise invalid(too_big, "max_tokens", "context_length_exceeded")
        if shed:
            # the snapshot predates the adds in flight to the engine thread: count them too
            queued = self._pending_adds + self._adding
            num_waiting = snap["num_waiting"] + len(queued)
            if num_waiting >= cfg.max_queue_len:
                raise self._shed(f"the server is overloaded: {num_waiting} requests are "
                                 f"waiting (max_queue_len={cfg.max_queue_len}); retry later",
                                 "queue_full")
            need = -(-len(prompt_ids) // self.block_size)
            reserved = snap["waiting_prompt_blocks"] + sum(
                -(-len(s.prompt_ids) // self.block_size) for s in queued)
            if need > snap["num_free_blocks"] - reserved:
                raise self._shed(f"the KV cache is full: the prompt needs {need} blocks and "
                                 f"{max(snap['num_free_blocks'] - reserved, 0)} are free; "
                                 f"retry later", "kv_cache_full")
        rid = f"req-{next(self._ids)}"
        stream = RequestStream(rid, list(prompt_ids), params,
                               time.perf_counter() if arrival_time is None else arrival_time,
                               count_metrics,
                               [_Sample(self.tokens.detokenizer(stop)) for _ in range(params.n)])
        self.streams[rid] = stream
        self._pending_adds.append(stream)
        if count_metrics:
            self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone, drain). Safe to call twice or after it ended."""
        stream = self.streams.get(request_id)
        if stream is None:
            return
        if stream in self._pending_adds:  # never reached the engine
            self._pending_adds.remove(stream)
            self._finish_all(stream, "abort")
            return
        self._pending_aborts.add(request_id)
        self._wake.set()

    def num_in_flight(self) -> int:
        return len(self.streams)

    # ---- the loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._pending_adds or self._pending_aborts or self.snapshot["has_work"]):
                self._wake.clear()
                await self._wake.wait()
            adds, self._pending_adds = self._pending_adds, []
            self._adding = adds
            aborts, self._pending_aborts = self._pending_aborts, set()
            self._step_since = time.monotonic()
            try:
                outputs, rejected, self.snapshot = await loop.run_in_executor(
                    self._executor, self._work, adds, aborts)
            except Exception as exc:
                self._step_since = None
                self._adding = []  # an engine bug: fail every request, keep the server up
                log.exception("engine step failed; failing all in-flight requests")
                if is_device_error(exc):  # ... unless the GPU is gone: then stop being live
                    self.device_error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                for stream in list(self.streams.values()):
                    self._fail(stream, internal_error())
                    self._pending_aborts.add(stream.request_id)
                continue
            self._step_since = None
            self._adding = []
            for stream, error in rejected:
                self._fail(stream, error)
            now = time.perf_counter()
            for out in outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    self._dispatch(stream, out, now)
            self.metrics.update_engine(self.snapshot, len(self._pending_adds))

    def _work(self, adds: list[RequestStream], aborts: set[str]):
        """Runs in the engine thread: the only code that touches the engine."""
        engine, rejected = self.engine, []
        for rid in aborts:
            engine.abort_request(rid)
        for s in adds:
            try:
                engine.add_request(s.request_id, s.prompt_ids, s.params, s.arrival_time)
            except (ValueError, TypeError) as exc:
                rejected.append((s, invalid(str(exc), "prompt")))
        outputs = engine.step()  # also reports the aborts when nothing else runs
        return outputs, rejected, self._snapshot()

    def _snapshot(self) -> dict:
        stats = self.engine.stats()
        bs = self.block_size
        stats["waiting_prompt_blocks"] = sum(-(-r.num_tokens // bs)
                                             for r in self.engine.scheduler.waiting)
        stats["has_work"] = self.engine.has_unfinished_requests()
        return stats

    def _dispatch(self, stream: RequestStream, out, now: float) -> None:
        sample = stream.samples[out.index]
        if sample.finish_reason is not None:
            return  # ended by a stop string; the engine is still catching up
        m = self.metrics if stream.count_metrics else None
        for _ in out.new_token_ids:
            if m is not None:
                m.generation_tokens.inc()
                if sample.last_token_time is None:
                    m.ttft.observe(now - stream.arrival_time)
                else:
                    m.itl.observe(now - sample.last_token_time)
            sample.last_token_time = now
            sample.num_tokens += 1
        text = sample.detok.push(out.new_token_ids)
        reason = "stop" if sample.detok.stopped else out.finish_reason if out.finished else None
        if reason is not None and not sample.detok.stopped:
            text += sample.detok.flush()
            reason = "stop" if sample.detok.stopped else reason
        self._put(stream, Delta(out.index, text, list(out.new_token_ids), reason), now)

    def _put(self, stream: RequestStream, delta: Delta, now: float | None = None) -> None:
        stream.queue.put_nowait(delta)
        reason = delta.finish_reason
        if reason is not None:
            stream.samples[delta.index].finish_reason = reason
            if stream.count_metrics:
                if reason in ("stop", "length"):
                    self.metrics.success.labels(finished_reason=reason).inc()
                    self.metrics.e2e.observe((now or time.perf_counter()) - stream.arrival_time)
                else:
                    self.metrics.aborted.inc()
        if stream.finished:
            self.streams.pop(stream.request_id, None)
            if reason != "abort":
                # a stop string ended it early: free its blocks now, not at max_tokens
                self._pending_aborts.add(stream.request_id)

    def _finish_all(self, stream: RequestStream, reason: str) -> None:
        for i, s in enumerate(stream.samples):
            if s.finish_reason is None:
                self._put(stream, Delta(i, "", [], reason))

    def _fail(self, stream: RequestStream, error: APIError) -> None:
        self.streams.pop(stream.request_id, None)
        for s in stream.samples:
            s.finish_reason = s.finish_reason or "error"
        stream.queue.put_nowait(Delta(0, "", [], None, error))

    def _shed(self, message: str, reason: str) -> APIError:
        self.metrics.shed.labels(reason=reason).inc()
        return overloaded(message, reason, self.config.retry_after_s)
