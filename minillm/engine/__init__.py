"""The serving engine (Labs 04-05): continuous batching over a paged KV cache.

    request.py       SamplingParams, Request (num_computed_tokens), RequestOutput, metrics
    scheduler.py     who runs each step, under a token budget; chunked prefill; preemption
    model_runner.py  one flattened forward pass per step; sampling on the device
    cuda_graph.py    decode-only steps padded to batch buckets, one CUDA graph per bucket
    staging.py       a step's inputs to the device in one copy from pinned memory
    config.py        EngineConfig: every engine option, checked once
    step.py          run_step: one step of the loop (shared with Lab 05's simulator)
    overlap.py       async scheduling: launch step N+1 before reading step N's ids back
    llm_engine.py    LLMEngine: add_request / step / abort_request / generate / stats

The attention context the runner plugs into the model is `minillm.attention.paged`.
"""
from .config import EngineConfig
from .llm_engine import LLMEngine
from .request import RequestMetrics, RequestOutput, RequestStatus, SamplingParams
from .scheduler import Scheduler, SchedulerOutput

__all__ = ["EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "RequestMetrics",
           "RequestStatus", "Scheduler", "SchedulerOutput"]
