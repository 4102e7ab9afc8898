"""Measure one operator on random inputs: a prefill-like matmul, a decode-like matvec, and
one layer's decode attention.

FLOPs and bytes are the ideal counts of ``minillm.calc`` (``matmul_intensity``,
``matvec_intensity``, ``attention_intensity``), so a measured intensity equals the formula's.
Every function runs on ``device`` (None: ``minillm.devices.default_device()``) in ``dtype``
(None: that device's default, bf16 on CUDA and fp32 on a CPU), the same defaults as
``perf.measure_machine`` and ``load_model``, so an operator and the roofline it is drawn
under come from one device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import get_backend
from ..timing import time_fn
from ._common import _check_int, _device_dtype, _name
from .results import OpMeasurement


def measure_matmul(m: int, n: int, k: int, dtype=None, device=None, repeats: int = 5,
                   warmup: int = 1, seed: int = 0) -> OpMeasurement:
    """Time x[m, k]·W[n, k]ᵀ (what ``nn.Linear`` computes), a prefill-like GEMM (m tokens through an
    n×k weight).

    FLOPs = 2·m·n·k; bytes = (m·k + n·k + m·n) · dtype_bytes, so the intensity equals
    ``calc.matmul_intensity(m, n, k, dtype_bytes)``.
    """
    for name, v in (("m", m), ("n", n), ("k", k)):
        _check_int(name, v)
    dev, dt = _device_dtype(device, dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dev, dt)
    w = torch.randn(n, k, generator=g).to(dev, dt)
    out = torch.empty(m, n, dtype=dt, device=dev)
    seconds = time_fn(lambda: torch.matmul(x, w.t(), out=out), warmup=warmup, repeats=repeats,
                      device=dev)
    db = x.element_size()
    return OpMeasurement(
        name=f"matmul {m}x{n}x{k}", kind="matmul", batch=m, flops=2.0 * m * n * k,
        bytes_moved=float((m * k + n * k + m * n) * db), seconds=seconds, dtype=_name(dt),
        device=str(dev), details={"m": m, "n": n, "k": k})


def measure_matvec(rows: int, cols: int, dtype=None, device=None, repeats: int = 5,
                   warmup: int = 1, seed: int = 0) -> OpMeasurement:
    """Time y = W·x with W rows×cols, the decode-like matrix-vector product (one token
    through one weight; ``F.linear`` on a single row, as batch-1 decode does).

    FLOPs = 2·rows·cols; bytes = (rows·cols + cols + rows) · dtype_bytes, so the intensity
    equals ``calc.matvec_intensity(rows, cols, dtype_bytes)``: about 2 / dtype_bytes.
    """
    _check_int("rows", rows)
    _check_int("cols", cols)
    dev, dt = _device_dtype(device, dtype)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).to(dev, dt)
    x = torch.randn(1, cols, generator=g).to(dev, dt)
    seconds = time_fn(lambda: F.linear(x, w), warmup=warmup, repeats=repeats, device=dev)
    db = w.element_size()
    return OpMeasurement(
        name=f"matvec {rows}x{cols}", kind="matvec", batch=1, flops=2.0 * rows * cols,
        bytes_moved=float((rows * cols + cols + rows) * db), seconds=seconds, dtype=_name(dt),
        device=str(dev), details={"rows": rows, "cols": cols})


def measure_attention_decode(batch: int = 1, context_len: int = 1024, num_heads: int = 9,
                             num_kv_heads: int = 3, head_dim: int = 64, dtype=None,
                             device=None, backend="torch", repeats: int = 5, warmup: int = 1,
                             seed: int = 0) -> OpMeasurement:
    """Time one layer's decode attention: one query per sequence over ``context_len`` cached
    keys and values (q [B, Hq, 1, D], K/V [B, Hkv, S, D]), through ``backend.dense`` as the
    model calls it. Defaults are SmolLM2's heads (9 query, 3 KV, head_dim 64).

    FLOPs = ``4 · B · Hq · S · D`` (QKᵀ and P·V); bytes = ``B · (2 · Hkv · S · D + 2 · Hq · D) ·
    dtype_bytes`` (K and V read once, q in, output out), so the intensity equals
    ``calc.attention_intensity(S, D, Hq, Hkv, dtype_bytes)`` whatever the batch: each
    sequence reads its own cache.
    """
    for name, v in (("batch", batch), ("context_len", context_len), ("num_heads", num_heads),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        _check_int(name, v)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide num_heads; got num_heads={num_heads}, "
                         f"num_kv_heads={num_kv_heads}.")
    dev, dt = _device_dtype(device, dtype)
    be = get_backend(backend)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_heads, 1, head_dim, generator=g).to(dev, dt)
    k = torch.randn(batch, num_kv_heads, context_len, head_dim, generator=g).to(dev, dt)
    v = torch.randn(batch, num_kv_heads, context_len, head_dim, generator=g).to(dev, dt)
    seconds = time_fn(lambda: be.dense(q, k, v, causal=True), warmup=warmup, repeats=repeats,
                      device=dev)
    db = q.element_size()
    flops = 4.0 * batch * num_heads * context_len * head_dim
    moved = float(batch * (2 * num_kv_heads * context_len * head_dim + 2 * num_heads * head_dim) * db)
    return OpMeasurement(
        name=f"attention B={batch} S={context_len}", kind="attention", batch=batch, flops=flops,
        bytes_moved=moved, seconds=seconds, dtype=_name(dt), device=str(dev),
        details={"context_len": context_len, "num_heads": num_heads,
                 "num_kv_heads": num_kv_heads, "head_dim": head_dim, "backend": be.name})
