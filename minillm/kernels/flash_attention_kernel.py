"""The FlashAttention-2 forward kernel in Triton: one kernel for dense batches and packed
(varlen) sequences. The wrappers that check arguments and launch it: ``flash_attention.py``.

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
* dtypes: fp16 / bf16 / fp32 in, fp32 accumulation, output in q's dtype. fp32 inputs are
  multiplied in true fp32 on a GPU too (``_dot.dot``: no TF32), as in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import dot

LOG2E = 1.4426950408889634


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
        s = dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, base-2 units
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
        acc = dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


# The lengths change with every engine step (chunked prefill): never specialized on (Triton
# would compile a new program when one becomes a multiple of 16 or 1).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh, stride_lt,
    num_q_heads, group, seqlen_q, seqlen_k, head_dim, qk_scale,
    IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python floats as fp64 (paged_decode.py)
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
