"""Closed-form formulas of LLM inference: memory, speed, parallelism, cost, queueing.

Every worked number in the labs, quizzes and widgets is computed here, so the book and the
widgets cannot disagree. Everything is plain Python on ints and floats (no torch, no numpy):
a widget can call it on every slider move.

Conventions (the invariants of this package):
- Units are bytes, seconds and FLOPs. A multiply-add counts as 2 FLOPs.
- Prefixes are SI: 1 GB = 1e9 bytes, 1 TB/s = 1e12 bytes/s. Where a textbook's number is
  really in GiB (2**30 bytes) the docstring says so; the constants ``GB`` and ``GiB`` are
  both here so a cell can show both.
- ``dtype_bytes`` is bytes per element: 4 for fp32, 2 for fp16/bf16, 1 for fp8/int8, 0.5 for
  int4 (see ``DTYPE_BYTES``).
- Bad arguments raise ``ValueError`` whose message names the argument, shows the value
  given and says what is allowed. No function mutates its inputs.

One module per topic; every name is re-exported here, so ``calc.kv_cache_bytes(...)`` works:

    memory.py        KV-cache bytes, parameters and weight bytes, sequences that fit in
                     memory
    speed.py         decode tokens/s on the roofline, prefill/decode FLOPs, intensity,
                     the launch floor of a step
    attention.py     MHA / GQA / MQA, the score matrix, decode attention's intensity,
                     sliding-window KV and RoPE scaling
    batching.py      static batch waste, continuous batching's ideal throughput
    speculative.py   expected tokens, speedup and best k of speculative decoding
    parallel.py      ring all-reduce; TP head rule, traffic, memory and step time; bubble
    moe.py           mixture of experts: parameters, expert-parallel memory, all-to-all bytes
    timeline.py      per-rank timeline of TP/PP (compute, all-reduce, bubble), Lab 08's widget
    quantization.py  group-quantized weight bytes, int8 KV-cache bytes, symmetric quantization
    serving.py       utilization, M/M/1 latency, Little's law, end-to-end latency, percentiles,
                     replicas, KV transfer, LoRA adapter bytes, KV fragmentation
    cost.py          $ per million tokens, break-even against an API, GPUs for a load
    capacity.py      a replica's memory budget, the step-time model, deployment design
    _common.py       units, ``DTYPE_BYTES`` and the argument checks they all share
"""

from __future__ import annotations

from ._common import DTYPE_BYTES, GB, KB, MB, TB, GiB
from .attention import (attention_intensity, attention_kind, attention_matrix_bytes, gqa_reduction,
                        max_kv_heads, rope_max_wavelength, rope_ntk_theta, sliding_window_kv_tokens)
from .batching import (continuous_batch_ideal_throughput, static_batch_throughput,
                       static_batch_utilization, static_batch_wasted_steps)
from .capacity import (Design, MemoryBudget, StepModel, activation_bytes, design_deployment,
                       memory_budget, replica_seconds_per_request, request_latency_s)
from .cost import (HOURS_PER_MONTH, break_even_tokens_per_month, break_even_utilization,
                   cost_per_million_tokens, gpu_dollars_per_month, gpus_for_load,
                   tokens_per_month)
from .memory import (attention_params, embedding_params, kv_cache_bytes,
                     kv_cache_bytes_per_token, max_concurrent_sequences, memory_per_gpu,
                     norm_params, swiglu_params, weight_bytes)
from .moe import (MIXTRAL_8X7B, MoEConfig, ep_all_to_all_bytes_per_token, ep_expert_bytes_per_gpu,
                  ep_memory_per_gpu)
from .parallel import (NVLINK_H100_BYTES_PER_S, PCIE_GEN5_BYTES_PER_S, allreduce_time_s,
                       pp_bubble_fraction, ring_allreduce_bytes, tp_allreduce_bytes,
                       tp_allreduce_count, tp_allreduces_per_layer, tp_kv_heads_per_rank,
                       tp_kv_replicas, tp_logits_gather_bytes, tp_param_bytes_per_rank,
                       tp_shard_size, tp_size_problem, tp_step_time_s, tp_valid_sizes)
from .quantization import kv_cache_int8_bytes, quantized_weight_bytes, symmetric_quantize
from .serving import (e2e_latency_s, kv_fragmentation, kv_transfer_time_s, littles_law_L,
                      lora_adapter_bytes, mm1_latency_percentile, mm1_mean_latency, percentile,
                      queueing_latency_s, replicas_needed, utilization)
from .speculative import (spec_acceptance_probability, spec_expected_tokens,
                          spec_expected_tokens_by_position, spec_expected_tokens_naive,
                          spec_optimal_k, spec_speedup, spec_speedup_from_tokens)
from .speed import (batched_decode_tokens_per_s, decode_crossover_batch, decode_flops,
                    decode_step_time_s, decode_tokens_per_s, launch_floor_s, matmul_intensity,
                    matvec_intensity, prefill_flops, ridge_point, roofline_flops, step_floor_s)

__all__ = [
    "KB", "MB", "GB", "TB", "GiB", "DTYPE_BYTES", "HOURS_PER_MONTH",
    "kv_cache_bytes_per_token", "kv_cache_bytes", "weight_bytes", "memory_per_gpu",
    "attention_params", "swiglu_params", "norm_params", "embedding_params",
    "max_concurrent_sequences",
    "decode_tokens_per_s", "decode_step_time_s", "batched_decode_tokens_per_s",
    "prefill_flops", "decode_flops", "matvec_intensity", "matmul_intensity", "ridge_point",
    "roofline_flops", "launch_floor_s", "step_floor_s", "decode_crossover_batch",
    "gqa_reduction", "max_kv_heads", "attention_kind", "attention_matrix_bytes", "attention_intensity",
    "sliding_window_kv_tokens", "rope_max_wavelength", "rope_ntk_theta",
    "static_batch_wasted_steps", "static_batch_utilization", "static_batch_throughput",
    "continuous_batch_ideal_throughput",
    "spec_expected_tokens", "spec_expected_tokens_by_position", "spec_expected_tokens_naive",
    "spec_speedup", "spec_speedup_from_tokens", "spec_optimal_k",
    "spec_acceptance_probability",
    "ring_allreduce_bytes", "allreduce_time_s", "tp_allreduces_per_layer", "pp_bubble_fraction",
    "NVLINK_H100_BYTES_PER_S", "PCIE_GEN5_BYTES_PER_S", "tp_size_problem", "tp_valid_sizes",
    "tp_kv_heads_per_rank", "tp_kv_replicas", "tp_shard_size", "tp_allreduce_count",
    "tp_allreduce_bytes", "tp_logits_gather_bytes", "tp_param_bytes_per_rank", "tp_step_time_s",
    "MoEConfig", "MIXTRAL_8X7B", "ep_expert_bytes_per_gpu", "ep_memory_per_gpu",
    "ep_all_to_all_bytes_per_token",
    "quantized_weight_bytes", "symmetric_quantize", "kv_cache_int8_bytes",
    "utilization", "mm1_mean_latency", "littles_law_L", "e2e_latency_s", "percentile",
    "mm1_latency_percentile", "queueing_latency_s", "replicas_needed", "kv_transfer_time_s",
    "lora_adapter_bytes", "kv_fragmentation",
    "cost_per_million_tokens", "break_even_tokens_per_month", "break_even_utilization",
    "gpu_dollars_per_month", "tokens_per_month", "gpus_for_load",
    "activation_bytes", "MemoryBudget", "memory_budget", "StepModel", "request_latency_s",
    "replica_seconds_per_request", "Design", "design_deployment",
]
