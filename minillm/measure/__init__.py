"""Measured minillm operations, for the roofline and the memory wall (Lab 01).

Each ``measure_*`` function runs one real operation on this machine and returns an
``OpMeasurement``: what ran, the FLOPs it must do, the bytes it must move, the median
seconds, hence achieved FLOP/s, achieved bytes/s and arithmetic intensity (FLOPs/byte).
A widget measures once and plots many times; nothing here draws.

Invariants (how FLOPs and bytes are counted; the same conventions as ``minillm.calc``):
- A multiply-add is 2 FLOPs. Softmax, norms, RoPE and activations' elementwise work are
  left out: they are a few percent of the FLOPs of a decode step.
- Bytes are the *ideal* traffic: every operand read once and every output written once
  (perfect caching). Real kernels move at least this much, so achieved GB/s computed from
  these bytes is a lower bound on the true traffic rate. Activations between layers are left
  out of the model-level counts (under 5% of the bytes at batch 64 for SmolLM2).
- A decode step of a model reads every matrix weight once (the tied LM head included; the
  embedding lookup reads only B rows, so it is not counted) and the whole KV cache of every
  sequence: ``context_len + 1`` positions, the new token's K/V included.
- Timings are medians of ``minillm.perf.time_fn``. The operation is idempotent (a decode
  step rewrites the same cache slot each call), so repeats measure the same work.

Layout (every name is re-exported here, e.g. ``measure.measure_attention_decode``):

    results.py    OpMeasurement, roofline_fraction, format_table
    steps.py      the whole model: measure_decode_steps, measure_prefill, measure_operations,
                  measure_weight_stream (a step's weight products alone)
    operators.py  one operator: measure_matmul, measure_matvec, measure_attention_decode
    memory.py     attention_peak_growth: peak memory of one attention call (RSS in a fresh
                  process on a CPU, the allocator's peak on CUDA)
    launch.py     the launch wall: measure_launch_cost (and a kernel's, a Triton launch's,
                  a launch's from compiled code), measure_launch_wall (eager, compiled,
                  CUDA-graph decode against its floors), decode_bandwidth (what the bytes
                  floor divides by, per device)
    step_counts.py what a decode step issues and runs: count_step_ops (torch.profiler)
    step_profile.py where a decode step's time goes: profile_decode_step (torch.profiler;
                  weight products, attention, the rest; the top operators)

Every function runs on ``device`` (None: ``minillm.devices.default_device()``), or on the
model's device for the model-level ones: the roofline's points and roof come from one device
(``check_same_device``).
"""

from __future__ import annotations

from .launch import LaunchWall, decode_bandwidth, measure_launch_cost, measure_launch_wall
from .memory import attention_peak_growth
from .operators import measure_attention_decode, measure_matmul, measure_matvec
from .results import OpMeasurement, check_same_device, format_table, roofline_fraction
from .step_counts import count_step_ops
from .step_profile import StepProfile, profile_decode_step
from .steps import (DEFAULT_BATCH_SIZES, matmul_params, measure_decode_steps,
                    measure_operations, measure_prefill, measure_weight_stream)

__all__ = [
    "OpMeasurement", "DEFAULT_BATCH_SIZES", "matmul_params", "measure_decode_steps",
    "measure_prefill", "measure_weight_stream", "measure_matmul", "measure_matvec",
    "measure_attention_decode",
    "measure_operations", "roofline_fraction", "format_table", "attention_peak_growth",
    "check_same_device", "LaunchWall", "measure_launch_cost", "count_step_ops",
    "measure_launch_wall", "decode_bandwidth", "StepProfile", "profile_decode_step",
]
