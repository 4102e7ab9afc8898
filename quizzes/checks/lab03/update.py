"""Lab 03 check ``online_softmax_update``: one step of the online softmax, (m, l, acc) after
one more block of scores, against ``minillm.kernels.tiled.online_softmax_update``.

The blocks come in an order that exposes the usual mistakes: rows that have seen only
−inf scores, a fully masked block, a block that raises the running max, a plain one.
A wrong field is explained by the mistake that reproduces it (a missed rescale, the block
max instead of the running max, alpha upside down, ...) or, for NaN, by the rows that
hold it.
"""

from __future__ import annotations

from ..core import Case, _Difference, register
from ..mismatch import show_mismatch
from .mistakes import _is_tensor, _reproduces, _same

__all__ = ["online_softmax_update"]

_UPD_TOL = dict(atol=1e-5, rtol=1e-4)


def _update_pieces(m, l, acc, s, v):
    """The reference update, split into the pieces the mistakes reuse (float64)."""
    import torch

    m, l, acc, s, v = (x.double() for x in (m, l, acc, s, v))
    m_new = torch.maximum(m, s.amax(dim=-1))
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)
    p = torch.exp(s - m_safe[..., None])
    return dict(m=m, l=l, acc=acc, s=s, v=v, m_new=m_new, m_safe=m_safe, alpha=alpha, p=p,
                inv_alpha=torch.exp(m_safe - m), pv=p @ v)


_ALPHA = "the factor that moves a sum from the old max to the new one (it is ≤ 1)"


def _update_mistakes(field: str, x: dict) -> list[tuple[str, object]]:
    """(message, value of ``field`` under that mistake) for the usual mistakes."""
    import torch

    if field == "m":
        return [
            ("m is the max of this block only. The running max must also remember the max of "
             "the blocks seen before.", x["s"].amax(dim=-1)),
            ("m did not change. Return the new running max, which takes this block's scores "
             "into account.", x["m"]),
            ("m is 0 for rows that have seen only −inf scores; it must stay −inf there (the max "
             "of nothing). Use 0 in place of −inf only inside exp(), and return m_new itself.",
             x["m_safe"]),
        ]
    if field == "l":
        return [
            ("l was not rescaled. The old sum was taken relative to the old max m; when the max "
             f"grows, rescale it by {_ALPHA} before adding this block's terms.",
             x["l"] + x["p"].sum(-1)),
            ("the rescaling factor is upside down: the old terms shrink when the max grows, so "
             "the factor must be at most 1.", x["l"] * x["inv_alpha"] + x["p"].sum(-1)),
            ("l counts this block only: the running sum must keep the old blocks, rescaled.",
             x["p"].sum(-1)),
        ]
    return [
        ("acc was not rescaled. It was accumulated relative to the old max m; when the max grows, "
         f"rescale it by {_ALPHA}, as you do for l.", x["acc"] + x["pv"]),
        ("the rescaling factor is upside down: the old terms shrink when the max grows, so "
         "the factor must be at most 1.", x["acc"] * x["inv_alpha"][..., None] + x["pv"]),
        ("acc holds this block only: keep the old blocks, rescaled.", x["pv"]),
        ("acc was divided by l. Keep acc unnormalized (a running sum of exp(score − m) · v); "
         "divide by l once, at the very end of attention, not in the update.",
         (x["acc"] * x["alpha"][..., None] + x["pv"])
         / torch.where(x["l"] * x["alpha"] + x["p"].sum(-1) == 0, 1.0,
                       x["l"] * x["alpha"] + x["p"].sum(-1))[..., None]),
    ]


