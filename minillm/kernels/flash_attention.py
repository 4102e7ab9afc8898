"""FlashAttention-2 forward in Triton: dense batches and packed (varlen) sequences.

One program computes one tile of ``BLOCK_M`` query rows of one query head. It walks the
key/value tiles of ``BLOCK_N`` keys with an online softmax (running max ``m``, running sum
``l``, accumulator ``acc``, all fp32), so the T x S score matrix never exists; the output
is ``acc / l``. Same math as ``tiled.tiled_attention``, which is the readable version.

Invariants and conventions:

* GQA by index: query head ``h`` reads KV head ``h // (Hq // Hkv)``; K/V are never repeated.
* Causal masks are bottom-right aligned: query i (of T) sees key j (of S) iff
  ``j <= i + S - T``. For varlen this holds per sequence with ``len_q`` / ``len_k``: a
  chunk of new queries after a cached prefix sees the whole prefix.
* Under the causal mask a query tile's loop stops at the last key its last row can see
  (fully masked tiles are skipped, never loaded), and splits in two phases: tiles every row
  sees in full (no mask arithmetic) and tiles crossing the diagonal or the sequence end
  (masked with -inf).
* A row that sees no key (causal with S < T) gets output 0 and lse -inf, never NaN.
* Scores are kept in base 2 (``qk * sm_scale * log2(e)``, then ``exp2``): same result,
  cheaper exponent on GPUs. The returned lse is converted back to natural log.
* dtypes: fp16 / bf16 / fp32 in, fp32 accumulation, output in q's dtype. On CUDA an fp32
  ``tl.dot`` uses TF32 tensor cores (about 1e-3 relative error); the interpreter is exact.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import interpreter_enabled, require_working_setup

__all__ = ["flash_attention", "flash_attention_varlen"]

LOG2E = 1.4426950408889634

# Interpreter: one fixed small tile (the smallest tl.dot allows), no autotuning.
CPU_BLOCK_M = 16
CPU_BLOCK_N = 16


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _attn_tiles(
    acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
    offs_m, offs_d, d_mask, lo, hi, len_k, causal_shift, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Fold key tiles [lo, hi) into (acc, m_i, l_i). MASKED: apply bounds/causal mask."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < len_k) & d_mask[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, base-2 units
        if MASKED:
            keep = offs_n[None, :] < len_k
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row may have seen only -inf so far: take exponents relative to 0, not -inf,
            # so exp2(-inf - -inf) = NaN never happens (alpha and p are then 0).
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new  # every row sees every key of an unmasked tile: finite
        alpha = tl.exp2(m_i - m_new_safe)
        p = tl.exp2(s - m_new_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh, stride_lt,
    num_q_heads, group, seqlen_q, seqlen_k, head_dim, qk_scale, seqlen_bucket,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # seqlen_bucket is unused here: it only keys the autotuner (see _launch).
    # grid: (query tiles, batch * query heads). For varlen, "batch" is the sequence index
    # and the batch strides are 0: a sequence starts at token cu_seqlens[b].
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_q_heads
    h = pid_bh % num_q_heads
    kvh = h // group
    if IS_VARLEN:
        q_lo = tl.load(cu_seqlens_q + b)
        len_q = tl.load(cu_seqlens_q + b + 1) - q_lo
        k_lo = tl.load(cu_seqlens_k + b)
        len_k = tl.load(cu_seqlens_k + b + 1) - k_lo
        q_start = q_lo.to(tl.int64)  # 64-bit offsets: N * H * D may exceed 2**31
        k_start = k_lo.to(tl.int64)
    else:
        q_start = 0
        len_q = seqlen_q
        k_start = 0
        len_k = seqlen_k
    start_m = pid_m * BLOCK_M
    if start_m >= len_q:  # grid is sized for the longest sequence
        return

    b64 = b.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    m_mask = offs_m < len_q
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qt
    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh + k_start * stride_kt
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh + k_start * stride_vt
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    causal_shift = len_k - len_q  # query i sees keys j <= i + causal_shift
    if CAUSAL:
        # keys [0, full) are visible to every row of the tile (its first row is start_m);
        # keys >= hi are hidden from every row (its last row is start_m + BLOCK_M - 1).
        full = tl.minimum(tl.maximum(start_m + causal_shift + 1, 0), len_k)
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_shift, 0), len_k)
    else:
        full = len_k
        hi = len_k
    full_hi = (full // BLOCK_N) * BLOCK_N  # whole tiles only (full >= 0, so // is a floor)

    acc, m_i, l_i = _attn_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd,
                                stride_vt, stride_vd, offs_m, offs_d, d_mask, 0, full_hi,
                                len_k, causal_shift, qk_scale, BLOCK_N, False, CAUSAL)
    acc, m_i, l_i = _attn_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd,
                                stride_vt, stride_vd, offs_m, offs_d, d_mask, full_hi, hi,
                                len_k, causal_shift, qk_scale, BLOCK_N, True, CAUSAL)

    empty = l_i == 0.0  # rows that saw no key at all
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_base = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + q_start * stride_ot
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    if STORE_LSE:
        lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))  # base 2; times ln(2) gives natural log
        lse = tl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
        l_base = Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start * stride_lt
        tl.store(l_base + offs_m * stride_lt, lse, mask=m_mask)


def _cuda_configs():
    configs = []
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    if bm == 64 and warps == 8:
                        continue
                    configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn},
                                                 num_warps=warps, num_stages=stages))
    return configs


# Autotuned once per (head_dim, causal, varlen, dtypes, coarse length bucket): keyed on a
# bucket rather than the length, so a serving engine whose lengths change every step does
# not re-tune on every call.
_attn_fwd_tuned = triton.autotune(configs=_cuda_configs(),
                                  key=["head_dim", "seqlen_bucket", "CAUSAL", "IS_VARLEN"])(_attn_fwd_kernel)


def _seqlen_bucket(max_q: int) -> int:
    return 0 if max_q <= 256 else (1 if max_q <= 2048 else 2)


# ----------------------------------------------------------------------------- checks

_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CPU_DTYPES = (torch.float16, torch.float32)


def _check_device_dtype(name_to_tensor: dict[str, torch.Tensor]) -> None:
    """All tensors on one device of the right kind and of one supported dtype."""
    require_working_setup()
    tensors = list(name_to_tensor.items())
    first_name, first = tensors[0]
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "move all inputs to one device")
        if t.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                             "all of them must have the same dtype")
    if interpreter_enabled():
        if first.device.type != "cpu":
            raise ValueError(f"Triton is running in its CPU interpreter, but the inputs are on "
                             f"{first.device}; pass CPU tensors (or unset TRITON_INTERPRET on a GPU machine)")
        allowed = _CPU_DTYPES
        if first.dtype == torch.bfloat16:
            raise ValueError("the Triton CPU interpreter cannot compute in torch.bfloat16; "
                             "use torch.float32 (or float16) on CPU")
    else:
        if first.device.type != "cuda":
            raise ValueError(f"compiled Triton kernels need CUDA tensors, got {first.device}; "
                             "move the inputs with .cuda() (or run on CPU with TRITON_INTERPRET=1)")
        allowed = _GPU_DTYPES
    if first.dtype not in allowed:
        raise ValueError(f"dtype {first.dtype} is not supported here; allowed: "
                         + ", ".join(str(d) for d in allowed))


def _check_heads(hq: int, hkv: int, d: int) -> None:
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} query heads must be a multiple of Hkv={hkv} KV heads "
                         "(grouped-query attention maps query head h to KV head h // (Hq // Hkv))")
    if not 1 <= d <= 256:
        raise ValueError(f"head_dim={d} is not supported; allowed 1..256")


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The caller's output buffer (must match q exactly), or a fresh one."""
    if out is None:
        return torch.empty_like(q)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype \
            or out.device != q.device:
        raise ValueError(f"out must be a tensor like q: shape {tuple(q.shape)}, dtype {q.dtype}, "
                         f"device {q.device}; got {getattr(out, 'shape', out)!r}, "
                         f"{getattr(out, 'dtype', None)}, {getattr(out, 'device', None)}")
    return out


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _launch(q, k, v, out, lse, cu_q, cu_k, strides, hq, group, seqlen_q, seqlen_k, d,
            sm_scale, batch, max_q, varlen, causal, store_lse):
    qk_scale = sm_scale * LOG2E
    args = (q, k, v, out, lse, cu_q, cu_k, *strides, hq, group, seqlen_q, seqlen_k, d, qk_scale,
            _seqlen_bucket(max_q))
    meta = dict(IS_VARLEN=varlen, CAUSAL=causal, STORE_LSE=store_lse, BLOCK_D=_block_d(d))
    if interpreter_enabled():
        grid = (triton.cdiv(max_q, CPU_BLOCK_M), batch * hq)
        _attn_fwd_kernel[grid](*args, BLOCK_M=CPU_BLOCK_M, BLOCK_N=CPU_BLOCK_N, **meta)
    else:
        grid = lambda m: (triton.cdiv(max_q, m["BLOCK_M"]), batch * hq)  # noqa: E731
        _attn_fwd_tuned[grid](*args, **meta)


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
    (int32 ``[num_seqs + 1]``, starting at 0, non-decreasing). ``max_seqlen_q`` sizes the
    grid and must be >= every query length (``max_seqlen_k`` is accepted for API parity with
    flash-attn and checked the same way on CPU). Causal per sequence, bottom-right aligned:
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
        if cu.dim() != 1 or cu.dtype != torch.int32 or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D torch.int32 tensor on {q.device} "
                             f"([num_seqs + 1] cumulative lengths); got shape {tuple(cu.shape)}, "
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
