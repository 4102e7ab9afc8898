"""A quantized weight matrix and round-to-nearest (RTN), the baseline every method beats.

A weight W [out, in] is cut along its input dimension into groups of `group_size` columns
(`group_size=None`: one group per output channel, i.e. the whole row). Each (row, group)
gets a scale s and an integer zero point z, and each weight an integer q:

    W ≈ Ŵ = (q − z) · s

- symmetric (`sym=True`): z = 0, q ∈ [−(2^(b−1) − 1), 2^(b−1) − 1], s = max|w| / (2^(b−1) − 1).
  Zero maps to exactly zero, one level (−2^(b−1)) is unused.
- asymmetric (`sym=False`): q ∈ [0, 2^b − 1], s = (max − min) / (2^b − 1), z = round(−min / s).
  All 2^b levels cover [min, max], so a skewed group loses less.

Invariant: scales are rounded to fp16 before q is computed, so the matrix saved to disk
(fp16 scales, integer q and z) dequantizes to exactly `QuantizedWeight.dequantize()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_BITS, MAX_BITS = 2, 8


@dataclass
class QuantizedWeight:
    """q [out, in] int16 integers; scale and zero [out, num_groups] fp32 (zero holds
    integers); dequantize() = (q − zero) · scale, broadcast over each group's columns."""
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    sym: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ [out, in] in `dtype`: what the quantized matrix stands for."""
        g = self.group_size
        s = self.scale.repeat_interleave(g, dim=1)
        z = self.zero.repeat_interleave(g, dim=1)
        return ((self.q.float() - z) * s).to(dtype)


def check_bits_and_group(bits, group_size, in_features: int) -> int:
    """Validate (bits, group_size) for a matrix with `in_features` columns; returns the
    group size to use (`None` -> in_features). Clear errors for anything else."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")
    if group_size is None:
        return in_features
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer or None (per output channel), "
                         f"got {group_size!r}")
    if in_features % group_size:
        ok = [g for g in (32, 64, 128, 256) if in_features % g == 0]
        raise ValueError(f"group_size {group_size} does not divide the input dimension "
                         f"{in_features}; groups must tile each row exactly. Sizes that do: "
                         f"{ok or 'none of 32/64/128/256'}, or None for per-channel")
    return group_size


def qrange(bits: int, sym: bool) -> tuple[int, int]:
    """The integer range of q."""
    return (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if sym else (0, 2 ** bits - 1)


def group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero), each [..., 1], for the rows of `w` [..., n] taken as one group each.

    The range always includes 0 (so a group of positive weights still maps 0 exactly, as in
    GPTQ's reference quantizer); an all-zero group gets scale 1 so nothing divides by 0.
    Scales are rounded to fp16 (see the module's invariant)."""
    w = w.float()
    if sym:
        qmax = 2 ** (bits - 1) - 1
        scale = w.abs().amax(dim=-1, keepdim=True) / qmax
        zero = torch.zeros_like(scale)
    else:
        lo = w.amin(dim=-1, keepdim=True).clamp(max=0)
        hi = w.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / (2 ** bits - 1)
    scale = scale.half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not sym:
        zero = torch.round(-lo / scale).clamp(0, 2 ** bits - 1)
    return scale, zero


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  sym: bool) -> torch.Tensor:
    """q = clamp(round(w / s) + z) for given group parameters (broadcast against w)."""
    lo, hi = qrange(bits, sym)
    return torch.clamp(torch.round(w.float() / scale) + zero, lo, hi)


def check_matrix(w) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        got = (f"a {w.dim()}-d {w.dtype} tensor" if isinstance(w, torch.Tensor)
               else type(w).__name__)
        raise ValueError(f"w must be a 2-d float tensor [out_features, in_features], got {got}")
    if not torch.isfinite(w).all():
        raise ValueError("w holds NaN or inf; quantization needs finite weights")
    return w


def rtn(w: torch.Tensor, bits: int = 4, group_size: int | None = 64,
        sym: bool = False) -> QuantizedWeight:
    """Round-to-nearest: each group's own range, each weight rounded independently.

    >>> qw = rtn(torch.tensor([[0.12, -0.83, 0.45, -0.21]]), bits=4, group_size=None, sym=True)
    >>> qw.q.tolist(), round(qw.scale.item(), 4)
    ([[1, -7, 4, -2]], 0.1186)
    """
    w = check_matrix(w)
    out_features, in_features = w.shape
    g = check_bits_and_group(bits, group_size, in_features)
    groups = w.detach().float().reshape(out_features, in_features // g, g)
    scale, zero = group_params(groups, bits, sym)
    q = quantize_with(groups, scale, zero, bits, sym)
    return QuantizedWeight(q=q.reshape(out_features, in_features).to(torch.int16),
                           scale=scale.squeeze(-1), zero=zero.squeeze(-1),
                           bits=bits, group_size=g, sym=sym)
