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
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from . import calc
from .attention import ContiguousCacheContext, get_backend
from .config import ModelConfig
from .kv_cache import KVCache
from .perf import time_fn

__all__ = [
    "OpMeasurement", "DEFAULT_BATCH_SIZES", "matmul_params", "measure_decode_steps",
    "measure_prefill", "measure_matmul", "measure_matvec", "measure_attention_decode",
    "measure_operations", "roofline_fraction", "format_table",
]

#: Batch sizes of the Lab 01 decode sweep: batch 1 (matrix-vector) up to 64 (compute-bound
#: on a laptop CPU).
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class OpMeasurement:
    """One measured operation. ``flops`` and ``bytes_moved`` are per call, for the whole
    batch; ``seconds`` is the median time of one call."""

    name: str            # e.g. "decode B=8", "matmul 512x3072x576"
    kind: str            # "decode", "prefill", "matmul", "matvec" or "attention"
    batch: int           # sequences (decode, prefill, attention) or rows of the input (matmul)
    flops: float
    bytes_moved: float
    seconds: float
    dtype: str           # torch dtype name, e.g. "float32"
    device: str
    details: dict = dataclasses.field(default_factory=dict)  # sizes used, bytes breakdown

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_moved / self.seconds

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes_moved

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict:
        """Fields plus the derived rates, JSON-ready."""
        d = dataclasses.asdict(self)
        d.update(flops_per_s=self.flops_per_s, bytes_per_s=self.bytes_per_s,
                 intensity=self.intensity)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "OpMeasurement":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def __str__(self) -> str:
        return (f"{self.name}: {self.seconds * 1e3:.2f} ms, {self.flops_per_s / 1e9:.2f} GFLOP/s, "
                f"{self.bytes_per_s / 1e9:.2f} GB/s, {self.intensity:.3g} FLOP/byte")


# --------------------------------------------------------------------------- helpers


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return value


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32; got {dtype!r}.")
    return dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def matmul_params(config: ModelConfig) -> int:
    """Weights one token multiplies through: every layer's matrices plus the LM head.

    For tied embeddings this is ``config.num_params()`` (the embedding matrix *is* the LM
    head; norms add a few thousand); untied, the embedding table is left out, since a token
    only looks up its own row.
    """
    n = config.num_params(include_embedding=False) + config.vocab_size * config.hidden_size
    return n


def _model_counts(config: ModelConfig, dtype_bytes: int) -> dict:
    n = matmul_params(config)
    return {
        "model": config.name,
        "num_params": n,
        "num_layers": config.num_layers,
        "attn_dim": config.num_heads * config.head_dim,
        "weight_bytes": calc.weight_bytes(n, dtype_bytes),
        "kv_bytes_per_token": calc.kv_cache_bytes_per_token(
            config.num_layers, config.num_kv_heads, config.head_dim, dtype_bytes),
    }


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, leave=False)


# --------------------------------------------------------------------------- model-level


