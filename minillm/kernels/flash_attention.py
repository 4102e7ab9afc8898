"""FlashAttention-2 forward in Triton: dense batches and packed (varlen) sequences.

``flash_attention`` (q ``[B, Hq, T, D]``) and ``flash_attention_varlen`` (packed
``[N, H, D]`` rows with ``cu_seqlens``) check their arguments (``_checks.py``), choose the
tiles and launch the one kernel of ``flash_attention_kernel.py``, whose docstring states the
algorithm and its invariants: GQA by index (K/V never repeated), causal masks bottom-right
aligned, a row that sees no key gives output 0 and lse -inf, fp32 accumulation, output in
q's dtype.

Tiles: on CUDA the config pinned for the GPU's architecture and the call's bucket (head
dim, a coarse length class, causal, varlen, dtype width; see ``tuning.py``); on the
interpreter one fixed small tile (16 x 16, the smallest ``tl.dot`` allows).
"""

from __future__ import annotations

import math

import torch
import triton

from . import tuning
from ._checks import _check_device_dtype, _check_heads, _check_out, _is_integer
from ._grid import cdiv, next_power_of_2
from .flash_attention_kernel import LOG2E, _attn_fwd_kernel

__all__ = ["flash_attention", "flash_attention_varlen"]

# Interpreter: one fixed small tile (the smallest tl.dot allows), no search.
CPU_BLOCK_M = 16
CPU_BLOCK_N = 16

# Tiles per bucket (head dim, a coarse query-length class, causal, varlen, dtype width):
# a serving engine whose lengths change every step keeps its bucket (see tuning.py).
FLASH_ATTENTION = tuning.register(tuning.Tunable(
    name="flash_attention", fn=_attn_fwd_kernel,
    # (BLOCK_M, BLOCK_N, warps, stages): twelve, so that a search of one bucket takes
    # seconds, not a minute (the usual winners of FlashAttention-2 in Triton are among them).
    configs=tuple(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                  for bm, bn, w, st in ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                                        (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3),
                                        (128, 32, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2),
                                        (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3))),
    default=triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    interpreter=triton.Config({"BLOCK_M": CPU_BLOCK_M, "BLOCK_N": CPU_BLOCK_N}, num_warps=4,
                              num_stages=1),
    bucket_space={"D": (16, 32, 64, 128, 256), "L": (0, 1, 2), "causal": (0, 1),
                  "varlen": (0, 1), "dt": (16, 32)},
    signature={"Q": "*{dt}", "K": "*{dt}", "V": "*{dt}", "Out": "*{dt}", "Lse": "*fp32",
               "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "qk_scale": "fp32"},
    constexprs=lambda b: {"IS_VARLEN": bool(b["varlen"]), "CAUSAL": bool(b["causal"]),
                          "STORE_LSE": False, "BLOCK_D": b["D"]},
    unit_strides=("stride_qd", "stride_kd", "stride_vd", "stride_od"),
))


def _seqlen_bucket(max_q: int) -> int:
    return 0 if max_q <= 256 else (1 if max_q <= 2048 else 2)


def _block_d(d: int) -> int:
    return max(16, next_power_of_2(d))


def _launch(q, k, v, out, lse, cu_q, cu_k, strides, hq, group, seqlen_q, seqlen_k, d,
            sm_scale, batch, max_q, varlen, causal, store_lse):
    qk_scale = sm_scale * LOG2E
    args = (q, k, v, out, lse, cu_q, cu_k, *strides, hq, group, seqlen_q, seqlen_k, d, qk_scale)
    meta = dict(IS_VARLEN=varlen, CAUSAL=causal, STORE_LSE=store_lse, BLOCK_D=_block_d(d))
    bucket = {"D": meta["BLOCK_D"], "L": _seqlen_bucket(max_q), "causal": int(causal),
              "varlen": int(varlen), "dt": tuning.dtype_bits(q.dtype)}
    FLASH_ATTENTION.run(bucket, lambda cfg: _attn_fwd_kernel[
        (cdiv(max_q, cfg.kwargs["BLOCK_M"]), batch * hq)](
        *args, **meta, **tuning.launch_options(cfg)), q.device)


