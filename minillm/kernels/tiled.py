"""Attention in plain PyTorch, step by step: the oracle and the teaching versions.

Three functions, in the order a student meets them (Lab 03):

* ``naive_attention``   - softmax(q k^T * scale) v, materialising the whole T x S score
  matrix. O(T*S) memory. This is the *spec* every fast kernel is checked against
  (the tests run it in float64).
* ``online_softmax_update`` - one step of the running (max, sum, accumulator) update that
  lets softmax be computed one block of keys at a time.
* ``tiled_attention``   - the FlashAttention loop in Python: query tiles x key tiles, using
  ``online_softmax_update``; never holds more than a block_m x block_n score tile, and
  skips key tiles that the causal mask hides completely.

Conventions shared with the Triton kernels in this package (``flash_attention.py``):

* Shapes: q ``[B, Hq, T, D]``, k and v ``[B, Hkv, S, D]``; Hq must be a multiple of Hkv
  (grouped-query attention): query head h reads KV head ``h // (Hq // Hkv)``.
* Causal masks are *bottom-right aligned*: query i may see key j iff ``j <= i + S - T``.
  With S == T that is the usual lower triangle; with S > T (a chunk of new queries after
  S - T cached keys) the last query sees every key.
* A query row that sees no key at all (only possible when causal and S < T) outputs zeros
  and has log-sum-exp ``-inf``, instead of the NaN that a plain softmax would give.
"""

from __future__ import annotations

import math

import torch

__all__ = ["naive_attention", "online_softmax_update", "tiled_attention", "causal_mask"]


def causal_mask(t: int, s: int, device=None) -> torch.Tensor:
    """Bool ``[t, s]`` mask, True where query i may attend key j (``j <= i + s - t``)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    return j <= i + (s - t)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"expected q [B, Hq, T, D] and k, v [B, Hkv, S, D] (rank 4); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"k and v must have the same shape, and share B and D with q; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a positive multiple of Hkv={hkv} (grouped-query attention)")
    return hq, hkv


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
):
    """softmax(q k^T * sm_scale + mask) v, computed in q's dtype with the full score matrix.

    GQA is handled by repeating each KV head ``Hq // Hkv`` times (fine for a reference;
    the kernels never do this). Returns ``out`` ``[B, Hq, T, D]``, and ``lse`` ``[B, Hq, T]``
    (natural-log log-sum-exp of the scaled, masked scores) when ``return_lse``.
    """
    hq, hkv = _check_qkv(q, k, v)
    t, s, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hq, T, S]: the O(T*S) matrix
    if causal:
        scores = scores.masked_fill(~causal_mask(t, s, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row with no visible key
    # exp(scores - lse) is the softmax; rows with lse = -inf get weight 0 instead of NaN.
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse[..., None])
    out = probs @ v
    return (out, lse) if return_lse else out


def online_softmax_update(
    m: torch.Tensor,
    l: torch.Tensor,
    acc: torch.Tensor,
    scores_block: torch.Tensor,
    v_block: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of keys into a running softmax-weighted sum.

    State for a set of query rows, after having seen some keys ``j`` so far:
      ``m``   ``[..., M]``     running max of the scores seen (``-inf`` before any key),
      ``l``   ``[..., M]``     running sum of ``exp(score_j - m)``,
      ``acc`` ``[..., M, D]``  running sum of ``exp(score_j - m) * v_j``.
    New block: ``scores_block`` ``[..., M, N]`` (already scaled; masked keys are ``-inf``)
    and ``v_block`` ``[..., N, D]``.

    Returns the new ``(m, l, acc)``. Invariant kept: ``acc / l`` is the attention output
    over all keys seen so far, and ``m + log(l)`` is their log-sum-exp. When the max grows,
    the old ``l`` and ``acc`` were computed relative to a smaller max, so both are scaled
    by ``alpha = exp(m_old - m_new) <= 1``.

    Rows that have seen only ``-inf`` scores keep ``m = -inf, l = 0, acc = 0`` (no NaN):
    exponents are taken relative to 0 instead of ``-inf`` for such rows.
    """
    m_new = torch.maximum(m, scores_block.amax(dim=-1))
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)  # exp(-inf) = 0 for a row's first real block
    p = torch.exp(scores_block - m_safe[..., None])
    l_new = l * alpha + p.sum(dim=-1)
    acc_new = acc * alpha[..., None] + p @ v_block
    return m_new, l_new, acc_new


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
    return_lse: bool = False,
):
    """FlashAttention's loop in PyTorch: same result as ``naive_attention``, O(T) extra memory.

    For each tile of ``block_m`` queries, walk the key tiles of ``block_n`` keys, folding
    each into (m, l, acc) with ``online_softmax_update``. Under the causal mask the walk
    stops at the last key the tile's last query can see, so fully masked tiles cost
    nothing. GQA by index: the ``Hq // Hkv`` query heads that share a KV head are viewed as
    one group and broadcast against that KV tile (K and V are never repeated in memory).
    Works for any T and S (the last tiles are simply shorter).
    """
    hq, hkv = _check_qkv(q, k, v)
    b, _, t, d = q.shape
    s = k.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qg = q.view(b, hkv, group, t, d)  # query heads h = kvh * group + g
    kg = k[:, :, None]  # [B, Hkv, 1, S, D]: broadcasts over the group, no copy
    vg = v[:, :, None]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32 if q.dtype != torch.float64 else q.dtype,
                      device=q.device)
    outg, lseg = out.view(b, hkv, group, t, d), lse.view(b, hkv, group, t)
    shift = s - t  # causal: query i sees keys j <= i + shift
    for m0 in range(0, t, block_m):
        m1 = min(m0 + block_m, t)
        q_tile = qg[..., m0:m1, :]
        m = torch.full(q_tile.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_tile)
        hi = min(s, m1 + shift) if causal else s  # keys beyond hi are hidden from every row
        for n0 in range(0, max(hi, 0), block_n):
            n1 = min(n0 + block_n, hi)
            scores = (q_tile @ kg[..., n0:n1, :].transpose(-1, -2)) * scale
            if causal and n1 > m0 + shift + 1:  # tile crosses the diagonal: mask part of it
                rows = torch.arange(m0, m1, device=q.device)[:, None]
                keep = torch.arange(n0, n1, device=q.device)[None, :] <= rows + shift
                scores = scores.masked_fill(~keep, float("-inf"))
            m, l, acc = online_softmax_update(m, l, acc, scores, vg[..., n0:n1, :])
        empty = l == 0  # rows that saw no key: output 0, lse -inf
        outg[..., m0:m1, :] = acc / torch.where(empty, torch.ones_like(l), l)[..., None]
        lseg[..., m0:m1] = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(l))
    return (out, lse) if return_lse else out
