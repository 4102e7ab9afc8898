"""Capacity: the memory budget of one replica (weights, activations, KV), how many requests
fit, the step-time model, and the design of a deployment for a target load.

A **replica** is one copy of the model serving on its own: one GPU, or a tensor-parallel
group of ``num_gpus`` GPUs that shares the weights and the KV cache between them.

The step-time model is linear, the one Lab 05's simulator runs (``widgets.batching_sim``):
a step that pushes ``n`` tokens through the model takes ``base_s + per_token_s · n``.
``base_s`` is reading the weights once (bandwidth-bound), ``per_token_s`` the arithmetic of
one token (compute-bound); ``StepModel.from_roofline`` derives both from a datasheet.
Adding the two, where the roofline takes their maximum, errs on the safe side.

Invariants: every function reuses ``memory``, ``serving`` and ``cost`` rather than
restating their formulas; replica counts are rounded up; a design is only returned stable
(ρ < 1), and ``Design.utilization`` says how close to 1 it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._common import _int, _probability, _real
from .cost import cost_per_million_tokens
from .memory import kv_cache_bytes, max_concurrent_sequences, weight_bytes
from .serving import e2e_latency_s, littles_law_L, replicas_needed


# --------------------------------------------------------------------------- memory budget


def activation_bytes(num_tokens, hidden_size, intermediate_size, vocab_size, dtype_bytes=2,
                     num_logit_rows=None) -> float:
    """Peak activation memory of one forward over ``num_tokens`` tokens (an estimate):
    ``T · (2·d + 3·ffn) · dtype_bytes + rows · vocab · 4``.

    Layers run one at a time, so only one layer's temporaries live at once: the residual
    stream and its normed copy (2·d per token) and the MLP's gate, up and their product
    (3·ffn per token, the widest). The logits are fp32, one row per sequence sampled
    (``num_logit_rows``, default every token). Llama-2-70B (d 8192, ffn 28672, vocab 32000),
    512 tokens in fp16: 105 MB plus 65.5 MB of logits: small beside the weights and the KV.
    """
    t = _int("num_tokens", num_tokens)
    rows = t if num_logit_rows is None else _int("num_logit_rows", num_logit_rows)
    per_token = 2 * _int("hidden_size", hidden_size) + 3 * _int("intermediate_size", intermediate_size)
    return t * per_token * _real("dtype_bytes", dtype_bytes) + rows * _int("vocab_size", vocab_size) * 4


@dataclass(frozen=True)
class MemoryBudget:
    """Where one replica's memory goes (bytes, summed over its GPUs)."""

    usable_bytes: float       # GPU memory × num_gpus × gpu_memory_utilization
    weight_bytes: float
    activation_bytes: float
    kv_budget_bytes: float    # what is left for the KV cache (0 if nothing is)
    kv_bytes_per_seq: float   # one request at the full context length
    max_concurrent: int       # requests whose KV fits at once

    def lines(self, unit: float = 1e9, name: str = "GB") -> list[str]:
        """The budget as printable lines."""
        return [f"usable memory    {self.usable_bytes / unit:9.2f} {name}",
                f"  weights        {self.weight_bytes / unit:9.2f} {name}",
                f"  activations    {self.activation_bytes / unit:9.2f} {name}",
                f"  KV budget      {self.kv_budget_bytes / unit:9.2f} {name}",
                f"KV per request   {self.kv_bytes_per_seq / unit:9.3f} {name}",
                f"requests at once {self.max_concurrent:9d}"]


def memory_budget(num_params, num_layers, num_kv_heads, head_dim, context_len, gpu_memory_bytes,
                  *, num_gpus=1, dtype_bytes=2, kv_dtype_bytes=None, activation_bytes=0.0,
                  gpu_memory_utilization=0.9) -> MemoryBudget:
    """The memory budget of one replica at a context length.

    Usable memory is ``gpu_memory_bytes · num_gpus · gpu_memory_utilization`` (vLLM's
    default 0.9 leaves room for the CUDA context and fragmentation); the weights
    (``weight_bytes``) and ``activation_bytes`` come off the top, and what is left holds KV
    caches of ``context_len`` tokens each (``kv_cache_bytes``, in ``kv_dtype_bytes``;
    default the weights' dtype, but fp16 for weights below 2 bytes: weight-only quantization
    leaves the activations, hence K and V, in fp16). Under tensor parallelism each GPU holds 1/num_gpus of both,
    so summing over the group is exact.

    Llama-2-70B in fp16 on 4 A100-80GB at 4096 tokens: 288 GB usable, 140 GB of weights,
    1.34 GB per request: 110 requests at once. On 2 GPUs: 2.
    """
    usable = (_real("gpu_memory_bytes", gpu_memory_bytes) * _int("num_gpus", num_gpus)
              * _probability("gpu_memory_utilization", gpu_memory_utilization, allow_zero=False))
    weights = weight_bytes(num_params, dtype_bytes)
    acts = _real("activation_bytes", activation_bytes, allow_zero=True)
    kv_bytes = max(2, dtype_bytes) if kv_dtype_bytes is None else kv_dtype_bytes
    per_seq = kv_cache_bytes(num_layers, num_kv_heads, head_dim, context_len, kv_bytes)
    fit = max_concurrent_sequences(usable, weights, per_seq, acts)
    return MemoryBudget(usable, weights, acts, max(0.0, usable - weights - acts), per_seq, fit)