@torch.inference_mode()
def measure_decode_steps(model, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                         context_len: int = 128, repeats: int = 5, warmup: int = 1,
                         progress: bool = False, seed: int = 0) -> list[OpMeasurement]:
    """Time one full decode step of ``model`` at each batch size, over a KV cache that already
    holds ``context_len`` tokens per sequence.

    One random prompt of ``context_len`` tokens is prefilled once, for real; every row of each
    batch's cache gets a copy of its K/V (the step's cost does not depend on which tokens are
    cached, and this avoids prefilling 64 × 128 tokens). The timed call is exactly what
    ``minillm.generate`` does per token: ``model(ids[B, 1], positions[B, 1], ctx)`` appending
    at slot ``context_len`` and attending over ``context_len + 1`` positions, LM head included.

    FLOPs = ``B · calc.decode_flops(N, context_len + 1, L, Hq·D)``;
    bytes = ``N · dtype_bytes + calc.kv_cache_bytes(L, Hkv, D, context_len + 1, dtype_bytes, B)``.
    The real model takes roughly 30-60 ms at batch 1 and ~300 ms at batch 64 on 2 CPU
    cores, so the default sweep costs about (warmup + repeats) seconds.
    """
    cfg = model.config
    sizes = [_check_int("batch_sizes[]", b) for b in batch_sizes]
    if not sizes:
        raise ValueError("batch_sizes is empty; give at least one batch size, e.g. (1, 8, 64).")
    _check_int("context_len", context_len)
    if context_len + 1 > cfg.max_position_embeddings:
        raise ValueError(f"context_len must be below the model's context length "
                         f"{cfg.max_position_embeddings} (the step appends one token); "
                         f"got {context_len}.")
    dev, dtype = model.device, model.dtype
    db = torch.empty((), dtype=dtype).element_size()
    counts = _model_counts(cfg, db)
    seq = context_len + 1
    g = torch.Generator().manual_seed(seed)

    base = KVCache(cfg, 1, context_len, dtype, dev)
    prompt = torch.randint(0, cfg.vocab_size, (1, context_len), generator=g).to(dev)
    model(prompt, torch.arange(context_len, device=dev)[None],
          ContiguousCacheContext(model.attn_backend, base, 0), last_only=True)

    results = []
    bar = _progress(sizes, progress, "decode steps")
    for batch in bar:
        cache = KVCache(cfg, batch, seq, dtype, dev)
        for layer in range(cfg.num_layers):
            cache.k[layer][:, :context_len] = base.k[layer]
            cache.v[layer][:, :context_len] = base.v[layer]
        ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g).to(dev)
        positions = torch.full((batch, 1), context_len, dtype=torch.long, device=dev)
        ctx = ContiguousCacheContext(model.attn_backend, cache, context_len)
        seconds = time_fn(lambda: model(ids, positions, ctx), warmup=warmup, repeats=repeats,
                          device=dev)
        kv_read = calc.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, seq, db,
                                      batch)
        flops_per_seq = calc.decode_flops(counts["num_params"], seq, cfg.num_layers,
                                          counts["attn_dim"])
        results.append(OpMeasurement(
            name=f"decode B={batch}", kind="decode", batch=batch,
            flops=batch * flops_per_seq, bytes_moved=counts["weight_bytes"] + kv_read,
            seconds=seconds, dtype=_name(dtype), device=str(dev),
            details={**counts, "context_len": context_len, "flops_per_seq": flops_per_seq,
                     "kv_bytes_per_seq": kv_read / batch}))
        if progress:
            bar.set_postfix_str(f"B={batch}: {seconds * 1e3:.0f} ms")
        del cache, ctx
    return results


@torch.inference_mode()
def measure_prefill(model, num_tokens: int = 128, batch: int = 1, repeats: int = 3,
                    warmup: int = 1, seed: int = 0) -> OpMeasurement:
    """Time the prefill of ``batch`` prompts of ``num_tokens`` tokens (cache filled, logits of
    the last token only, as ``minillm.generate`` does).

    FLOPs = ``B · calc.prefill_flops(N, T, L, Hq·D)``; bytes = weights once + the K/V written
    (``B · T`` tokens). Intensity grows with T: prefill is compute-bound.
    """
    cfg = model.config
    _check_int("num_tokens", num_tokens)
    _check_int("batch", batch)
    if num_tokens > cfg.max_position_embeddings:
        raise ValueError(f"num_tokens must be at most the context length "
                         f"{cfg.max_position_embeddings}; got {num_tokens}.")
    dev, dtype = model.device, model.dtype
    db = torch.empty((), dtype=dtype).element_size()
    counts = _model_counts(cfg, db)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, num_tokens), generator=g).to(dev)
    positions = torch.arange(num_tokens, device=dev).expand(batch, num_tokens)
    cache = KVCache(cfg, batch, num_tokens, dtype, dev)
    ctx = ContiguousCacheContext(model.attn_backend, cache, 0)
    seconds = time_fn(lambda: model(ids, positions, ctx, last_only=True), warmup=warmup,
                      repeats=repeats, device=dev)
    flops = batch * calc.prefill_flops(counts["num_params"], num_tokens, cfg.num_layers,
                                       counts["attn_dim"])
    kv_written = calc.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                     num_tokens, db, batch)
    return OpMeasurement(
        name=f"prefill {num_tokens} tok" + (f" B={batch}" if batch > 1 else ""), kind="prefill",
        batch=batch, flops=flops, bytes_moved=counts["weight_bytes"] + kv_written,
        seconds=seconds, dtype=_name(dtype), device=str(dev),
        details={**counts, "num_tokens": num_tokens})


# --------------------------------------------------------------------------- kernels


def measure_matmul(m: int, n: int, k: int, dtype=torch.float32, device=None, repeats: int = 5,
                   warmup: int = 1, seed: int = 0) -> OpMeasurement:
    """Time x[m, k]·W[n, k]ᵀ (what ``nn.Linear`` computes), a prefill-like GEMM (m tokens through an
    n×k weight).

    FLOPs = 2·m·n·k; bytes = (m·k + n·k + m·n) · dtype_bytes, so the intensity equals
    ``calc.matmul_intensity(m, n, k, dtype_bytes)``.
    """
    for name, v in (("m", m), ("n", n), ("k", k)):
        _check_int(name, v)
    dt, dev = _dtype(dtype), _device(device)
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


