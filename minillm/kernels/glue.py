"""The glue between a layer's weight products on a GPU, in Triton: one kernel per group.

Why: a decode step on a GPU is launch-bound. Replayed as a CUDA graph, SmolLM2's batch-1
step ran 675 kernels at ~2.2 µs each (1.5 ms) while its weights take 0.09 ms to read. Plain
PyTorch runs the glue as ~18 kernels per layer (an RMSNorm in bf16 alone is ~7: cast, pow,
mean, add, rsqrt, mul, cast, mul; RoPE is roll, mul, addcmul, cast; the K and V cache
writes are two more). These kernels do each group in one launch, so a decode layer runs

    add_rms_norm -> qkv (cuBLAS) -> rope_kv -> attention -> o_proj (cuBLAS)
    -> add_rms_norm -> gate_up (cuBLAS) -> silu_mul -> down (cuBLAS)

nine kernels (the first add_rms_norm adds the previous layer's MLP output to the residual
stream: `DecoderLayer.forward_open`). For a few rows (a decode step) the two norms and
silu_mul go further, into the products that read them, and rope_kv into q|k|v's product,
after it (`decode_gemv.py`, which takes o_proj too): five kernels. RoPE's arithmetic and its K/V store are @jit
helpers here (`rope_pair`, `store_kv`), used by both kernels: one definition of the rounding.
The kernels:

    rms_norm(x, w, eps)                  RMSNorm of each row
    add_rms_norm(x, delta, w, eps)       (x + delta, RMSNorm(x + delta)): the residual add too
    rope_kv(heads, num_q, num_kv, cos, sin, kv=None)
                                         RoPE in place on the q and k heads of q|k|v's output
                                         and, with kv = (k_cache, v_cache, slot_mapping), the
                                         rotated k and the v of token i stored into row
                                         slot_mapping[i] of the caches viewed [slots, Hkv, D]
    silu_mul(gate_up)                    silu(gate) * up

The math is the plain PyTorch of `minillm.layers.fused` (the reference, which `fused`
dispatches to these on CUDA): fp32 arithmetic, rounded to the model dtype exactly where the
plain expressions round (the sum x + delta; the normalized row before the weight in 16-bit
dtypes; silu(gate) before the product with up; RoPE at the end, and x * cos too where the
tables are in the model dtype rather than fp32). So
the results agree with the plain ops to a unit in the last place of the dtype (the order of
the mean's sum, and exp / rsqrt, may differ by fp32 ulps).

Invariants:
- One program per row (per token); a row's result does not depend on the other rows
  (batch invariance: padded CUDA-graph batches give a sequence the bits of an eager step).
- Every load and store is masked at the row, head and column edges; BLOCK is the next power
  of two of the row width (one fixed launch config per width, no tuning); offsets are int64.
- RoPE's in-place update has no cross-thread hazard: each thread loads the pair
  (x[d], x[d + D/2]) it rotates and stores the same two elements.
- Writes to a cache touch only rows slot_mapping[i]; the paged cache's trash slot (the row
  past the last block) is a valid row, so padded batch rows need no mask.
- No host sync, and nothing allocated but the outputs: safe inside CUDA-graph capture.
On a CPU the kernels run in Triton's interpreter (tests: `tests/test_glue_kernels.py`); the
model's CPU path never calls them (`minillm.layers.fused` runs its C++ there).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import require_working_setup
from ._grid import cdiv, next_power_of_2

__all__ = ["rms_norm", "add_rms_norm", "rope_kv", "silu_mul", "DTYPES"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SILU_BLOCK = 1024  # columns per silu_mul program (a second grid axis covers wider rows)


def _warps(block: int) -> int:
    """Warps for a tile of `block` elements: ~8 elements per thread, 1 to 8 warps."""
    return max(1, min(8, block // 256))


@triton.jit
def add_rounded(x, d, dtype: tl.constexpr):
    """x + delta in fp32, rounded to the model dtype once, as `x + delta` is."""
    return (x.to(tl.float32) + d.to(tl.float32)).to(dtype)


@triton.jit
def normed_times_weight(xf, inv, w, dtype: tl.constexpr):
    """RMSNorm's output from fp32 x, 1 / rms and the weight: in fp32 (x * inv) * w; in a 16-bit
    dtype the normalized row is rounded before the weight multiplies, then the product."""
    n = (xf * inv).to(dtype).to(tl.float32)
    return (n * w.to(tl.float32)).to(dtype)


@triton.jit
def silu_times_up(g, u, dtype: tl.constexpr):
    """silu(gate) * up from fp32 gate and up: F.silu rounds to the dtype, then `* up` again."""
    sg = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (sg * u).to(dtype)


@triton.jit
def _rms_norm_kernel(X, Delta, W, Out, Sum, width, eps,
                     stride_x, stride_d, stride_o, stride_s,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the model dtype as `x + delta` is
        d = tl.load(Delta + row * stride_d + offs, mask=mask, other=0.0)
        x = add_rounded(x, d, Sum.dtype.element_ty)
        tl.store(Sum + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / width + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + offs, normed_times_weight(xf, inv, w, Out.dtype.element_ty),
             mask=mask)


@triton.jit
def rope_tables(Cos, Sin, cos_row, sin_row, d, half, mask):
    """The tables at pair d of a token's row: cos[d], cos[d + D/2], sin[d], sin[d + D/2] in
    fp32 (cos_row, sin_row: the row's offsets)."""
    c1 = tl.load(Cos + cos_row + d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + cos_row + half + d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + sin_row + d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + sin_row + half + d, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def rope_pair(x1, x2, c1, c2, s1, s2, ROUND_PRODUCT: tl.constexpr):
    """RoPE of the pairs (x1, x2) = (x[d], x[d + D/2]) (values of the heads' dtype) -> (y1, y2)
    of that dtype: addcmul(x * cos, roll(x, D/2), sin) with sin = [-sin, sin] folded in the
    table (`model.apply_rope`), in fp32, rounded once. Tables in the heads' dtype (a model
    cast whole by .to(dtype)) make x * cos a product of that dtype, rounded before the sum
    (ROUND_PRODUCT). The sum is one explicit FMA: every kernel that rotates with this helper
    (`_rope_kv_kernel`, the decode GEMV's epilogue) rounds the same way, not as the
    compiler's contraction of a * b + c happens to choose in each."""
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    p1, p2 = x1f * c1, x2f * c2
    if ROUND_PRODUCT:
        p1 = p1.to(dtype).to(tl.float32)
        p2 = p2.to(dtype).to(tl.float32)
    return tl.fma(x2f, s1, p1).to(dtype), tl.fma(x1f, s2, p2).to(dtype)


@triton.jit
def store_kv(KC, VC, slot, h, d, half, num_q, num_rot, in_row, k1, k2, v1, v2,
             stride_ks, stride_kh, stride_vs, stride_vh):
    """A token's K/V into row `slot` of the caches (in their dtype): its pairs (k1, k2) where
    head h is a k head (num_q <= h < num_rot: the rotated values), (v1, v2) where it is a v
    head (h >= num_rot); in_row masks the pairs that exist."""
    is_k = in_row & (h >= num_q) & (h < num_rot)
    k_ptr = KC + slot * stride_ks + tl.where(is_k, h - num_q, 0).to(tl.int64) * stride_kh + d
    tl.store(k_ptr, k1.to(KC.dtype.element_ty), mask=is_k)
    tl.store(k_ptr + half, k2.to(KC.dtype.element_ty), mask=is_k)
    is_v = in_row & (h >= num_rot)
    v_ptr = VC + slot * stride_vs + tl.where(is_v, h - num_rot, 0).to(tl.int64) * stride_vh + d
    tl.store(v_ptr, v1.to(VC.dtype.element_ty), mask=is_v)
    tl.store(v_ptr + half, v2.to(VC.dtype.element_ty), mask=is_v)


@triton.jit
def _rope_kv_kernel(Heads, num_heads, stride_hr, stride_hh,
                    Cos, Sin, KC, VC, Slots, num_q, num_rot, half,
                    stride_cr, stride_sr, stride_ks, stride_kh, stride_vs, stride_vh,
                    WRITE_KV: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < half
    in_row = (h < num_heads) & d_ok
    rotated = (h < num_rot) & d_ok  # q and k heads
    x_ptr = Heads + row * stride_hr + h.to(tl.int64) * stride_hh + d
    x1 = tl.load(x_ptr, mask=in_row, other=0.0)
    x2 = tl.load(x_ptr + half, mask=in_row, other=0.0)
    c1, c2, s1, s2 = rope_tables(Cos, Sin, row * stride_cr, row * stride_sr, d, half, d_ok)
    y1, y2 = rope_pair(x1, x2, c1, c2, s1, s2, ROUND_PRODUCT)
    tl.store(x_ptr, y1, mask=rotated)
    tl.store(x_ptr + half, y2, mask=rotated)
    if WRITE_KV:
        slot = tl.load(Slots + row).to(tl.int64)
        store_kv(KC, VC, slot, h, d, half, num_q, num_rot, in_row, y1, y2, x1, x2,
                 stride_ks, stride_kh, stride_vs, stride_vh)


@triton.jit
def _silu_mul_kernel(GateUp, Out, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, silu_times_up(g, u, Out.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., width] as a [rows, width] view with unit column stride (no copy)."""
    require_working_setup()
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}: pass x.contiguous()")
    return x.reshape(-1, x.shape[-1])


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{x.shape[-1]}] {x.dtype} on {x.device} like x, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous: pass weight.contiguous()")


def _norm(x, delta, weight, eps):
    x2 = _rows(x, "x")
    _check_weight(weight, x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else out
    d2 = x2 if delta is None else _rows(delta, "delta")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta must match x: {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(delta.shape)} {delta.dtype}")
    rows, width = x2.shape
    if rows:
        block = next_power_of_2(width)
        _rms_norm_kernel[(rows,)](x2, d2, weight, out, s, width, float(eps),
                                  x2.stride(0), d2.stride(0), width, width,
                                  HAS_DELTA=delta is not None, BLOCK=block,
                                  num_warps=_warps(block))
    return out, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape), weight [width] of x's dtype."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass."""
    out, s = _norm(x, delta, weight, eps)
    return s, out


def rope_args(rows: int, num_q: int, num_kv: int, dim: int, heads: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, kv) -> tuple[tuple, dict]:
    """Check RoPE's tables and K/V target for `rows` tokens of q|k|v heads [rows, num_q +
    2 num_kv, dim] of heads' dtype and device; return the kernel arguments `Cos, Sin, KC, VC,
    Slots, num_q, num_rot, half, stride_cr, stride_sr, stride_ks, stride_kh, stride_vs,
    stride_vh` (as `_rope_kv_kernel` and the decode GEMV's epilogue take them) and the
    constexprs WRITE_KV, ROUND_PRODUCT."""
    if dim <= 0 or dim % 2 or num_q < 0 or num_kv < 0:
        raise ValueError(f"RoPE needs an even head_dim (it rotates pairs (d, d + D/2)) and "
                         f"num_q, num_kv >= 0, got head_dim {dim}, num_q {num_q}, "
                         f"num_kv {num_kv}")
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.shape != (rows, dim) or t.dtype not in (torch.float32, heads.dtype)
                or t.dtype != cos.dtype or t.stride(-1) != 1 or t.device != heads.device):
            raise ValueError(f"{name} must be [{rows}, {dim}] float32 (or heads' {heads.dtype}, "
                             f"both alike) on {heads.device} with a contiguous last dimension, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    if kv is None:
        kc = vc = slots = heads
        kstr = vstr = (0, 0)
    else:
        kc, vc, slots = kv
        for name, c in (("k_cache", kc), ("v_cache", vc)):
            if (c.dim() != 3 or c.shape[1:] != (num_kv, dim) or c.stride(-1) != 1
                    or c.device != heads.device):
                raise ValueError(f"{name} must be [num_slots, {num_kv}, {dim}] (viewed flat) "
                                 f"on {heads.device} with a contiguous last dimension, got "
                                 f"{tuple(c.shape)} on {c.device}")
        if (slots.shape != (rows,) or slots.dtype.is_floating_point or slots.dtype == torch.bool
                or slots.device != heads.device):
            raise ValueError(f"slot_mapping must be an integer [{rows}] on {heads.device}, got "
                             f"{tuple(slots.shape)} {slots.dtype} on {slots.device}")
        kstr, vstr = (kc.stride(0), kc.stride(1)), (vc.stride(0), vc.stride(1))
    args = (cos, sin, kc, vc, slots, num_q, num_q + num_kv, dim // 2,
            cos.stride(0), sin.stride(0), *kstr, *vstr)
    return args, dict(WRITE_KV=kv is not None, ROUND_PRODUCT=cos.dtype != torch.float32)


def rope_kv(heads: torch.Tensor, num_q: int, num_kv: int, cos: torch.Tensor, sin: torch.Tensor,
            kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """RoPE in place on the first num_q + num_kv heads of heads [N, num_q + 2 num_kv, D]
    (q|k|v of N tokens); cos / sin [N, D] (`model.rope_cos_sin` rows at each token's
    position), fp32 or heads' dtype. With kv = (k_cache, v_cache, slot_mapping): caches
    [num_slots, num_kv, D], slot_mapping [N] integer; token i's rotated k and its v go to
    row slot_mapping[i] (in the caches' dtype, after rounding to heads' dtype as the plain
    path does). Returns heads.
    """
    if heads.dim() != 3 or heads.shape[1] != num_q + 2 * num_kv or heads.shape[2] % 2:
        raise ValueError(f"heads must be [N, num_q + 2 * num_kv = {num_q + 2 * num_kv}, D] with "
                         f"D even, got {tuple(heads.shape)}")
    _rows(heads, "heads")
    n, num_heads, dim = heads.shape
    args, consts = rope_args(n, num_q, num_kv, dim, heads, cos, sin, kv)
    if n:
        bh, bd = next_power_of_2(num_heads), next_power_of_2(dim // 2)
        _rope_kv_kernel[(n,)](heads, num_heads, heads.stride(0), heads.stride(1), *args,
                              **consts, BLOCK_H=bh, BLOCK_HALF=bd, num_warps=_warps(bh * bd))
    return heads


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] = [..., gate | up] -> [..., I]."""
    x2 = _rows(gate_up, "gate_up")
    if x2.shape[1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate | up), got {x2.shape[1]}")
    inter = x2.shape[1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0]:
        block = min(SILU_BLOCK, next_power_of_2(inter))
        _silu_mul_kernel[(x2.shape[0], cdiv(inter, block))](
            x2, out, inter, x2.stride(0), inter, BLOCK=block, num_warps=_warps(block))
    return out