# --------------------------------------------------------------------------- step-time model


@dataclass(frozen=True)
class StepModel:
    """One engine step that pushes ``n`` tokens through the model takes
    ``base_s + per_token_s · n`` seconds."""

    base_s: float
    per_token_s: float

    def __post_init__(self):
        _real("base_s", self.base_s, allow_zero=True)
        _real("per_token_s", self.per_token_s, allow_zero=True)

    def step_s(self, num_tokens) -> float:
        return self.base_s + self.per_token_s * _int("num_tokens", num_tokens)

    @classmethod
    def from_roofline(cls, num_params, dtype_bytes, bandwidth_bytes_per_s, peak_flops,
                      num_gpus=1) -> "StepModel":
        """base = the weights read once over the group's bandwidth; per token = 2·N FLOPs at
        the group's peak. Llama-2-70B fp16 on 4 A100-80GB: 17.2 ms + 0.112 ms per token."""
        n = _int("num_gpus", num_gpus)
        return cls(weight_bytes(num_params, dtype_bytes) / (n * _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s)),
                   2 * _real("num_params", num_params) / (n * _real("peak_flops", peak_flops)))


def request_latency_s(step: StepModel, prompt_tokens, output_tokens, batch_size) -> float:
    """End-to-end latency of one request in a full batch of ``batch_size``: its prompt's
    prefill step, then ``output_tokens − 1`` decode steps of ``batch_size`` tokens each
    (``e2e_latency_s``).

    Batching does not shorten it: every token still waits for its own step, and a bigger
    batch makes each step longer. 200 tokens at 20 ms a step take 4 s at any batch size.
    """
    b = _int("batch_size", batch_size)
    ttft = step.step_s(_int("prompt_tokens", prompt_tokens) + b - 1)
    return e2e_latency_s(ttft, step.step_s(b), output_tokens)


def replica_seconds_per_request(step: StepModel, prompt_tokens, output_tokens, batch_size) -> float:
    """Replica time one request uses up when ``batch_size`` requests share each step:
    ``(prompt + output) · per_token + output · base ÷ batch``. Its inverse is the replica's
    service rate in requests/s; the weights' read is shared, the arithmetic is not."""
    tokens = _int("prompt_tokens", prompt_tokens) + _int("output_tokens", output_tokens)
    return tokens * step.per_token_s + output_tokens * step.base_s / _int("batch_size", batch_size)


# --------------------------------------------------------------------------- design


@dataclass(frozen=True)
class Design:
    """A deployment for a target load: ``replicas`` copies of ``gpus_per_replica`` GPUs,
    each running batches of up to ``batch_size``."""

    batch_size: int
    replicas: int
    gpus_per_replica: int
    itl_s: float                 # one decode step at a full batch
    e2e_s: float                 # one request's latency, no queueing
    in_flight: float             # λ · e2e (Little's law)
    utilization: float           # ρ per replica (< 1)
    dollars_per_hour: float
    dollars_per_million_output_tokens: float

    @property
    def num_gpus(self) -> int:
        return self.replicas * self.gpus_per_replica


def design_deployment(arrival_rate, prompt_tokens, output_tokens, step: StepModel, batch_size,
                      *, gpus_per_replica=1, dollars_per_gpu_hour=1.0,
                      max_utilization=0.8) -> Design:
    """Size a deployment: enough replicas to hold ``λ · e2e`` requests in flight at
    ``batch_size`` each (``replicas_needed``, Little's law) AND to keep each replica's
    utilization ``ρ = λ_replica · replica_seconds_per_request`` at or below ``max_utilization``
    (the headroom that keeps queueing, hence TTFT, short).

    Llama-2-70B on 4 A100s per replica (17.2 ms + 0.112 ms/token), 100 req/s of 500 tokens
    in and 200 out, batch 256: 12 replicas, 48 GPUs, ρ = 0.77, $1.67 per 1M output tokens.
    """
    lam = _real("arrival_rate", arrival_rate)
    b = _int("batch_size", batch_size)
    rho_max = _probability("max_utilization", max_utilization, allow_zero=False)
    e2e = request_latency_s(step, prompt_tokens, output_tokens, b)
    work = replica_seconds_per_request(step, prompt_tokens, output_tokens, b)
    replicas = max(replicas_needed(lam, e2e, b), math.ceil(lam * work / rho_max * (1 - 1e-12)))
    per_hour = replicas * _int("gpus_per_replica", gpus_per_replica) * _real("dollars_per_gpu_hour", dollars_per_gpu_hour)
    return Design(b, replicas, gpus_per_replica, step.step_s(b), e2e, littles_law_L(lam, e2e),
                  lam * work / replicas, per_hour,
                  cost_per_million_tokens(per_hour, lam * _int("output_tokens", output_tokens)))
