"""An int8 KV cache: one symmetric scale per cached vector (token × KV head).

K and V are written once and read at every later decode step, so their bytes are paid at
every step (Lab 02, Lab 03). Storing them in int8 with an fp16 scale per head_dim vector
takes ``head_dim + 2`` bytes per vector instead of ``2 · head_dim`` (fp16) or
``4 · head_dim`` (fp32): about 2× less than fp16 (``calc.kv_cache_int8_bytes``).

    q, scale = quantize_kv_int8(k)          # int8 [..., D], fp16 [..., 1]
    k_hat = dequantize_kv_int8(q, scale)    # back to fp32
    minillm.generate(model, ids, n, append_fn=int8_kv_append)   # greedy with an int8-valued cache

Invariants: the scale is absmax ÷ 127 rounded to fp16, and q is computed against that
stored scale, so ``dequantize(quantize(x))`` is exactly what an int8 cache would return; a
vector of zeros gets scale 0 and dequantizes to zeros; |x − x̂| ≤ scale ÷ 2 per element (plus
fp16 rounding of the scale). ``int8_kv_append`` keeps minillm's fp32 buffers but writes the
round-tripped values, which measures the accuracy of an int8 cache without a new kernel; the
memory saving is the formula's.
"""

from __future__ import annotations

import torch

__all__ = ["quantize_kv_int8", "dequantize_kv_int8", "int8_kv_roundtrip", "int8_kv_append"]

QMAX = 127


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., D], scale fp16 [..., 1]): symmetric, one scale per last-dim vector."""
    if not x.is_floating_point():
        raise ValueError(f"quantize_kv_int8 takes a float tensor (K or V), got {x.dtype}")
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / QMAX).to(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, torch.round(x32 / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(x32))
    return q.clamp(-QMAX, QMAX).to(torch.int8), scale


def dequantize_kv_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q · scale in ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


def int8_kv_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What an int8 cache returns for x: quantize, then dequantize to x's dtype."""
    return dequantize_kv_int8(*quantize_kv_int8(x), dtype=x.dtype)


def int8_kv_append(k_cache, v_cache, k_new, v_new, start_pos) -> None:
    """A drop-in ``append_fn`` for ``minillm.generate``: writes int8-round-tripped K and V
    ([B, T, Hkv, D]) at positions start_pos.. of the fp32 cache buffers, in place."""
    t = k_new.shape[1]
    k_cache[:, start_pos:start_pos + t] = int8_kv_roundtrip(k_new)
    v_cache[:, start_pos:start_pos + t] = int8_kv_roundtrip(v_new)
