"""W4A16: a matmul whose weight is stored in 4 bits and dequantized on the fly, in Triton.

``w4a16_linear(x, qweight, scales, zeros, group_size)`` computes ``y = x @ Ŵᵀ`` for
activations x ``[..., K]`` in 16 bits (fp16 / bf16; fp32 is accepted too) and a weight Ŵ
``[N, K]`` that only exists in the packed 4-bit format of ``minillm.quant.packing``. The
float weight is never written to memory: each tile is unpacked in registers and fed to
``tl.dot``.

Why: a decode step multiplies one token (or a handful) by every weight matrix, so it does
~2 flops per weight byte read and is memory-bound on any GPU. Its time is the bytes it
reads. 4-bit weights are 1/4 of fp16's bytes (plus a scale and a zero per group), so the
step can be up to ~4x faster; the unpacking costs ALU work the GPU has to spare.
Prefill (many rows) is compute-bound and gains nothing from the smaller weight.

Layout (``packing.py``; W ``[N = out_features, K = in_features]``, groups of g columns,
G = K / g):

* ``qweight`` uint8 ``[N, K / 2]``: column 2j in the low nibble, column 2j + 1 in the high
  nibble, so a row's bytes run along K.
* ``scales``, ``zeros`` fp32 ``[N, G]`` (zeros hold integers): for both symmetric and
  asymmetric weights ``Ŵ[n, k] = (u[n, k] − zeros[n, k // g]) · scales[n, k // g]``.

Tiling: one program computes one ``[BLOCK_M, BLOCK_N]`` tile of y (``BLOCK_M`` rows of x,
``BLOCK_N`` output features) and walks K in steps of ``BLOCK_K``. Per step it loads

* x ``[BLOCK_M, BLOCK_K]`` (masked rows and columns read 0),
* the packed bytes ``[BLOCK_N, BLOCK_K / 2]``, contiguous along K (vector loads), splits
  each byte into its two nibbles and interleaves them back to ``[BLOCK_N, BLOCK_K]``
  (``tl.interleave``: low nibble first, exactly the packing order),
* the scales and zeros of the group(s) the step covers,

then ``w = (u − z) · s`` in fp32, casts w to x's dtype and accumulates
``tl.dot(x, wᵀ)`` in fp32. The output is cast to x's dtype once, at the end.

Invariants:

* ``BLOCK_K`` is chosen from the group size: the largest power of two up to
  ``MAX_BLOCK_K`` that divides g. Then a K step never straddles two groups, and the
  kernel loads one scale and one zero per output feature per step (``GROUP_ALIGNED``). A
  group size with no such divisor >= 16 (e.g. 24) takes the general path: a group index
  per column, with scales and zeros gathered per element (correct for any g, slower).
* Every edge is masked: M and N (any value, odd included), and K when ``BLOCK_K`` does
  not divide it (only possible on the general path). Masked weights read
  u = z = s = 0, so they contribute exactly 0 and never NaN.
* ``tl.dot`` needs every dim >= 16, so ``BLOCK_M >= 16`` even for a 1-row decode (the
  padding rows are masked: tensor-core work is wasted, but the step is memory-bound).
* The dequantized weight is rounded to x's dtype before the product, exactly like the
  plain path ``F.linear(x, dequantize_packed(...).to(x.dtype))``; accumulation is fp32.
  On CUDA an fp32 x makes ``tl.dot`` use TF32 (about 1e-3 relative error); the
  interpreter computes fp32 exactly.
* Offsets are int64 (a row of x or y times its stride can pass 2^31 for long prefills
  against a large vocabulary).

Tiles: on CUDA ``BLOCK_M`` / ``BLOCK_N`` / warps / stages are autotuned, keyed on
(N, K, group size, a coarse bucket of M), with configs pruned to the bucket (16-row tiles
for decode, wider ones for prefill). On the interpreter: one fixed small tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import interpreter_enabled
from ._checks import _check_device_dtype

__all__ = ["w4a16_linear"]

MAX_BLOCK_K = 128      # CUDA: K step for a group size of 128 or more (power of two)
CPU_MAX_BLOCK_K = 32   # interpreter: small, so the tests also cover several steps per group
CPU_BLOCK_M = 16       # interpreter: the smallest tile tl.dot allows ...
CPU_BLOCK_N = 32       # ... and a small one for the outputs
_GENERAL_BLOCK_K = 64  # K step on the general path (no power of two >= 16 divides g)


@triton.jit
def _w4a16_kernel(
    X, QW, Scales, Zeros, Out,
    M, N, K, group_size, m_bucket,
    stride_xm, stride_xk,
    stride_qn, stride_qk,
    stride_sn, stride_sg,
    stride_zn, stride_zg,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr, EVEN_K: tl.constexpr,
):
    # m_bucket is only an autotune key (see _m_bucket); the kernel does not read it.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)           # activation / weight columns of one step
    offs_b = tl.arange(0, BLOCK_K // 2)      # packed byte columns of one step
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)

    x_ptrs = X + rows_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    q_ptrs = QW + rows_n[:, None] * stride_qn + offs_b[None, :] * stride_qk
    s_row = Scales + rows_n * stride_sn
    z_row = Zeros + rows_n * stride_zn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            packed = tl.load(q_ptrs, mask=n_mask[:, None], other=0)
        else:
            k_mask = (k0 + offs_k) < K
            b_mask = (k0 // 2 + offs_b) < K // 2
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            packed = tl.load(q_ptrs, mask=n_mask[:, None] & b_mask[None, :], other=0)
        # [BLOCK_N, BLOCK_K / 2] bytes -> [BLOCK_N, BLOCK_K] nibbles, column 2j = low nibble
        u = tl.interleave(packed & 0x0F, packed >> 4).to(tl.float32)
        if GROUP_ALIGNED:  # the whole step lies in group k0 // group_size
            g = k0 // group_size
            s = tl.load(s_row + g * stride_sg, mask=n_mask, other=0.0)
            z = tl.load(z_row + g * stride_zg, mask=n_mask, other=0.0)
            w = (u - z[:, None]) * s[:, None]
        else:  # any group size: one group index per column
            grp = (k0 + offs_k) // group_size
            sz_mask = n_mask[:, None] & ((k0 + offs_k) < K)[None, :]
            s = tl.load(s_row[:, None] + grp[None, :] * stride_sg, mask=sz_mask, other=0.0)
            z = tl.load(z_row[:, None] + grp[None, :] * stride_zg, mask=sz_mask, other=0.0)
            w = (u - z) * s
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += (BLOCK_K // 2) * stride_qk

    o_ptrs = Out + rows_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _cuda_configs():
    configs = []
    for bm in (16, 32, 64, 128):
        for bn in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    if (bm == 16 and warps == 8) or (bm >= 64 and warps == 2):
                        continue
                    configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn},
                                                 num_warps=warps, num_stages=stages))
    return configs


_BUCKET_BLOCK_M = {0: (16,), 1: (32, 64), 2: (64, 128)}


def _m_bucket(m: int) -> int:
    """0: decode-sized (<= 16 rows), 1: up to 64 rows, 2: prefill."""
    return 0 if m <= 16 else (1 if m <= 64 else 2)


def _prune_configs(configs, named_args, **kwargs):
    """Keep the tiles whose BLOCK_M suits the bucket of M (no 128-row tile for one token)."""
    keep = _BUCKET_BLOCK_M[named_args["m_bucket"]]
    return [c for c in configs if c.kwargs["BLOCK_M"] in keep]


# Autotuned once per (N, K, group size, M bucket, dtypes): a model has a handful of
# (N, K) shapes, and the bucket keeps a changing batch size from re-tuning every step.
_w4a16_tuned = triton.autotune(
    configs=_cuda_configs(), key=["N", "K", "group_size", "m_bucket"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_w4a16_kernel)


def _block_k(group_size: int, max_block_k: int) -> tuple[int, bool]:
    """(BLOCK_K, aligned): the largest power of two <= max_block_k dividing the group size
    (one group per step), or the general path's step when none >= 16 does."""
    bk = max_block_k
    while bk >= 16:
        if group_size % bk == 0:
            return bk, True
        bk //= 2
    return _GENERAL_BLOCK_K, False


