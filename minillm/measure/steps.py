"""Measure the whole model: one decode step at each batch size, one prefill, and everything
the Lab 01 roofline plots (``measure_operations``).

A decode step reads every matrix weight once and the whole KV cache of every sequence,
``context_len + 1`` positions; see ``minillm.measure`` for how FLOPs and bytes are counted.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import calc
from ..attention import ContiguousCacheContext
from ..config import ModelConfig
from ..kv_cache import KVCache
from ..timing import time_fn
from ._common import _check_int, _name
from .operators import measure_attention_decode, measure_matmul, measure_matvec
from .results import OpMeasurement


#: Batch sizes of the Lab 01 decode sweep: batch 1 (matrix-vector) up to 64 (compute-bound
#: on a laptop CPU).
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


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


@torch.inference_mode()
def measure_weight_stream(model, repeats: int = 5, warmup: int = 1, seed: int = 0) -> OpMeasurement:
    """Time the weight products of one batch-1 decode step and nothing else: every
    ``Linear`` of ``model`` (121 for SmolLM2: four per layer, then the LM head) called in
    model order on one row, as a decode step calls it (the same kernel choice, the same
    layout). Its achieved bytes/s is the bandwidth a decode step's products really get.

    Why not one big matrix (``perf.measure_matvec_bandwidth``)? Most of a step's matrices are
    1-4 MB: each call pays its threads' start and the prefetchers' ramp on a short stream,
    so on a machine with fast memory they stream slower than one model-sized matrix, and a
    bytes floor computed from the big matrix is too low.

    FLOPs = 2 per weight; bytes = the weights (the rows in and out are a few KB).
    """
    from ..layers import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears:
        raise ValueError("measure_weight_stream needs a model whose weight products are "
                         "minillm.layers.Linear modules (LlamaModel's are); found none")
    dev, dtype = model.device, model.dtype
    g = torch.Generator().manual_seed(seed)
    rows = {id(m): torch.randn(1, 1, m.in_features, generator=g).to(dev, dtype) for m in linears}

    def step() -> None:
        for m in linears:
            m(rows[id(m)])

    seconds = time_fn(step, warmup=warmup, repeats=repeats, device=dev)
    params = sum(m.in_features * m.out_features for m in linears)
    db = torch.empty((), dtype=dtype).element_size()
    return OpMeasurement(name=f"{len(linears)} weight products, 1 row", kind="matvec", batch=1,
                         flops=2.0 * params, bytes_moved=float(params * db), seconds=seconds,
                         dtype=_name(dtype), device=str(dev),
                         details={"num_products": len(linears), "num_params": params})


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
