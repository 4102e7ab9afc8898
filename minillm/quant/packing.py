"""How a quantized matrix is stored for execution and on disk: the packed format.

Every quantized linear (CPU kernels, the Triton W4A16 kernel, safetensors files) reads this
one layout, for W [N = out_features, K = in_features] with groups of g columns (G = K / g):

- `qweight` uint8. bits <= 4: [N, K / 2], two values per byte, column 2j in the low nibble
  and column 2j + 1 in the high nibble (K must be even). bits 5..8: [N, K], one per byte.
- `scales` fp32 [N, G]: the group scales (fp16-representable values; saved as fp16).
- `zeros` fp32 [N, G]: the unsigned zero point of each group, an integer value.

    W[n, k] = (u[n, k] − zeros[n, k // g]) · scales[n, k // g]

where u is the stored unsigned value. A symmetric weight (q signed, zero 0) is stored as
u = q + 2^(bits−1) with zeros = 2^(bits−1), so kernels see one formula for both kinds.
3-bit and 2-bit weights use the 4-bit layout (a nibble each): simple, and honest about it
in the byte counts.
"""
from __future__ import annotations

import torch

from .weights import QuantizedWeight


def storage_bits(bits: int) -> int:
    """Bits each stored value takes: 4 (a nibble) up to 4-bit weights, else 8."""
    return 4 if bits <= 4 else 8


def pack(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, zeros) in the packed layout above."""
    offset = 2 ** (qw.bits - 1) if qw.sym else 0
    u = (qw.q.to(torch.int32) + offset).to(torch.uint8)
    zeros = qw.zero.float() + offset
    if storage_bits(qw.bits) == 4:
        if u.shape[1] % 2:
            raise ValueError(f"4-bit packing needs an even number of input features, "
                             f"got {u.shape[1]}")
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    return u.contiguous(), qw.scale.float().contiguous(), zeros.contiguous()


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored unsigned values u [N, K] (uint8) from `qweight`."""
    if storage_bits(bits) == 8:
        return qweight
    lo, hi = qweight & 0x0F, qweight >> 4
    return torch.stack([lo, hi], dim=-1).reshape(qweight.shape[0], -1)


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] from the packed layout: the reference every fast kernel is tested against."""
    u = unpack(qweight, bits).float()
    g = u.shape[1] // scales.shape[1]
    w = (u - zeros.float().repeat_interleave(g, dim=1)) * scales.float().repeat_interleave(g, dim=1)
    return w.to(dtype)


def packed_bytes(out_features: int, in_features: int, bits: int, group_size: int,
                 sym: bool) -> int:
    """Bytes of the matrix as saved: the packed values, an fp16 scale per group, and an
    8-bit zero per group for an asymmetric weight (a symmetric one needs none)."""
    groups = out_features * (in_features // group_size)
    return (out_features * in_features * storage_bits(bits) // 8 + 2 * groups
            + (0 if sym else groups))
