"""LLMEngine: continuous batching over a paged KV cache, one `step()` at a time.

    engine = LLMEngine(model)
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...        # RequestOutput: new tokens, finished, reason

A step is: `Scheduler.schedule` (who runs, how many tokens) -> `ModelRunner.execute` (one
forward pass, logits of the sampling rows) -> `Scheduler.advance` (num_computed_tokens,
prefix cache) -> fork n > 1 samples -> `sample_tokens` -> `Scheduler.append_tokens`
(stop checks, free finished blocks).

Sizing. `num_blocks=None` sizes the pool from a byte budget: `kv_cache_memory_bytes`, or by
default half the free GPU memory on CUDA, and on CPU a quarter of the available RAM capped
at 2 GiB (this course's machines have a few GB to share). The pool is never made larger
than max_num_seqs full-length sequences would need.

`max_num_batched_tokens=512` (the default): on this CPU a 512-token step is already
compute-bound (the weights are read once for 512 tokens, not once per token), and a long
prompt then delays the running decodes by at most one such step (~0.5-1 s here) instead of
its whole prefill. It is the chunk size the syllabus and vLLM's early chunked-prefill default
use; on a GPU, 2048-8192 fits the faster matmuls better.

`decode_path` picks how decode rows attend (see `minillm.paged.context`): None chooses
"kernel" (the C++ paged-decode kernel, K/V read in place) on a CPU where it builds, else
"gather" (PyTorch: gather K/V, then SDPA) with the torch backend, and "backend" (the
backend's own paged kernel, e.g. Triton) otherwise. The benchmark passes it explicitly.

Admission errors are raised by `add_request`, never later: a duplicate id, a prompt plus
max_tokens beyond the model's context, a request that could not fit the pool even alone
(it would wait forever), or, without chunked prefill, a request longer than the budget.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..paged.block_manager import BlockManager
from ..paged.kv_cache import PagedKVCache
from .model_runner import ModelRunner, sample_tokens
from .request import Request, RequestMetrics, RequestOutput, RequestStatus, SamplingParams
from .scheduler import Scheduler

DEFAULT_CPU_KV_BYTES = 2 << 30


def default_kv_budget_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:  # MemAvailable: what Linux could hand out without swapping
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        avail = 8 << 30
    return min(avail // 4, DEFAULT_CPU_KV_BYTES)


class LLMEngine:
    def __init__(self, model, tokenizer=None, num_blocks: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 chunked_prefill: bool = True, kv_cache_memory_bytes: int | None = None,
                 scheduling: str = "continuous", max_model_len: int | None = None,
                 decode_path: str | None = None):
        cfg = model.config
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if not 1 <= self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [1, {cfg.max_position_embeddings}] "
                             f"(the model's context), got {max_model_len}")
        if num_blocks is None:
            budget = kv_cache_memory_bytes or default_kv_budget_bytes(model.device)
            num_blocks = min(
                PagedKVCache.num_blocks_for_budget(budget, cfg.num_layers, block_size,
                                                   cfg.num_kv_heads, cfg.head_dim, model.dtype),
                max_num_seqs * -(-self.max_model_len // block_size))
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.kv_cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                     cfg.head_dim, model.dtype, model.device)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                   chunked_prefill, scheduling)
        self.runner = ModelRunner(model, self.kv_cache, self.block_manager, decode_path)
        self.requests: dict[str, list[Request]] = {}  # unfinished, by request_id
        # Metrics of the most recent finished sequences, oldest first, keyed (request_id,
        # index). Bounded, so a long-running server does not grow without limit; every
        # finished RequestOutput also carries its own metrics.
        self.finished_metrics: dict[tuple[str, int], RequestMetrics] = {}
        self.max_finished_metrics = 10_000
        self._pending_outputs: list[RequestOutput] = []  # aborts, reported by the next step
        self.num_steps = self.num_batched_tokens = self.num_generated_tokens = 0
        self.num_cow_copies = self._num_generate_calls = 0

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids, sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine; "
                             f"use a unique id per request")
        prompt = self._check_prompt(prompt_ids)
        need = len(prompt) + params.max_tokens - 1  # tokens whose K/V may be computed
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} "
                             f"exceeds the context length of {self.max_model_len} tokens; "
                             f"shorten the prompt or ask for at most "
                             f"{max(self.max_model_len - len(prompt), 0)} tokens")
        bs, nb = self.block_manager.block_size, self.block_manager.num_blocks
        if -(-need // bs) > nb:
            raise ValueError(f"request {request_id!r} needs {-(-need // bs)} KV blocks of {bs} "
                             f"tokens but the whole pool has {nb}: it could never run. Give "
                             f"the engine more blocks (num_blocks / kv_cache_memory_bytes) or "
                             f"lower max_tokens")
        if not self.scheduler.chunked_prefill and need > self.scheduler.max_num_batched_tokens:
            raise ValueError(f"without chunked prefill a request is computed in one step, and "
                             f"this one may need {need} tokens > max_num_batched_tokens="
                             f"{self.scheduler.max_num_batched_tokens}; enable chunked_prefill "
                             f"or raise the budget")
        req = Request(request_id, prompt, params, self.model.config.eos_token_id, 0,
                      arrival_time)
        self.requests[request_id] = [req]
        self.scheduler.add(req)

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, str):
            if self.tokenizer is None:
                raise TypeError("got a text prompt but the engine has no tokenizer; pass "
                                "token ids or LLMEngine(model, tokenizer)")
            prompt_ids = self.tokenizer.encode(prompt_ids)
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.flatten().tolist()
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        return prompt

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; the next step() reports it ("abort")."""
        now = time.perf_counter()
        for req in self.requests.pop(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, "abort", now)
                self._record_finished(req)
                self._pending_outputs.append(self._output(req, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        if not sched.seqs:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler found nothing to run while requests wait: "
                                   "a bug (add_request should have rejected them)")
            return outputs
        logits = self.runner.execute(sched)
        now = time.perf_counter()
        self.scheduler.advance(sched)
        to_sample = []
        for row, s in enumerate([s for s in sched.seqs if s.samples]):
            group = [s.request]
            if s.request.num_pending_forks:
                group += self.scheduler.fork(s.request, now)
                self.requests[s.request.request_id] += group[1:]
            to_sample += [(req, row) for req in group]
        tokens = sample_tokens(logits, to_sample)
        self.scheduler.append_tokens([(req, t) for (req, _), t in zip(to_sample, tokens)], now)
        for (req, _), t in zip(to_sample, tokens):
            outputs.append(self._output(req, [t]))
            if req.is_finished:
                self._record_finished(req)
        self.num_steps += 1
        self.num_batched_tokens += sched.num_batched_tokens
        self.num_generated_tokens += len(tokens)
        self.num_cow_copies += len(sched.copy_on_write)
        return outputs

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(req.request_id, new, req.is_finished, req.finish_reason,
                             req.index, list(req.output_token_ids),
                             req.metrics if req.is_finished else None)

    def _record_finished(self, req: Request) -> None:
        self.finished_metrics[req.seq_id] = req.metrics
        while len(self.finished_metrics) > self.max_finished_metrics:
            del self.finished_metrics[next(iter(self.finished_metrics))]
        group = self.requests.get(req.request_id, [])
        if all(r.is_finished for r in group) and not any(r.num_pending_forks for r in group):
            self.requests.pop(req.request_id, None)

    # ---- convenience -------------------------------------------------------------------
    def generate(self, prompts: Sequence, sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None) -> list[list[int]]:
        """Run the prompts to completion; return generated token ids, one list per sample,
        prompt by prompt (with n > 1, prompt i contributes n consecutive lists)."""
        if self.has_unfinished_requests():
            raise RuntimeError("generate() runs the engine until it is empty; other requests "
                               "are in flight: drive them with step() instead")
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        self._num_generate_calls += 1
        ids = [f"generate-{self._num_generate_calls}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        results: dict[tuple[str, int], list[int]] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    results[(out.request_id, out.index)] = out.token_ids
        return [results[(rid, i)] for rid, p in zip(ids, params) for i in range(p.n)]

    # ---- metrics -----------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    def prefix_cache_hit_rate(self) -> float:
        return self.block_manager.prefix_cache_hit_rate()

    def stats(self) -> dict:
        bm, sch = self.block_manager, self.scheduler
        used = bm.num_blocks - bm.num_free_blocks()
        return {
            "num_running": len(sch.running), "num_waiting": len(sch.waiting),
            "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks(),
            "num_used_blocks": used, "kv_cache_usage": used / bm.num_blocks,
            # token slots reserved by running requests (paged waste = used*bs - this)
            "num_kv_tokens": sum(bm.get_num_tokens(r.seq_id) for r in sch.running),
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate(),
            "num_preemptions": sch.num_preemptions, "num_steps": self.num_steps,
            "num_batched_tokens": self.num_batched_tokens,
            "mean_tokens_per_step": self.num_batched_tokens / max(self.num_steps, 1),
            "num_generated_tokens": self.num_generated_tokens,
            "num_cow_copies": self.num_cow_copies,
        }