# ----------------------------------------------------------------------------- public API


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
    *,
    out: torch.Tensor | None = None,
):
    """Attention ``softmax(q k^T * sm_scale) v`` without materialising the score matrix.

    q ``[B, Hq, T, D]``, k and v ``[B, Hkv, S, D]`` with ``Hq % Hkv == 0`` (any strides).
    ``causal``: query i sees keys ``j <= i + S - T`` (bottom-right aligned; the usual
    triangle when S == T). ``sm_scale`` defaults to ``1 / sqrt(D)``.
    Returns ``out`` ``[B, Hq, T, D]`` in q's dtype, and with ``return_lse`` also the
    natural-log log-sum-exp of each row's scaled scores, ``[B, Hq, T]`` float32.
    ``out``: optional preallocated output (same shape, dtype and device as q), written in full.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError("q, k and v must be torch.Tensors")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention expects q [B, Hq, T, D] and k, v [B, Hkv, S, D] (rank 4); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}. "
                         "For packed sequences [N, H, D] use flash_attention_varlen")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, t, d = q.shape
    _, hkv, s, dk = k.shape
    if k.shape[0] != b or dk != d:
        raise ValueError(f"k/v must share batch size and head_dim with q: q {tuple(q.shape)} "
                         f"is [B={b}, Hq={hq}, T={t}, D={d}], k {tuple(k.shape)}")
    _check_heads(hq, hkv, d)
    _check_device_dtype({"q": q, "k": k, "v": v})
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)

    out = _check_out(out, q)
    lse = torch.empty((b, hq, t), dtype=torch.float32, device=q.device)
    if b * hq * t == 0:
        return (out, lse) if return_lse else out
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride())
    _launch(q, k, v, out, lse, q, q, strides, hq, hq // hkv, t, s, d, sm_scale,
            batch=b, max_q=t, varlen=False, causal=causal, store_lse=return_lse)
    return (out, lse) if return_lse else out


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    sm_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashAttention over packed sequences (no padding).

    q ``[Nq, Hq, D]``, k and v ``[Nk, Hkv, D]``: sequence i owns query rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``
    (``[num_seqs + 1]``, starting at 0, non-decreasing; int32, or any integer dtype such as
    int64, converted to int32). ``max_seqlen_q`` sizes the grid and must be >= every query
    length (``max_seqlen_k`` is accepted for API parity with flash-attn and checked the same
    way on CPU). Causal per sequence, bottom-right aligned:
    with ``len_q`` queries and ``len_k`` keys, query i sees keys ``j <= i + len_k - len_q``,
    so a prefill chunk sees all of its sequence's cached prefix.
    Returns ``[Nq, Hq, D]`` in q's dtype (written into ``out`` if given). Rows of q beyond
    ``cu_seqlens_q[-1]`` are not written.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)):
        raise ValueError("q, k, v, cu_seqlens_q and cu_seqlens_k must be torch.Tensors")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"flash_attention_varlen expects packed q [Nq, Hq, D] and k, v [Nk, Hkv, D] "
                         f"(rank 3); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    nq, hq, d = q.shape
    nk, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k/v head_dim {dk} differs from q head_dim {d}")
    _check_heads(hq, hkv, d)
    _check_device_dtype({"q": q, "k": k, "v": v})
    for name, cu, n in (("cu_seqlens_q", cu_seqlens_q, nq), ("cu_seqlens_k", cu_seqlens_k, nk)):
        if cu.dim() != 1 or not _is_integer(cu) or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D torch.int32 tensor on {q.device} "
                             f"([num_seqs + 1] cumulative lengths), or of another integer dtype "
                             f"such as torch.int64 (converted to int32); got shape {tuple(cu.shape)}, "
                             f"dtype {cu.dtype}, device {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.numel() < 2:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be [num_seqs + 1] with num_seqs >= 1; "
                         f"got {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    if q.device.type == "cpu":  # values are free to check on CPU; on CUDA it would cost a sync
        for name, cu, n, mx in (("cu_seqlens_q", cu_seqlens_q, nq, max_seqlen_q),
                                ("cu_seqlens_k", cu_seqlens_k, nk, max_seqlen_k)):
            lens = cu[1:] - cu[:-1]
            if int(cu[0]) != 0 or bool((lens < 0).any()) or int(cu[-1]) > n:
                raise ValueError(f"{name}={cu.tolist()} must start at 0, never decrease and end "
                                 f"at most at {n} (the number of packed rows)")
            if int(lens.max()) > mx:
                raise ValueError(f"a sequence has {int(lens.max())} rows but {name[3:]} "
                                 f"max is {mx}; pass the true maximum length")
    # The kernel reads int32 offsets. Converted after the value checks, so on CPU every
    # value is known to fit (0 <= cu <= number of rows); an int32 tensor is used as is.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    num_seqs = cu_seqlens_q.numel() - 1
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)

    out = _check_out(out, q)
    if nq == 0 or max_seqlen_q <= 0:
        return out
    # [N, H, D] viewed as batch stride 0, head stride, token stride, dim stride.
    strides = (0, q.stride(1), q.stride(0), q.stride(2),
               0, k.stride(1), k.stride(0), k.stride(2),
               0, v.stride(1), v.stride(0), v.stride(2),
               0, out.stride(1), out.stride(0), out.stride(2),
               0, 0, 0)
    _launch(q, k, v, out, out, cu_seqlens_q, cu_seqlens_k, strides, hq, hq // hkv,
            max_seqlen_q, max_seqlen_k, d, sm_scale, batch=num_seqs, max_q=int(max_seqlen_q),
            varlen=True, causal=causal, store_lse=False)
    return out