def _update_blocks(case: Case, lead: tuple, rows: int):
    """Four score blocks: some rows fully masked; all −inf; larger scores (the max grows);
    plain. Each with its description."""
    import torch

    inf = float("-inf")
    blocks = []
    n0 = case.size(1, 12)
    s0 = case.randn(*lead, rows, n0) * 2
    dead = torch.zeros(rows, dtype=torch.bool)
    dead[torch.randperm(rows, generator=case.gen)[: max(1, rows // 3)]] = True
    s0[..., dead, :] = inf
    blocks.append((s0, "some rows fully masked (all −inf) and the state still empty"))
    blocks.append((torch.full((*lead, rows, case.size(1, 8)), inf), "every score −inf (a fully masked block)"))
    n2 = case.size(2, 12)
    s2 = case.randn(*lead, rows, n2) * 2 + 4
    holes = case.rand(*lead, rows, n2) < 0.25
    holes[..., 0] = False  # at least one visible key per row
    blocks.append((s2.masked_fill(holes, inf), "larger scores: the running max grows"))
    blocks.append((case.randn(*lead, rows, case.size(1, 12)) * 2 - 1, "smaller scores: the max mostly stays"))
    return blocks


def _nan_diagnosis(field: str, yours, m_old, m_new) -> str:
    """Why the student's ``field`` has NaN, judged by which rows hold it."""
    import torch

    nan_rows = torch.isnan(yours).any(-1) if field == "acc" else torch.isnan(yours)
    dead = torch.isinf(m_new)                      # rows that have seen only −inf so far
    first = torch.isinf(m_old) & ~dead             # rows that see their first real score now
    if not bool((nan_rows & ~dead).any()):
        return ("NaN in rows that have seen only −inf scores. There m_new is −inf and "
                "exp(−inf − (−inf)) = exp(NaN). For such rows, take the exponents relative to 0 "
                "instead (Section 3's corner case), and still return −inf as their max.")
    if bool((nan_rows & first).any()) and not bool((nan_rows & ~dead & ~first).any()):
        return ("NaN in rows that see their first real score in this block (m was −inf). There "
                "the rescaling factor should be exp(−inf) = 0, so the empty old sums stay 0; NaN "
                "means it was inf (0 · inf): is it upside down? It must be at most 1.")
    return ("NaN where the reference has numbers: exp(−inf − (−inf)) and 0 · inf are both NaN. "
            "Check the rows whose m is −inf (before or after this block).")


@register(
    cases=3,
    nudge="Take the three fields one at a time: what is the new max, by what factor must the old sum "
          "and the old accumulator change when the max moves, and what does this block add to each? "
          "Then the rows that have seen only −inf.",
    concept="l and acc are sums of exponentials measured against the running max m. When the max "
            "grows, everything summed so far must be re-expressed against the new max before this "
            "block's terms are added; that keeps every exponent ≤ 0 and the result exact.")
def online_softmax_update(case: Case, fn) -> None:
    """Your online_softmax_update(m, l, acc, scores_block, v_block) -> (m, l, acc) against
    minillm.kernels.tiled.online_softmax_update, fed four blocks in turn (each step starts
    from the reference's state): rows with only −inf scores, a fully masked block, a block
    that raises the max, and a plain one."""
    import torch

    from minillm.kernels.tiled import online_softmax_update as ref_update

    lead = (case.size(1, 2), case.size(1, 3))
    rows, d = case.size(2, 9), case.choice([4, 8, 16])
    m = torch.full((*lead, rows), float("-inf"))
    l, acc = torch.zeros(*lead, rows), torch.zeros(*lead, rows, d)
    blocks = _update_blocks(case, lead, rows)
    for i, (s, desc) in enumerate(blocks):
        v = case.randn(*lead, s.shape[-1], d)
        want = ref_update(m, l, acc, s, v)
        got = case.call(fn, m, l, acc, s, v)
        where = f"after block {i + 1} of {len(blocks)} ({desc})"
        case.expect(isinstance(got, (tuple, list)) and len(got) == 3,
                    f"{where}: return the new state as a tuple (m, l, acc) of three tensors; "
                    f"got {type(got).__name__}{f' of {len(got)} items' if isinstance(got, (tuple, list)) else ''}.")
        pieces = None
        for name, yours, ref in zip(("m", "l", "acc"), got, want):
            if not _is_tensor(yours) or tuple(yours.shape) != tuple(ref.shape) or _same(yours, ref, **_UPD_TOL):
                case.compare(yours, ref, what=f"{name} {where}", **_UPD_TOL)
                continue
            pieces = pieces or _update_pieces(m, l, acc, s, v)
            for message, variant in _update_mistakes(name, pieces):
                if _reproduces(yours, variant, ref, **_UPD_TOL):
                    raise _Difference(f"{name} {where}: {message}\n"
                                      + show_mismatch(yours, ref, **_UPD_TOL).text())
            if bool(torch.isnan(yours).any()) and not bool(torch.isnan(ref).any()):
                raise _Difference(f"{name} {where}: {_nan_diagnosis(name, yours, m, want[0])}\n"
                                  + show_mismatch(yours, ref, **_UPD_TOL).text())
            case.compare(yours, ref, what=f"{name} {where}", show=True, **_UPD_TOL)
        m, l, acc = want
