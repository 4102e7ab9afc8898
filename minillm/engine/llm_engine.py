"""LLMEngine: continuous batching over a paged KV cache, one `step()` at a time.

    engine = LLMEngine(model, config=EngineConfig(max_num_seqs=32))   # or LLMEngine(model,
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32))  #   max_num_seqs=32)
    while engine.has_unfinished_requests():
        for out in engine.step(): ...        # RequestOutput: new tokens, finished, reason

A step (`minillm.engine.step.run_step`) is: `Scheduler.schedule` (who runs, how many
tokens, blocks, prefix cache) -> `ModelRunner.execute` (one forward pass, logits of the
sampling rows) -> `Scheduler.advance` (num_computed_tokens) -> fork n > 1 samples ->
`sample_tokens` -> `Scheduler.append_tokens` (stop checks, free finished blocks).

Every option lives in one `EngineConfig` (`minillm.engine.config`); `engine.config` is the
resolved one in use (max_model_len, num_blocks, decode_path, enforce_eager,
piecewise_graphs and async_scheduling filled in).
`_resolve` is the one place that decides them; the runner only reads them.

Sizing. `num_blocks=None` sizes the pool from a byte budget: `kv_cache_memory_bytes`, or by
default half the free GPU memory on CUDA, and on CPU a quarter of the available RAM capped
at 2 GiB (this course's machines have a few GB to share). The pool is never made larger
than max_num_seqs full-length sequences would need.

`max_num_batched_tokens=None` (the default) resolves by device. 512 on a CPU: a 512-token
step is already compute-bound there (the weights are read once for 512 tokens, not once per
token), and a long prompt then delays the running decodes by at most one such step (~0.5-1
s) instead of its whole prefill; it is the chunk size the syllabus and vLLM's early
chunked-prefill default use. 8192 on CUDA (vLLM's serving default on large GPUs): a prefill
or mixed step runs eagerly, and for a small model it is host-bound there, not compute-bound
(SmolLM2 on an H100, 2026-11-27: an eager step took 24-36 ms whatever its batch, while
8192 tokens are ~2 TFLOP, a few ms of the GPU's work), so fewer, larger chunks cost fewer
such steps. The serving workload's 8,700 prompt tokens take 2 eager steps instead of 5
(`widgets.batching_sim.simulate` replays the scheduler); the running decodes wait for one
step either way. `benchmarks/gpu_check.py` measures the old 2048 beside it.

`decode_path` picks how decode rows attend (see `minillm.attention.paged`): None chooses
"kernel" (the C++ paged-decode kernel, K/V read in place) on a CPU where it builds, else
"gather" (PyTorch: gather K/V, then SDPA) with the torch backend, and "backend" (the
backend's own paged kernel, e.g. Triton) otherwise. The benchmark passes it explicitly, or
switches it between steps with `set_decode_path` (which keeps `engine.config` current).

CUDA graphs: with `enforce_eager=False` (the default on CUDA with the Triton backend)
decode-only steps replay a captured graph per batch bucket (`minillm.engine.cuda_graph`),
and with `piecewise_graphs` (on by default with them) prefill and mixed steps replay every
op but attention from graphs per token bucket (`minillm.engine.piecewise`); see
`EngineConfig` for how the defaults resolve and what a CPU does.

Async scheduling (`async_scheduling`, `minillm.engine.overlap`; on by default on CUDA, off
on a CPU): `step()` launches the next step, then reads back the step before it (the GPU is
busy with the new one meanwhile) and returns that step's outputs. So a step's outputs come
one `step()` later, `has_unfinished_requests()` stays True while a step is in flight, and a
step with nothing to schedule only resolves. A token's time in the metrics is when the host
learned it. `abort_request` drops the result of a step in flight for that request.

Admission errors are raised by `add_request`, never later: a duplicate id, a prompt plus
max_tokens beyond the model's context, a request that could not fit the pool even alone
(it would wait forever), or, without chunked prefill, a request longer than the budget.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..attention.backends import get_backend
from ..attention.paged import choose_decode_path, static_decode_problem
from ..devices import make_current
from ..paged.block_manager import BlockManager
from ..paged.kv_cache import PagedKVCache
from ..prompts import check_context_length, check_prompt
from .config import EngineConfig
from .model_runner import ModelRunner, sample_on_device, sample_tokens
from .overlap import InFlight, launch_step, resolve_step
from .request import Request, RequestMetrics, RequestOutput, SamplingParams
from .scheduler import Scheduler
from .step import StepResult, run_step

DEFAULT_CPU_KV_BYTES = 2 << 30
CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS = 512, 8192  # max_num_batched_tokens=None (above)


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


def engine_attn_backend(requested: str | None, model):
    """The backend an engine's paged attention runs on (`EngineConfig.attn_backend`): the
    one requested; else Triton on CUDA (its decode steps can be captured in CUDA graphs);
    else the model's own."""
    if requested is not None:
        return get_backend(requested)
    if model.device.type == "cuda" and model.attn_backend.name != "triton":
        return get_backend("triton")
    return model.attn_backend


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, **options):
        if config is not None and options:
            raise TypeError(f"pass either config=EngineConfig(...) or keyword options, not "
                            f"both (got {sorted(options)})")
        unknown = sorted(set(options) - set(EngineConfig.option_names()))
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; the options are "
                            f"{list(EngineConfig.option_names())}")
        self.model, self.tokenizer = model, tokenizer
        make_current(model.device)  # the graphs, streams and Triton launches go to its GPU
        self._requested = config or EngineConfig(**options)
        config = self._resolve_sizes(self._requested, model)
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        cfg = model.config
        self.kv_cache = PagedKVCache(cfg.num_layers, config.num_blocks, config.block_size,
                                     cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)
        self.scheduler = Scheduler(self.block_manager, config=config)
        self.attn_backend = engine_attn_backend(config.attn_backend, model)
        self.config = self._resolve(replace(config, attn_backend=self.attn_backend.name))
        self.runner = ModelRunner(model, self.kv_cache, self.block_manager, self.config,
                                  self.attn_backend)
        self.requests: dict[str, list[Request]] = {}  # unfinished, by request_id
        # Metrics of the most recent finished sequences, oldest first, keyed (request_id,
        # index). Bounded (config.max_finished_metrics), so a long-running server does not
        # grow without limit; every finished RequestOutput also carries its own metrics.
        self.finished_metrics: dict[tuple[str, int], RequestMetrics] = {}
        self._pending_outputs: list[RequestOutput] = []  # aborts, reported by the next step
        self._in_flight: InFlight | None = None  # async scheduling: the step not read back
        self.num_steps = self.num_batched_tokens = self.num_generated_tokens = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model
        self.num_cow_copies = self._num_generate_calls = 0

    @staticmethod
    def _resolve_sizes(config: EngineConfig, model) -> EngineConfig:
        """Fill in what depends on the model: max_model_len and num_blocks."""
        cfg = model.config
        max_model_len = config.max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [1, {cfg.max_position_embeddings}] "
                             f"(the model's context), got {max_model_len}")
        num_blocks = config.num_blocks
        if num_blocks is None:
            budget = config.kv_cache_memory_bytes or default_kv_budget_bytes(model.device)
            num_blocks = min(
                PagedKVCache.num_blocks_for_budget(budget, cfg.num_layers, config.block_size,
                                                   cfg.num_kv_heads, cfg.head_dim, model.dtype),
                config.max_num_seqs * -(-max_model_len // config.block_size))
        tokens = config.max_num_batched_tokens or (
            GPU_BATCHED_TOKENS if model.device.type == "cuda" else CPU_BATCHED_TOKENS)
        return replace(config, max_model_len=max_model_len, num_blocks=num_blocks,
                       max_num_batched_tokens=tokens)

    def _resolve(self, config: EngineConfig) -> EngineConfig:
        """Decide how steps run, once: the decode path and whether decode steps use CUDA
        graphs (the rules are in `EngineConfig`'s and `minillm.attention.paged`'s docs)."""
        backend, device = self.attn_backend, self.model.device
        path = choose_decode_path(backend, self.kv_cache, config.decode_path)
        problem = static_decode_problem(path, backend, device)
        eager = config.enforce_eager
        if eager is None:
            eager = device.type != "cuda" or problem is not None
        elif not eager and problem:
            raise ValueError(f"enforce_eager=False (CUDA graphs) cannot serve decode_path="
                             f"{path!r}: {problem}; use the Triton backend "
                             f"(attn_backend='triton') or enforce_eager=True")
        top = config.max_cudagraph_capture_size
        if not eager and config.max_num_seqs > top:
            warnings.warn(f"max_num_seqs={config.max_num_seqs} is above the largest CUDA-graph "
                          f"batch (max_cudagraph_capture_size={top}): decode steps of more "
                          f"than {top} sequences run eagerly", stacklevel=3)
        pieces = config.piecewise_graphs
        if pieces is None:
            pieces = device.type == "cuda" and not eager
        return self._resolve_scheduling(replace(config, decode_path=path, enforce_eager=eager,
                                                piecewise_graphs=pieces), device)

    @staticmethod
    def _resolve_scheduling(config: EngineConfig, device: torch.device) -> EngineConfig:
        """async_scheduling=None: on only where a GPU can run a step while the host
        prepares the next (CUDA); a CPU does both itself."""
        if config.async_scheduling is not None:
            return config
        return replace(config, async_scheduling=device.type == "cuda")

    def set_decode_path(self, path: str | None) -> None:
        """Switch how decode rows attend, between steps (the serving benchmark alternates
        paths within one run). Decided like at start, and `engine.config` follows; the
        runner is rebuilt (with CUDA graphs on, that re-captures the decode graphs; the
        piecewise graphs, which leave attention out, are kept)."""
        self._requested = replace(self._requested, decode_path=path)
        config = self._resolve(replace(self.config, decode_path=path,
                                       enforce_eager=self._requested.enforce_eager,
                                       piecewise_graphs=self._requested.piecewise_graphs))
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, config,
                                  self.attn_backend,
                                  pieces=self.runner.pieces)  # attention is not in them
        self.config = config

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def max_finished_metrics(self) -> int:
        return self.config.max_finished_metrics

    @max_finished_metrics.setter
    def max_finished_metrics(self, value: int) -> None:  # checked by EngineConfig
        self.config = replace(self.config, max_finished_metrics=value)

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
        check_context_length(len(prompt), params.max_tokens, self.max_model_len, "max_tokens")
        too_big = self.config.pool_fit_error(len(prompt), params.max_tokens)
        if too_big:
            raise ValueError(f"request {request_id!r}: {too_big}")
        need = len(prompt) + params.max_tokens - 1  # tokens whose K/V may be computed
        if not self.config.chunked_prefill and need > self.config.max_num_batched_tokens:
            raise ValueError(f"without chunked prefill a request is computed in one step, and "
                             f"this one may need {need} tokens > max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}; enable chunked_prefill "
                             f"or raise the budget")
        req = Request(request_id, prompt, params, self.model.config.eos_token_id, 0,
                      arrival_time, self.model.device)
        self.requests[request_id] = [req]
        self.scheduler.add(req)

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, str):
            if self.tokenizer is None:
                raise TypeError("got a text prompt but the engine has no tokenizer; pass "
                                "token ids or LLMEngine(model, tokenizer)")
            prompt_ids = self.tokenizer.encode(prompt_ids)
        return check_prompt(prompt_ids, self.model.config.vocab_size)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; the next step() reports it ("abort")."""
        now = time.perf_counter()
        for req in self.requests.pop(request_id, []):
            if not req.is_finished or req.num_pending_tokens:  # (a token in flight: dropped)
                self.scheduler.finish(req, "abort", now)
                self._record_finished(req)
                self._pending_outputs.append(self._output(req, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of the step whose tokens the host now knows:
        this one, or with async scheduling the one launched by the previous call."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.config.async_scheduling:
            launched, resolved = self._launch_and_resolve()
        else:
            launched = resolved = run_step(self.scheduler, self.runner.execute,
                                           sample_tokens, time.perf_counter)
        if launched is None and resolved is None and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler found nothing to run while requests wait: "
                               "a bug (add_request should have rejected them)")
        if launched is not None:
            self._count_launched(launched)
        if resolved is not None:
            outputs += self._resolved_outputs(resolved)
        return outputs

    def _launch_and_resolve(self) -> tuple[StepResult | None, StepResult | None]:
        """Async scheduling: launch a step, then resolve the one in flight before it."""
        prev, self._in_flight = self._in_flight, None
        try:
            self._in_flight = launch_step(self.scheduler, self.runner.execute,
                                          sample_on_device, time.perf_counter, prev)
        except BaseException:
            # The new step was undone; prev ran: keep its tokens (the next step() reports
            # them), so that no placeholder outlives the error and nothing is lost.
            if prev is not None:
                self._pending_outputs += self._resolved_outputs(
                    resolve_step(self.scheduler, prev, time.perf_counter))
            raise
        resolved = None if prev is None else resolve_step(self.scheduler, prev,
                                                           time.perf_counter)
        return None if self._in_flight is None else self._in_flight.step, resolved

    def _count_launched(self, step: StepResult) -> None:
        for child in step.forked:
            self.requests[child.request_id].append(child)
        sched = step.scheduled
        self.num_steps += 1
        self.num_batched_tokens += sched.num_batched_tokens
        self.num_computed_prompt_tokens += sum(
            max(0, min(s.start + s.num_new_tokens, s.request.num_prompt_tokens) - s.start)
            for s in sched.seqs)
        self.num_cow_copies += len(sched.copy_on_write)

    def _resolved_outputs(self, step: StepResult) -> list[RequestOutput]:
        outputs = []
        for req, t in step.sampled:
            outputs.append(self._output(req, [t]))
            if outputs[-1].finished:
                self._record_finished(req)
        self.num_generated_tokens += len(step.sampled)
        return outputs

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        # Done once finished with no token in flight (async scheduling retires a request at
        # max_tokens when its last token is launched, and reports it when that resolves).
        done = req.is_finished and not req.num_pending_tokens
        return RequestOutput(req.request_id, new, done, req.finish_reason if done else None,
                             req.index, req.output_token_ids, req.num_resolved_tokens,
                             req.metrics if done else None)

    def _record_finished(self, req: Request) -> None:
        self.finished_metrics[req.seq_id] = req.metrics
        while len(self.finished_metrics) > self.config.max_finished_metrics:
            del self.finished_metrics[next(iter(self.finished_metrics))]
        group = self.requests.get(req.request_id, [])
        if all(r.is_finished and not r.num_pending_tokens for r in group) \
                and not any(r.num_pending_forks for r in group):
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
            # prompt tokens computed (a prefix-cache hit skips them; a preemption redoes them)
            "num_computed_prompt_tokens": self.num_computed_prompt_tokens,
            "mean_tokens_per_step": self.num_batched_tokens / max(self.num_steps, 1),
            "num_generated_tokens": self.num_generated_tokens,
            "num_cow_copies": self.num_cow_copies,
        }
