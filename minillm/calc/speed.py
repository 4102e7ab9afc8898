"""Speed on the roofline: decode tokens/s, prefill and decode FLOPs, arithmetic intensity,
and the launch wall.

A step's time is ``max(bytes / bandwidth, FLOPs / peak)``; a multiply-add is 2 FLOPs. A
small model's decode step has one more floor, the launch floor: the operations the host
issues per step times the cost of issuing one (``launch_floor_s``, ``step_floor_s``).
"""

from __future__ import annotations

import math

from ._common import _attention_dims, _int, _real
from .memory import weight_bytes


# --------------------------------------------------------------------------- decode speed


def decode_tokens_per_s(num_params, dtype_bytes, bandwidth_bytes_per_s, kv_bytes=0) -> float:
    """Bandwidth-bound ceiling of batch-1 decode: ``bandwidth / (N · dtype_bytes + kv_bytes)``.

    Each step must read every weight once (plus ``kv_bytes`` of KV cache), so no batch-1
    decoder can beat this. At 2 TB/s in fp16: 70B → 14.3 tok/s, 7B → 143, 405B → 2.47.
    """
    bw = _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    per_step = weight_bytes(num_params, dtype_bytes) + _real("kv_bytes", kv_bytes, allow_zero=True)
    return bw / per_step


def decode_step_time_s(num_params, dtype_bytes, bandwidth_bytes_per_s, peak_flops, batch=1,
                       kv_bytes_per_seq=0) -> float:
    """Roofline time of one batched decode step: ``max(bytes / bandwidth, FLOPs / peak)``.

    bytes = ``N · dtype_bytes + batch · kv_bytes_per_seq`` (weights read once, shared by the
    batch); FLOPs = ``2 · N · batch``. Attention FLOPs are left out.
    """
    b = _int("batch", batch)
    moved = weight_bytes(num_params, dtype_bytes) + b * _real("kv_bytes_per_seq", kv_bytes_per_seq, allow_zero=True)
    flops = 2 * _real("num_params", num_params) * b
    return max(moved / _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
               flops / _real("peak_flops", peak_flops))


def launch_floor_s(launches_per_step, launch_s) -> float:
    """The launch floor of a step: ``launches_per_step · launch_s``. Every operation the host
    issues costs it ``launch_s`` (Python, dispatch and, on a GPU, the kernel launch) however
    little the operation does. SmolLM2 eager on an H100: ~900 launches × ~5 µs ≈ 4.5 ms, 50×
    the 0.09 ms its bf16 weights take at 3 TB/s."""
    return _real("launches_per_step", launches_per_step, allow_zero=True) * _real("launch_s", launch_s)


def step_floor_s(bytes_floor, launch_floor, overlapped: bool, kernel_floor=0.0) -> float:
    """A step's time from its floors, in seconds: the largest where the host issues work while
    the device runs earlier work (a GPU: ``overlapped``), the sum of bytes and launches where
    one core does both (a CPU). ``kernel_floor`` (a GPU's): kernels per step × what one
    tiny kernel costs the device even when nothing launches it from the host (a CUDA-graph
    replay): the floor a replayed step meets once the launches are gone."""
    b = _real("bytes_floor", bytes_floor, allow_zero=True)
    lf = _real("launch_floor", launch_floor, allow_zero=True)
    kf = _real("kernel_floor", kernel_floor, allow_zero=True)
    return max(b, lf, kf) if overlapped else b + lf


def batched_decode_tokens_per_s(num_params, dtype_bytes, bandwidth_bytes_per_s, peak_flops,
                                batch=1, kv_bytes_per_seq=0) -> float:
    """Total tokens/s of a decode batch on the roofline: ``batch / decode_step_time_s(...)``.

    Grows almost linearly with ``batch`` while memory-bound, then flattens at the compute roof.
    """
    step = decode_step_time_s(num_params, dtype_bytes, bandwidth_bytes_per_s, peak_flops,
                              batch, kv_bytes_per_seq)
    return _int("batch", batch) / step


# --------------------------------------------------------------------------- FLOPs


def prefill_flops(num_params, num_tokens, num_layers=0, attn_dim=0) -> float:
    """FLOPs to prefill a prompt: ``2 · N · T`` (+ causal attention ``2 · L · d · T · (T + 1)``).

    Every token meets every weight once (a multiply-add, 2 FLOPs). With ``num_layers`` and
    ``attn_dim`` (= num_heads · head_dim) the attention term is added: token t scores t
    keys (QKᵀ, 2·d·t FLOPs per layer) and mixes t values (P·V, 2·d·t), summed over
    t = 1..T. It matters only once T approaches ~N / (L·d).
    """
    n = _real("num_params", num_params)
    t = _int("num_tokens", num_tokens)
    layers, dim = _attention_dims(num_layers, attn_dim)
    return 2 * n * t + 2 * layers * dim * t * (t + 1)


