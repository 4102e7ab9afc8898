"""Sharding a model for tensor parallelism: which heads, columns and rows each rank keeps.

`shard_model(model, rank, tp_size)` replaces, in place, every layer's qkv and gate|up by a
`ColumnParallelLinear`, o_proj and down_proj by a `RowParallelLinear`, the embedding by a
`VocabParallelEmbedding` and the LM head by a `ParallelLMHead` sharing the embedding's shard
(tied models: one tensor). Only this rank's slices are kept (copied out, so the full tensors
are freed); the RMSNorm weights and RoPE tables are replicated.

Head rule (`calc.tp_size_problem`, as vLLM and Megatron): the query heads divide by tp_size;
if tp_size <= num_kv_heads the KV heads divide too, otherwise tp_size is a multiple of them
and each KV head is replicated on tp_size / num_kv_heads ranks. Rank r holds query heads
[r·Hq/tp, (r+1)·Hq/tp), and the KV heads those query heads read, so attention needs no
communication. FFN columns and vocabulary rows may split unevenly (first ranks one more).

After sharding, `model.config` describes this rank's share (its head counts and FFN width,
so a KV cache built from it holds only this rank's KV heads); `model.tp` keeps the rank,
the size and the full config.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import calc
from ..config import ModelConfig
from ..layers import Linear
from .layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                     VocabParallelEmbedding, shard_ranges)


@dataclass(frozen=True)
class TPInfo:
    rank: int
    tp_size: int
    full_config: ModelConfig


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """The tensor-parallel sizes this model's heads allow (SmolLM2: [1, 3, 9])."""
    return calc.tp_valid_sizes(config.num_heads, config.num_kv_heads)


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError naming the head counts and the sizes that work if `tp_size` cannot
    shard this model. Cheap: call it before starting any process."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    problem = calc.tp_size_problem(config.num_heads, config.num_kv_heads, tp_size)
    if problem:
        raise ValueError(f"{problem} of {config.name} (num_heads={config.num_heads}, "
                         f"num_kv_heads={config.num_kv_heads}); use one of "
                         f"{valid_tp_sizes(config)}")


def kv_heads_per_rank(config: ModelConfig, tp_size: int) -> int:
    check_tp_size(config, tp_size)
    return calc.tp_kv_heads_per_rank(config.num_heads, config.num_kv_heads, tp_size)


def kv_replicas(config: ModelConfig, tp_size: int) -> int:
    """Ranks holding a copy of each KV head (1 unless tp_size > num_kv_heads)."""
    check_tp_size(config, tp_size)
    return calc.tp_kv_replicas(config.num_heads, config.num_kv_heads, tp_size)


def rank_heads(config: ModelConfig, rank: int, tp_size: int) -> tuple[list[int], list[int]]:
    """(query heads, KV heads) that `rank` holds, as indices into the full model's heads."""
    check_tp_size(config, tp_size)
    hq = config.num_heads // tp_size
    hkv = kv_heads_per_rank(config, tp_size)
    first_kv = rank // kv_replicas(config, tp_size) if tp_size > config.num_kv_heads \
        else rank * hkv
    return list(range(rank * hq, (rank + 1) * hq)), list(range(first_kv, first_kv + hkv))


def _head_rows(heads: list[int], head_dim: int, offset: int = 0) -> list[int]:
    return [offset + h * head_dim + i for h in heads for i in range(head_dim)]


def shard_model(model, rank: int, tp_size: int):
    """Keep only rank `rank`'s shards of `model` (a float `LlamaModel`); returns it."""
    full = model.config
    check_tp_size(full, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must lie in [0, {tp_size}), got {rank}")
    if getattr(model, "tp", None) is not None:
        raise ValueError("this model is already sharded; load a fresh one")
    D = full.head_dim
    q_heads, kv_heads = rank_heads(full, rank, tp_size)
    qkv_rows = torch.tensor(_head_rows(q_heads, D) + _head_rows(kv_heads, D, full.q_size)
                            + _head_rows(kv_heads, D, full.q_size + full.kv_size))
    o_cols = torch.tensor(_head_rows(q_heads, D))
    f0, f1 = shard_ranges(full.intermediate_size, tp_size)[rank]
    gate_up_rows = torch.cat([torch.arange(f0, f1),
                              torch.arange(f0, f1) + full.intermediate_size])
    local = replace(full, num_heads=len(q_heads), num_kv_heads=len(kv_heads),
                    intermediate_size=f1 - f0)
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            _check_plain(linear)
        attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, qkv_rows, rank, tp_size)
        attn.o_proj = RowParallelLinear(attn.o_proj, o_cols, rank, tp_size)
        attn.config = local
        mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, gate_up_rows, rank, tp_size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, torch.arange(f0, f1), rank, tp_size)
        mlp.intermediate_size = f1 - f0
    _check_plain(model.lm_head)
    tied = model.lm_head.weight is model.embed_tokens.weight
    v0, v1 = shard_ranges(full.vocab_size, tp_size)[rank]
    head_weight = model.lm_head.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, v0, v1, rank, tp_size)
    shard = (model.embed_tokens.weight if tied
             else VocabParallelEmbedding(head_weight, v0, v1, rank, tp_size).weight)
    model.lm_head = ParallelLMHead(shard, full.vocab_size, v0, rank, tp_size)
    model.config, model.tp = local, TPInfo(rank, tp_size, full)
    model._compiled_run = None
    if model.device.type == "cpu":
        model.use_matvec_layout()  # the layout this machine reads fastest; keeps the tie
    return model


def _check_plain(linear) -> None:
    if type(linear) is not Linear or not linear.weight.is_floating_point():
        raise ValueError(f"shard_model shards float minillm.layers.Linear layers only, got "
                         f"{type(linear).__name__}; shard the float model, then quantize")


def param_bytes(model) -> int:
    """Bytes of the distinct parameter tensors this process holds (shared ones once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.untyped_storage().data_ptr(), p.data_ptr())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total
