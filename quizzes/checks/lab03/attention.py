"""Lab 03 check ``tiled_attention`` (attention over K/V tiles in PyTorch, against naive
attention in float64), and the tile loop both attention checks share.

``_walk`` is the K/V-tile loop in float64 that can make one deliberate mistake;
``_attention_mistakes`` lists the usual ones as (message, output) pairs for the same
inputs and tiles; ``_compare_attention`` names the mistake that reproduces the student's
output, or says it overflowed, or shows yours vs reference. ``flash.py`` reuses all three
for the Triton kernel.
"""

from __future__ import annotations

import math

from ..core import Case, _Difference, register
from ..mismatch import show_mismatch
from .mistakes import _is_tensor, _isclose, _reproduces, _same

__all__ = ["tiled_attention"]

_ATT_TOL = dict(atol=2e-5, rtol=1e-4)


def _walk(q, k, v, causal: bool, scale: float, block_n: int, *, mask: str = "ok", update: str = "ok",
          walk_hi=None, skip_tail: bool = False, pad_tail: bool = False, divide: bool = True):
    """The K/V-tile loop in float64, optionally with one deliberate mistake.

    mask: "ok" (j <= i), "strict" (j < i), "plus_one" (j <= i + 1), "local" (j - n0 <= i).
    update: "ok", "no_rescale_acc", "no_rescale_l", "block_max".
    walk_hi: per-query bound [T] (the Triton kernel's tiles); tiles at or past it are skipped.
    skip_tail: drop the last, shorter tile. pad_tail: pad the last tile with zero keys that
    are not masked (what a kernel without the ``offs_n < seq_len`` mask computes).
    """
    import torch

    q, k, v = q.double(), k.double(), v.double()
    t, s_len = q.shape[-2], k.shape[-2]
    i = torch.arange(t)[:, None]
    m = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for n0 in range(0, s_len, block_n):
        n1 = min(n0 + block_n, s_len)
        if skip_tail and n1 - n0 < block_n:
            break
        kt, vt = k[..., n0:n1, :], v[..., n0:n1, :]
        j = torch.arange(n0, n1)[None, :]
        real = torch.ones(1, n1 - n0, dtype=torch.bool)
        if pad_tail and n1 - n0 < block_n:
            pad = block_n - (n1 - n0)
            kt = torch.cat([kt, kt.new_zeros(*kt.shape[:-2], pad, kt.shape[-1])], dim=-2)
            vt = torch.cat([vt, vt.new_zeros(*vt.shape[:-2], pad, vt.shape[-1])], dim=-2)
            j = torch.arange(n0, n0 + block_n)[None, :]
            real = torch.ones(1, block_n, dtype=torch.bool)
        scores = (q @ kt.transpose(-1, -2)) * scale
        keep = real.expand(t, -1)
        if causal:
            keep = {"ok": j <= i, "strict": j < i, "plus_one": j <= i + 1, "local": (j - n0) <= i}[mask] & keep
        scores = scores.masked_fill(~keep, float("-inf"))
        block_max = scores.amax(-1)
        m_new = block_max if update == "block_max" else torch.maximum(m, block_max)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(scores - m_safe[..., None])
        l_new = (l if update == "no_rescale_l" else l * alpha) + p.sum(-1)
        acc_new = (acc if update == "no_rescale_acc" else acc * alpha[..., None]) + p @ vt
        if walk_hi is not None:
            walked = n0 < walk_hi  # [T]
            m_new = torch.where(walked, m_new, m)
            l_new = torch.where(walked, l_new, l)
            acc_new = torch.where(walked[:, None], acc_new, acc)
        m, l, acc = m_new, l_new, acc_new
    return acc / l[..., None] if divide else acc


def _attention_mistakes(q, k, v, causal: bool, scale: float, block_n: int, lang: str, walk_hi=None):
    """(message, output) pairs for the usual mistakes of a tiled attention loop."""
    d, t = q.shape[-1], q.shape[-2]
    tri = lang == "triton"
    where = "" if tri else " (in your online_softmax_update)"
    offs = "the tile's start plus the key's place in it"
    kw = dict(walk_hi=walk_hi)

    def walk(**extra):
        args = dict(causal=causal, scale=scale, block_n=block_n, **kw)
        args.update(extra)
        return _walk(q, k, v, **args)

    out = []
    if causal:
        out += [
            ("off-by-one causal mask: query i must see keys j ≤ i, itself included; yours hides the "
             "diagonal (j < i). Keep scores where j <= i.", walk(mask="strict")),
            ("off-by-one causal mask: query i also saw key i + 1. Keep scores where j <= i.",
             walk(mask="plus_one")),
            ("the causal mask used the key's position inside the tile; compare the query index with "
             f"the key's global index ({offs}).", walk(mask="local")),
            ("causal=True but every query saw every key, the future included: set scores with "
             "j > i to −inf before the softmax.", walk(causal=False)),
        ]
    else:
        out.append(("causal=False, but yours hid the future keys: apply the mask only when causal is true.",
                    walk(causal=True)))
    out += [
        (f"wrong scale: yours matches softmax(q·kᵀ) with no scale; multiply the scores by "
         f"sm_scale = 1/√D = {scale:.4g}.", walk(scale=1.0)),
        (f"wrong scale: yours uses 1/D = {1 / d:.4g}; the softmax scale is 1/√D = {scale:.4g}.",
         walk(scale=1.0 / d)),
        ("the scores were scaled twice (sm_scale²): multiply by sm_scale once.", walk(scale=scale * scale)),
        ("yours is a base-2 softmax: exp2 of natural-log scores. Use " + ("tl.exp" if tri else "torch.exp")
         + ", or multiply the scores by log2(e) = 1.4427 first (as minillm's kernel does).",
         walk(scale=scale * math.log(2.0))),
        (f"acc was not rescaled when the running max grew{where}: the old accumulator was measured "
         "against the old max and must be moved to the new one, like l.",
         walk(update="no_rescale_acc")),
        (f"l was not rescaled when the running max grew{where}: the old sum was measured against the "
         "old max and must be moved to the new one, like acc.", walk(update="no_rescale_l")),
        ("the running max forgot the old max: it must be the max over every tile seen so far, not "
         "this tile's alone.", walk(update="block_max")),
        ("the output was multiplied by K instead of V: the probabilities weight the values.",
         _walk(q, k, k, causal, scale, block_n, **kw)),
    ]
    if t % block_n:
        if tri:
            out.append((f"keys past the end of the sequence (the padding of the last tile: T = {t} is not a "
                        f"multiple of {block_n}) took part in the softmax; they were loaded as 0 but not "
                        "masked. Their scores must be −inf too.",
                        walk(pad_tail=True)))
        else:
            out.append((f"the last, shorter tile was skipped (T = {t} is not a multiple of block_n = "
                        f"{block_n}): the loop must reach every key, and the last tile ends at the "
                        "sequence's end.", walk(skip_tail=True)))
    if not tri:
        out.append(("yours is the unnormalized accumulator: divide acc by l once, after the last tile.",
                    walk(divide=False)))
    return out


