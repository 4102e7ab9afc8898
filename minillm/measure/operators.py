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
from ..timing import time_fn, time_graph
from ._common import _check_int, _device_dtype, _name
from .results import OpMeasurement

CALLS_PER_GRAPH = 20       # CUDA: calls replayed from one graph per timing
MAX_COPIES = 64            # CUDA: copies of the operands at most (small ones fill 2 x L2)
L2_BYTES_DEFAULT = 50 << 20  # an H100's L2, where the device does not say


def _l2_bytes(dev: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or L2_BYTES_DEFAULT


def _op_seconds(make_call, operand_bytes: int, dev: torch.device, warmup: int,
                repeats: int) -> float:
    """Seconds per call of ``make_call(i)()``, a call over copy ``i`` of the operands (copy 0:
    the ones made first). On a CPU: ``time_fn``'s median over copy 0. On CUDA an operator of
    a few µs timed alone between two events is mostly the host's launch, and a repeat
    re-reads operands the L2 cache still holds (an H100's is 50 MB): there CALLS_PER_GRAPH
    calls, cycling over enough copies to fill twice the L2, are replayed from one CUDA graph
    (``timing.time_graph``), so each call reads memory as it would inside a model."""
    if dev.type != "cuda":
        return time_fn(make_call(0), warmup=warmup, repeats=repeats, device=dev)
    copies = max(1, min(MAX_COPIES, -(-2 * _l2_bytes(dev) // max(operand_bytes, 1))))
    calls = [make_call(i) for i in range(copies)]
    return time_graph([calls[i % copies] for i in range(max(CALLS_PER_GRAPH, copies))],
                      replays=repeats, device=dev)


def _copies(*tensors: torch.Tensor):
    """make(i): copy i of ``tensors`` (copy 0: the tensors themselves)."""
    return lambda i: tensors if i == 0 else tuple(t.clone() for t in tensors)


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
    db = x.element_size()
    copy = _copies(x, w, out)

    def call(i):
        xi, wi, oi = copy(i)
        return lambda: torch.matmul(xi, wi.t(), out=oi)
    seconds = _op_seconds(call, (m * k + n * k + m * n) * db, dev, warmup, repeats)
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
    db = w.element_size()
    copy = _copies(w, x)

    def call(i):
        wi, xi = copy(i)
        return lambda: F.linear(xi, wi)
    seconds = _op_seconds(call, (rows * cols + cols + rows) * db, dev, warmup, repeats)
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
    db = q.element_size()
    flops = 4.0 * batch * num_heads * context_len * head_dim
    moved = float(batch * (2 * num_kv_heads * context_len * head_dim + 2 * num_heads * head_dim) * db)
    copy = _copies(q, k, v)

    def call(i):
        qi, ki, vi = copy(i)
        return lambda: be.dense(qi, ki, vi, causal=True)
    seconds = _op_seconds(call, int(moved), dev, warmup, repeats)
    return OpMeasurement(
        name=f"attention B={batch} S={context_len}", kind="attention", batch=batch, flops=flops,
        bytes_moved=moved, seconds=seconds, dtype=_name(dt), device=str(dev),
        details={"context_len": context_len, "num_heads": num_heads,
                 "num_kv_heads": num_kv_heads, "head_dim": head_dim, "backend": be.name})