def measure_matvec(rows: int, cols: int, dtype=torch.float32, device=None, repeats: int = 5,
                   warmup: int = 1, seed: int = 0) -> OpMeasurement:
    """Time y = W·x with W rows×cols, the decode-like matrix-vector product (one token
    through one weight; ``F.linear`` on a single row, as batch-1 decode does).

    FLOPs = 2·rows·cols; bytes = (rows·cols + cols + rows) · dtype_bytes, so the intensity
    equals ``calc.matvec_intensity(rows, cols, dtype_bytes)``: about 2 / dtype_bytes.
    """
    _check_int("rows", rows)
    _check_int("cols", cols)
    dt, dev = _dtype(dtype), _device(device)
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
                             num_kv_heads: int = 3, head_dim: int = 64, dtype=torch.float32,
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
    dt, dev = _dtype(dtype), _device(device)
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


# --------------------------------------------------------------------------- all of Lab 01


def measure_operations(model, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                       context_len: int = 128, prefill_tokens: int = 128, repeats: int = 5,
                       progress: bool = True) -> list[OpMeasurement]:
    """Everything the Lab 01 roofline plots, measured once with ``model``'s dtype and device:
    decode steps at each batch size, one prefill, the LM head as a matvec (batch-1 decode's
    biggest matrix) and as a prefill GEMM through the MLP, and decode attention at two sizes.
    About 10-15 s for SmolLM2 on 2 CPU cores.
    """
    cfg, dt, dev = model.config, model.dtype, model.device
    ops = measure_decode_steps(model, batch_sizes, context_len, repeats=repeats,
                               progress=progress)
    steps = [
        lambda: measure_prefill(model, prefill_tokens, repeats=max(1, repeats // 2)),
        lambda: measure_matvec(cfg.vocab_size, cfg.hidden_size, dt, dev, repeats=repeats),
        lambda: measure_matmul(4 * prefill_tokens, 2 * cfg.intermediate_size, cfg.hidden_size,
                               dt, dev, repeats=repeats),
        lambda: measure_attention_decode(1, 2048, cfg.num_heads, cfg.num_kv_heads,
                                         cfg.head_dim, dt, dev, model.attn_backend, repeats),
        lambda: measure_attention_decode(16, 512, cfg.num_heads, cfg.num_kv_heads,
                                         cfg.head_dim, dt, dev, model.attn_backend, repeats),
    ]
    for step in _progress(steps, progress, "kernels"):
        ops.append(step())
    return ops


def roofline_fraction(op: OpMeasurement, peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """Achieved FLOP/s over the roofline's attainable FLOP/s at the op's intensity
    (``calc.roofline_flops``). 1.0 means on the roof; small-cache effects can exceed it."""
    return op.flops_per_s / calc.roofline_flops(op.intensity, peak_flops, bandwidth_bytes_per_s)


def format_table(ops: Iterable[OpMeasurement], profile=None) -> str:
    """A plain-text table of measurements; with a ``minillm.perf.MachineProfile``, each row
    also shows the fraction of this machine's roofline reached and what bounds it."""
    ops = list(ops)
    head = f"{'operation':<24}{'ms':>9}{'GFLOP/s':>10}{'GB/s':>8}{'FLOP/B':>8}"
    if profile is not None:
        head += f"{'% roof':>8}  bound"
    lines = [head, "-" * len(head)]
    for op in ops:
        line = (f"{op.name:<24}{op.seconds * 1e3:>9.2f}{op.flops_per_s / 1e9:>10.2f}"
                f"{op.bytes_per_s / 1e9:>8.2f}{op.intensity:>8.3g}")
        if profile is not None:
            peak = _profile_peak(profile, op.dtype)
            bw = profile.bandwidth_bytes_per_s
            bound = "memory" if op.intensity < peak / bw else "compute"
            line += f"{100 * roofline_fraction(op, peak, bw):>7.0f}%  {bound}"
        lines.append(line)
    if profile is not None:
        lines.append(f"roofline: {profile.device_name}, {profile.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
                     f"measured; matmul peak per dtype as measured by minillm.perf")
    return "\n".join(lines)


def _profile_peak(profile, dtype: str) -> float:
    """The profile's measured matmul FLOP/s in ``dtype``, else its fp32 figure."""
    flops = profile.matmul_flops
    value = flops.get(dtype) or flops.get("float32") or max(flops.values())
    if not (value and math.isfinite(value)):
        raise ValueError(f"machine profile has no usable matmul FLOP/s: {flops!r}")
    return value
