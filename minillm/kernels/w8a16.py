"""W8A16: a matmul whose weight is stored in 8 bits and dequantized tile by tile, in Triton.

``w8a16_linear(x, qweight, scales, zeros, group_size)`` computes ``y = x @ Ŵᵀ`` for
activations x ``[..., K]`` (fp16 / bf16 / fp32) and a weight Ŵ ``[N, K]`` that only exists
in the 8-bit layout of ``minillm.quant.packing``.

Why: without it an 8-bit ``QuantLinear`` on CUDA dequantized its whole matrix with PyTorch
ops on every call (``reference_forward``): it read the uint8 matrix, wrote and read fp32
temporaries and a float copy, over ten times the bytes of the bf16 weight, so the 8-bit
model was slower than bf16. Here each weight byte is read once per tile of x rows and
becomes a float in registers; a decode step then reads about half of bf16's bytes.

Layout (``packing.py``; W ``[N = out_features, K = in_features]``, groups of g columns,
G = K / g): ``qweight`` uint8 ``[N, K]``, one value per byte, row n = output feature n;
``scales``, ``zeros`` fp32 ``[N, G]`` (per-channel: g = K, G = 1);
``Ŵ[n, k] = (u[n, k] − zeros[n, k // g]) · scales[n, k // g]``. Symmetric 8-bit weights
store their zeros too (2^(bits − 1)), so there is one formula and zeros are never None.

The kernel: program (pid_n, pid_m) computes the ``[BLOCK_M, BLOCK_N]`` tile of y. Each K
step loads x ``[BLOCK_M, BLOCK_K]`` and the uint8 tile ``[BLOCK_K, BLOCK_N]`` (the weight's
rows are its columns), dequantizes it in fp32, casts it to x's dtype and multiplies with
``_dot.dot`` into an fp32 accumulator; the tile is stored in x's dtype at the end.

Invariants:

* ``BLOCK_K`` is the largest power of two up to 64 that divides g, and at least 16 (tl.dot's
  smallest dim). A step then lies inside one group: its scales and zeros are one
  ``[BLOCK_N]`` vector each, loaded once per step, not per element. K is a multiple of g,
  so of BLOCK_K: there is no K edge to mask. fp32 x on a GPU steps 16 columns at a time:
  its true-fp32 dot runs on FMAs, not tensor cores, and holds both K-wide operands in
  registers (at 32 and 64 the sm_90 build spills). The interpreter has no registers and
  keeps the wide steps (4x fewer, so the CPU tests stay fast); g = 48 exercises 16 there.
* The dequantized weight is bit for bit ``dequantize_packed(..., dtype=x.dtype)``:
  ``u − z`` is exact in fp32 (integers below 2^8), one rounding for ``· s``, one for the
  cast. A byte becomes a float without an int-to-float conversion (a quarter-rate
  instruction on NVIDIA GPUs): OR-ed with the bits of 2^23 and read as fp32 it is exactly
  ``2^23 + u``, and subtracting ``2^23 + z`` (exact: z is an integer) leaves ``u − z``.
* Accumulation is fp32; fp32 x is multiplied in true fp32 (``_dot.dot``: no TF32), so the
  only difference from ``F.linear(x, dequantize_packed(...))`` is the order of the sums.
* M and N edges are masked: masked x rows read 0, masked weight rows read u = z = s = 0,
  and neither is stored.
* The host wrapper checks shapes and dtypes only, sizes the grid in plain Python and reads
  no value of a CUDA tensor: nothing synchronizes and a CUDA graph can capture the call.
* A group size with no power-of-two divisor of at least 16 (g = 24, say) is computed by the
  plain path ``F.linear(x, dequantize_packed(...))``: correct, slow, and not met at the
  project's models' shapes (groups of 32 … 576, or per-channel over K a multiple of 64).

Tiles (``_tiles``): chosen from the shapes, not yet measured on a GPU (no autotuning).
BLOCK_M 16 up to 16 rows (decode, a small batch: memory-bound; 16 is tl.dot's minimum and
the rows past M are masked), 32 up to 64 rows, 64 above. BLOCK_N 64, so that a decode
product still has several programs (576 outputs: 9), and 128 only from 65 rows and N >=
8192, where a tile is compute-bound and there are enough of them to fill the SMs.
Warps: 4 for the 16-row tiles, 8 above. No tile spills registers on sm_80 / sm_90 in
bf16 or fp32 (``tests/test_w8a16.py`` compiles them). There is no split-K (the W4A16
GEMV's answer to few programs at one row) and no dequantize-then-cuBLAS path for long
prefills: both are for a GPU measurement to ask for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._checks import check_packed_linear
from ._dot import dot
from ._grid import cdiv
from .interpreter import interpreter_enabled

__all__ = ["w8a16_linear"]

MAX_BLOCK_K = 64          # the largest K step (a power of two dividing the group size)
MIN_BLOCK_K = 16          # tl.dot's smallest dim; groups with no such divisor: the plain path
FP32_MAX_BLOCK_K = 16     # fp32 x on a GPU: its FMA dot holds both K-wide operands in registers
SMALL_M = 16              # up to here BLOCK_M = 16 (one tl.dot-sized tile of rows)
WIDE_N = 8192             # from here (and M > 64) BLOCK_N = 128


# M changes with every engine step's row count: not specialized on, so a serving run
# compiles nothing new when its batch changes (``tests/test_kernels.py``).
@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    X, QW, Scales, Zeros, Out,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_n = offs_n.to(tl.int64)  # N * K may pass 2^31 bytes (a large vocabulary)
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # the weight tile [BLOCK_K, BLOCK_N]: column n of the tile is row n of qweight
    w_ptrs = QW + offs_k[:, None] * stride_qk + rows_n[None, :] * stride_qn
    s_ptrs = Scales + rows_n * stride_sn
    z_ptrs = Zeros + rows_n * stride_zn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // group_size  # the step's group: BLOCK_K divides group_size
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        u = tl.load(w_ptrs, mask=n_mask[None, :], other=0)
        s = tl.load(s_ptrs + g * stride_sg, mask=n_mask, other=0.0)
        z = tl.load(z_ptrs + g * stride_zg, mask=n_mask, other=0.0)
        # 0x4B000000: the bits of 2^23 in fp32. 2^23 + u exactly (see the module), then
        # u − z exactly (8388608.0 = 2^23), then one rounding for · s, as the reference
        f = (u.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        w = (f - (z + 8388608.0)[None, :]) * s[None, :]
        acc = dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_qk

    out_ptrs = Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------- host side


def _block_k(group_size: int, dtype: torch.dtype) -> int | None:
    """The K step: the largest power of two that divides the group size, at most
    MAX_BLOCK_K (FP32_MAX_BLOCK_K for fp32 x on a GPU), or None when it would be below
    MIN_BLOCK_K (the plain path then computes the product)."""
    bk = FP32_MAX_BLOCK_K if dtype == torch.float32 and not interpreter_enabled() else MAX_BLOCK_K
    while bk >= MIN_BLOCK_K:
        if group_size % bk == 0:
            return bk
        bk //= 2
    return None


def _tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows and N outputs (module docstring).
    Warps: 4 for the 16-row tiles, 8 for the larger ones (32 x 64 at 4 warps spills a
    register on sm_90 in bf16). The stages let the next steps' x and weight tiles arrive
    while this one is dequantized."""
    if m <= SMALL_M:
        return 16, 64, 4, 4
    if m <= 64:
        return 32, 64, 8, 3
    return 64, (128 if n >= WIDE_N else 64), 8, 3


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ Ŵᵀ`` with Ŵ ``[N, K]`` given in the 8-bit layout (see the module docstring).

    x ``[..., K]`` fp16 / bf16 / fp32 (CUDA; fp16 / fp32 on the interpreter); qweight uint8
    ``[N, K]``; scales and zeros fp32 ``[N, K / group_size]``; ``group_size`` divides K.
    Returns ``[..., N]`` in x's dtype. Any strides are accepted.
    """
    n, k, _ = check_packed_linear(x, qweight, scales, zeros, group_size, 8,
                                  zeros_optional=False)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    block_k = _block_k(group_size, x.dtype)
    if block_k is None:  # no K step fits inside a group
        return _plain(x2, qweight, scales, zeros).reshape(*lead, n)
    block_m, block_n, warps, stages = _tiles(m, n)
    _w8a16_kernel[(cdiv(n, block_n), cdiv(m, block_m))](
        x2, qweight, scales, zeros, out, m, n, k, group_size,
        *x2.stride(), *qweight.stride(), *scales.stride(), *zeros.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages)
    return out.reshape(*lead, n)


def _plain(x2, qweight, scales, zeros):
    """The plain path for group sizes the kernel does not take: dequantize, then F.linear."""
    from ..quant.packing import dequantize_packed

    return F.linear(x2, dequantize_packed(qweight, scales, zeros, 8, x2.dtype))