def decode_flops(num_params, context_len=0, num_layers=0, attn_dim=0) -> float:
    """FLOPs to decode one token: ``2 · N`` (+ attention ``4 · L · d · context_len``).

    ``context_len`` is the number of positions the new token attends to (cached tokens plus
    itself); the attention term needs ``num_layers`` and ``attn_dim`` (= num_heads ·
    head_dim): QKᵀ and P·V each cost 2·d FLOPs per position per layer. (Kaplan et al.'s
    table writes 2·L·T·d for this term, counting only QKᵀ.) Softmax is left out.
    """
    n = _real("num_params", num_params)
    ctx = _int("context_len", context_len, minimum=0)
    layers, dim = _attention_dims(num_layers, attn_dim)
    if ctx and not layers:
        raise ValueError(
            f"context_len={ctx} needs num_layers and attn_dim to price attention; "
            "pass them too, or leave context_len=0 for the 2·N estimate."
        )
    return 2 * n + 4 * layers * dim * ctx


# --------------------------------------------------------------------------- arithmetic intensity


def matvec_intensity(rows, cols, dtype_bytes) -> float:
    """FLOPs per byte of y = W·x with W rows×cols: ``2·r·c / ((r·c + c + r) · dtype_bytes)``.

    Each operand is read once and the output written once. For a large fp16 W this is
    about 1 FLOP/byte: batch-1 decode, far below any GPU's ridge point.
    """
    r = _int("rows", rows)
    c = _int("cols", cols)
    return 2 * r * c / ((r * c + c + r) * _real("dtype_bytes", dtype_bytes))


def matmul_intensity(m, n, k, dtype_bytes) -> float:
    """FLOPs per byte of C[m×n] = A[m×k]·B[k×n]: ``2·m·n·k / ((m·k + k·n + m·n) · dtype_bytes)``.

    Each operand read once, the output written once (ideal caching). A decode batch of B
    tokens through a d_out×d_in weight is ``matmul_intensity(B, d_out, d_in, ...)``: the
    intensity grows about linearly with B while B ≪ d.
    """
    m_ = _int("m", m)
    n_ = _int("n", n)
    k_ = _int("k", k)
    return 2 * m_ * n_ * k_ / ((m_ * k_ + k_ * n_ + m_ * n_) * _real("dtype_bytes", dtype_bytes))


def ridge_point(peak_flops, bandwidth_bytes_per_s) -> float:
    """Intensity (FLOPs/byte) where the roofline turns: ``peak_flops / bandwidth``.

    A100: 312e12 / 2e12 = 156 (153 with the exact 2.039 TB/s). H100 SXM: 989e12 / 3.35e12 = 295.
    """
    return _real("peak_flops", peak_flops) / _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s)


def decode_crossover_batch(flops_per_seq, weight_bytes, kv_bytes_per_seq, ridge) -> float:
    """Batch B at which a decode step turns compute-bound: its intensity ``B·f / (W + B·k)``
    reaches ``ridge``, so ``B = ridge·W / (f − ridge·k)``; ``math.inf`` when no batch does.

    f: FLOPs per sequence (about 2·N), W: weight bytes (read once for the whole batch),
    k: KV-cache bytes per sequence (each sequence reads its own). The intensity tends to
    f / k as B grows, so when f / k is at or below the ridge no batch reaches it.
    Llama-2-70B in fp16 on an A100 (ridge 156) with 512 cached tokens: B ≈ 192; with 4,096,
    never.
    """
    f = _real("flops_per_seq", flops_per_seq)
    w = _real("weight_bytes", weight_bytes)
    k = _real("kv_bytes_per_seq", kv_bytes_per_seq, allow_zero=True)
    r = _real("ridge", ridge)
    denom = f - r * k
    return math.inf if denom <= 0 else r * w / denom


def roofline_flops(intensity, peak_flops, bandwidth) -> float:
    """Attainable FLOP/s at an arithmetic intensity: ``min(peak, intensity · bandwidth)``."""
    return min(_real("peak_flops", peak_flops),
               _real("intensity", intensity) * _real("bandwidth", bandwidth))