def _first_bad_slab(yours, ref, atol: float, rtol: float) -> tuple[int, int]:
    import torch

    bad = ~_isclose(yours, ref, atol, rtol)
    idx = torch.nonzero(bad.reshape(*bad.shape[:2], -1).any(-1))
    return (int(idx[0, 0]), int(idx[0, 1])) if len(idx) else (0, 0)


def _compare_attention(case: Case, yours, ref, mistakes, what: str, tol: dict, big: bool = False,
                       lang: str = "torch") -> None:
    """Shape/dtype first (framework messages), then overflow on large scores, then a named
    mistake, then yours vs reference with the first wrong (batch, head) shown."""
    import torch

    if not _is_tensor(yours) or tuple(yours.shape) != tuple(ref.shape) or yours.dtype != ref.dtype:
        case.compare(yours, ref, what=what, **tol)
        return
    if _same(yours, ref, **tol):
        return
    b, h = _first_bad_slab(yours, ref, **tol)
    view = show_mismatch(yours[b, h], ref[b, h], title=f"yours vs reference, {what}[{b}, {h}] "
                         "(rows = queries, columns = head dims; ✗ marks a wrong row)", **tol)
    for message, variant in mistakes():
        if _reproduces(yours, variant.to(ref.dtype), ref, **tol):
            raise _Difference(f"{what}: {message}\n{view.text()}")
    if big and not bool(torch.isfinite(yours).all()):
        raise _Difference(
            f"{what}: yours overflowed to inf/NaN. Scores here reach ~150, and exp() overflows "
            "float32 above 88. Every exponent must be taken relative to the running max, which is "
            "at least every score seen so far, so that no exp() sees a positive argument. (The max "
            f"of this tile alone is not enough: the old tiles' max can be far larger.)\n{view.text()}")
    case.compare(yours, ref, what=what, **tol)  # the generic message (first mismatch, max error)


def _attention_inputs(case: Case, b: int, h: int, t: int, d: int, big: bool, device=None):
    """q, k, v ~ N(0, 1); with ``big``, key 0 is aligned with every query so that its score
    is about 150 while the others stay near 0: a test of overflow safety (the softmax is
    then almost one-hot on key 0, which every row sees, causal or not)."""
    q, k, v = case.randn(b, h, t, d), case.randn(b, h, t, d), case.randn(b, h, t, d)
    if big:
        u = case.randn(d)
        u = u / u.norm()
        q = q + 5.0 * u
        k[..., 0, :] += (150.0 * math.sqrt(d) / 5.0) * u
    return tuple(x.to(device or "cpu") for x in (q, k, v))


@register(
    cases=3,
    nudge="Check the four details of Section 4 one by one: the scale, the causal mask in global key "
          "indices, the last (shorter) tile, and when you divide by l.",
    concept="Tiled attention is the online softmax driven over tiles of keys: the state starts empty "
            "(max −inf, sums 0), each tile's masked scores are folded in, and only at the end does "
            "the accumulator become a weighted average.")
def tiled_attention(case: Case, fn) -> None:
    """Your tiled_attention(q, k, v, causal, block_n) for q, k, v of shape [B, H, T, D]
    against naive attention (float64), causal and not, with T not a multiple of block_n.
    The last case has one very large score per row (overflow safety)."""
    from minillm.kernels.tiled import naive_attention

    b, h, d = case.size(1, 2), case.size(1, 3), case.choice([8, 16, 32])
    block_n = case.choice([4, 8, 16])
    t = case.size(block_n + 1, 40)
    if t % block_n == 0:
        t += 1
    big = case.index == case.total - 1
    q, k, v = _attention_inputs(case, b, h, t, d, big)
    scale = 1.0 / math.sqrt(d)
    for causal in (True, False):
        ref = naive_attention(q.double(), k.double(), v.double(), causal=causal).float()
        yours = case.call(fn, q, k, v, causal=causal, block_n=block_n)
        what = f"output (causal={causal}, T={t}, block_n={block_n}{', large scores' if big else ''})"
        _compare_attention(case, yours, ref,
                           lambda: _attention_mistakes(q, k, v, causal, scale, block_n, "torch"),
                           what, _ATT_TOL, big, "torch")
