"""Lab 03's FlashAttention scaffold: a whole Triton kernel except its inner loop.

The student writes the loop over key/value tiles as a ``@triton.jit`` function with the
signature below and passes it in; ``flash_attention_lab`` launches the kernel with it::

    @triton.jit
    def attn_inner_loop(acc, m_i, l_i, q, k_base, v_base, offs_m, offs_d, hi, seq_len,
                        sm_scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
        ...                      # fold key tiles [0, hi) into the running state
        return acc, m_i, l_i

    out = flash_attention_lab(q, k, v, attn_inner_loop, causal=True)

What the scaffold does around the loop (one program = ``BLOCK_M`` query rows of one
(batch, head)): load the query tile ``q`` ``[BLOCK_M, HEAD_DIM]`` (rows ``offs_m``; rows at
or past ``seq_len`` are zeros), start the state at ``m_i = -inf``, ``l_i = 0``, ``acc = 0``
(fp32), compute the loop bound ``hi`` (causal: ``min(start_m + BLOCK_M, seq_len)``, the
first key no row of the tile can see; otherwise ``seq_len``), call the loop, then store
``acc / l_i``. ``k_base`` / ``v_base`` point at row 0 of this (batch, head)'s K and V, stored
row after row: key ``j`` is ``k_base + j * HEAD_DIM + offs_d``.

Conventions (a simplified ``flash_attention.py``): q, k, v ``[B, H, T, D]``, the same
number of heads (no GQA) and of queries and keys (T == S, so the causal mask is the plain
lower triangle ``j <= i``), D a power of two in 16..128, natural-log exponents
(``tl.exp``). The loop is passed as a ``tl.constexpr`` argument, so each different loop
function gets its own compiled kernel (or, in the CPU interpreter, just runs).

Tiles are 16 x 16 (the smallest ``tl.dot`` accepts), so in the interpreter tiny inputs
(T <= 48, D = 16 or 32) run in well under a second.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .interpreter import interpreter_enabled, require_working_setup
from ._grid import cdiv

__all__ = ["flash_attention_lab", "LAB_BLOCK_M", "LAB_BLOCK_N", "is_triton_function"]

LAB_BLOCK_M = 16
LAB_BLOCK_N = 16


@triton.jit
def _lab_attn_fwd(Q, K, V, Out, seq_len, sm_scale,
                  INNER_LOOP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = pid_bh.to(tl.int64) * seq_len * HEAD_DIM  # this (batch, head)'s [T, D] slab
    row_ok = offs_m[:, None] < seq_len
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, seq_len)  # keys >= hi are hidden from every row
    else:
        hi = seq_len
    acc, m_i, l_i = INNER_LOOP(acc, m_i, l_i, q, K + base, V + base, offs_m, offs_d, hi,
                               seq_len, sm_scale, CAUSAL, BLOCK_N, HEAD_DIM)

    out = acc / l_i[:, None]
    tl.store(Out + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok)


def is_triton_function(fn) -> bool:
    """True for a function decorated with ``@triton.jit`` (compiled or interpreted)."""
    if isinstance(fn, triton.runtime.JITFunction):
        return True
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # another triton layout
        return hasattr(fn, "fn") and hasattr(fn, "run")
    return isinstance(fn, InterpretedFunction)


def flash_attention_lab(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inner_loop,
                        causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """``softmax(q kᵀ · sm_scale) v`` with the student's ``inner_loop`` inside the kernel.

    q, k, v: ``[B, H, T, D]`` of one shape, fp32 or fp16, D in {16, 32, 64, 128}.
    ``sm_scale`` defaults to ``1 / sqrt(D)``. Returns ``[B, H, T, D]`` in q's dtype.
    On a machine without CUDA the kernel runs in Triton's interpreter (CPU tensors).
    """
    require_working_setup()
    if not is_triton_function(inner_loop):
        raise TypeError(f"inner_loop must be a function decorated with @triton.jit, got "
                        f"{type(inner_loop).__name__}; put @triton.jit on the line above its def")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [B, H, T, D] tensor, got {getattr(t, 'shape', t)!r}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have one shape [B, H, T, D] in this lab kernel "
                         f"(no GQA, T == S); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, d = q.shape
    if d not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128 here (tl.dot needs >= 16 and a "
                         f"power of two); got {d}")
    if q.dtype not in (torch.float32, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must all be float32 or all float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    want = "cpu" if interpreter_enabled() else "cuda"
    if q.device.type != want or k.device != q.device or v.device != q.device:
        raise ValueError(f"{'the Triton CPU interpreter' if want == 'cpu' else 'compiled Triton'} "
                         f"needs all inputs on {want}; got {q.device}, {k.device}, {v.device}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    if b * h * t == 0:
        return out
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    grid = (cdiv(t, LAB_BLOCK_M), b * h)
    _lab_attn_fwd[grid](q, k, v, out, t, scale, INNER_LOOP=inner_loop, CAUSAL=bool(causal),
                        BLOCK_M=LAB_BLOCK_M, BLOCK_N=LAB_BLOCK_N, HEAD_DIM=d)
    return out