def _check_args(x, qweight, scales, zeros, group_size) -> tuple[int, int, int]:
    """(N, K, G) after checking every argument; clear ValueErrors otherwise."""
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [..., K], got a {x.dim()}-d {x.dtype} tensor")
    _check_device_dtype({"x": x})  # device kind and activation dtype (bf16: not on the interpreter)
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; "
                             "move the weight and activations to one device")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-d torch.uint8 tensor [N, K / 2] (two 4-bit values "
                         f"per byte, see minillm.quant.packing); got a {qweight.dim()}-d "
                         f"{qweight.dtype} tensor")
    n, k = qweight.shape[0], x.shape[-1]
    if k < 2 or k % 2:
        raise ValueError(f"K = x.shape[-1] = {k} must be even and >= 2: 4-bit packing stores two "
                         "columns per byte")
    if qweight.shape[1] * 2 != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} holds {qweight.shape[1] * 2} columns but "
                         f"x has K = {k}; qweight must be [N, K / 2] = [{n}, {k // 2}]")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}; groups must tile each "
                         "row exactly (per-channel quantization: group_size = K)")
    groups = k // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float32 or tuple(t.shape) != (n, groups):
            raise ValueError(f"{name} must be torch.float32 [N, K / group_size] = [{n}, {groups}], "
                             f"got {t.dtype} {tuple(t.shape)} (note: module.half() or "
                             ".to(dtype) also converts these buffers; keep them in fp32)")
    return n, k, groups


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ Ŵᵀ`` with Ŵ ``[N, K]`` given in the packed 4-bit layout (see the module docstring).

    x ``[..., K]`` fp16 / bf16 / fp32 (CUDA; fp16 / fp32 on the interpreter); qweight uint8
    ``[N, K / 2]``; scales, zeros fp32 ``[N, K / group_size]``; ``group_size`` divides K.
    Returns ``[..., N]`` in x's dtype. Any strides are accepted.
    """
    n, k, _ = _check_args(x, qweight, scales, zeros, group_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)

    interp = interpreter_enabled()
    block_k, aligned = _block_k(group_size, CPU_MAX_BLOCK_K if interp else MAX_BLOCK_K)
    args = (x2, qweight, scales, zeros, out, m, n, k, group_size, _m_bucket(m),
            *x2.stride(), *qweight.stride(), *scales.stride(), *zeros.stride(), *out.stride())
    meta = dict(BLOCK_K=block_k, GROUP_ALIGNED=aligned, EVEN_K=k % block_k == 0)
    if interp:
        grid = (triton.cdiv(m, CPU_BLOCK_M), triton.cdiv(n, CPU_BLOCK_N))
        _w4a16_kernel[grid](*args, BLOCK_M=CPU_BLOCK_M, BLOCK_N=CPU_BLOCK_N, **meta)
    else:
        grid = lambda c: (triton.cdiv(m, c["BLOCK_M"]), triton.cdiv(n, c["BLOCK_N"]))  # noqa: E731
        _w4a16_tuned[grid](*args, **meta)
    return out.reshape(*lead, n)
