"""Tensor-parallel layers: each rank holds a shard of a weight and the communication that
puts the pieces back together.

    ColumnParallelLinear   W split by output rows (whole heads of qkv, FFN columns of
                           gate|up): y_r = x W_rᵀ, no communication, output stays sharded.
    RowParallelLinear      W split by input columns (o_proj, down_proj): y = Σ_r x_r W_rᵀ,
                           one all-reduce of the [tokens, hidden] output.
    VocabParallelEmbedding rows [start, end) of the table: look up the ids that fall in
                           them, zeros elsewhere, one all-reduce.
    ParallelLMHead         the same rows as logits columns: each rank computes its slice,
                           one gather to rank 0, which returns the [.., vocab] logits; the
                           other ranks return None. Tied: it shares the embedding's shard
                           Parameter (one tensor).

The linears subclass `minillm.layers.Linear` and call its forward, so a few rows on a CPU
go through the C++ small-M kernel exactly as in one process. With world size 1 every
collective is skipped and these layers equal the plain ones.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import calc
from ..layers import Linear
from . import comm


def _as_param(weight: torch.Tensor) -> nn.Parameter:
    """A fresh contiguous copy, so the full tensor it was sliced from can be freed."""
    return nn.Parameter(weight.detach().contiguous().clone(), requires_grad=False)


class ColumnParallelLinear(Linear):
    """Rows `rows` (indices into the full [out, in] weight) of a Linear; sharded output."""

    def __init__(self, full: Linear, rows: torch.Tensor, tp_rank: int, tp_size: int):
        shard = _as_param(full.weight[rows])
        super().__init__(full.in_features, shard.shape[0], shard)
        self.full_out_features, self.tp_rank, self.tp_size = full.out_features, tp_rank, tp_size

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()} (of {self.full_out_features}), "
                f"rank {self.tp_rank}/{self.tp_size}")


class RowParallelLinear(Linear):
    """Columns `cols` of a Linear's weight: partial products summed by one all-reduce."""

    def __init__(self, full: Linear, cols: torch.Tensor, tp_rank: int, tp_size: int):
        shard = _as_param(full.weight[:, cols])
        super().__init__(shard.shape[1], full.out_features, shard)
        self.full_in_features, self.tp_rank, self.tp_size = full.in_features, tp_rank, tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return comm.all_reduce(y) if self.tp_size > 1 else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.full_in_features}), "
                f"out_features={self.out_features}, rank {self.tp_rank}/{self.tp_size}")


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of an embedding table."""

    def __init__(self, full_weight: torch.Tensor, vocab_start: int, vocab_end: int,
                 tp_rank: int, tp_size: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = full_weight.shape
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = _as_param(full_weight[vocab_start:vocab_end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)
        x = F.embedding(local, self.weight).masked_fill(~mine[..., None], 0.0)
        return comm.all_reduce(x)  # exactly one rank contributes each row: the sum is exact

    def extra_repr(self) -> str:
        return (f"rows {self.vocab_start}..{self.vocab_end} of {self.num_embeddings}, "
                f"dim {self.embedding_dim}, rank {self.tp_rank}/{self.tp_size}")


class ParallelLMHead(Linear):
    """Logits columns [vocab_start, vocab_end); gathered to rank 0 (None elsewhere)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, vocab_start: int,
                 tp_rank: int, tp_size: int):
        super().__init__(weight.shape[1], weight.shape[0], weight)  # shares, never copies
        self.vocab_size, self.vocab_start = vocab_size, vocab_start
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.padded_shard = math.ceil(vocab_size / tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = super().forward(x)
        if self.tp_size == 1:
            return logits
        # gather moves equal pieces: pad every shard to ceil(V / tp) columns.
        logits = F.pad(logits, (0, self.padded_shard - logits.shape[-1])).contiguous()
        parts = comm.gather_to_first(logits)
        if parts is None:
            return None
        sizes = [end - start for start, end in shard_ranges(self.vocab_size, self.tp_size)]
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def extra_repr(self) -> str:
        return (f"vocab rows {self.vocab_start}..{self.vocab_start + self.out_features} of "
                f"{self.vocab_size}, rank {self.tp_rank}/{self.tp_size}")


def shard_ranges(n: int, tp_size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's share of `n` rows (`calc.tp_shard_size`: the first
    `n % tp_size` ranks get one row more, as `torch.tensor_split` splits)."""
    bounds = [0]
    for r in range(tp_size):
        bounds.append(bounds[-1] + calc.tp_shard_size(n, tp_size, r))
    return list(zip(bounds[:-1], bounds[1:]))
