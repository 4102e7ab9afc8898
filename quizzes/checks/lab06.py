"""Lab 06 checks: round-to-nearest by hand, one block of GPTQ column updates, AWQ's scale search.

    check.rtn_group(rtn_group)        # (w [rows, n], bits, sym) -> (q, scale, zero), one group a row
    check.gptq_columns(gptq_columns)  # (W, U, scale, zero, bits, sym) -> Q: round with error feedback
    check.awq_scale(awq_scale)        # (w, x, bits, group_size) -> (s, alpha): the best scales

Oracles: ``minillm.quant.rtn`` (per row, ``group_size=None``); ``minillm.quant.gptq`` with one
group per row and ``blocksize`` = all columns, so its whole run is the one block the student
writes; ``minillm.quant.awq.search_scale`` with the block being the linear layer itself.

Invariants: every case draws fresh random inputs (never zeros); RTN's first two cases are
the lab's worked example [0.12, −0.83, 0.45, −0.21] at 4 bits, symmetric then asymmetric,
and every asymmetric case has a row of positive weights only (the range must still include
0). A slip is named only when it reproduces the student's output and the right answer does
not. The package rounds scales to fp16 (so a saved file dequantizes exactly); a student who
keeps fp32 scales is accepted too.
"""
from __future__ import annotations

from .core import Case, _Difference, register

__all__ = ["rtn_group", "gptq_columns", "awq_scale", "WORKED_EXAMPLE", "reference_rtn_group",
           "reference_gptq_columns", "gptq_inputs", "reference_awq_scale"]

WORKED_EXAMPLE = (0.12, -0.83, 0.45, -0.21)


# --------------------------------------------------------------------------- helpers


def _as_tensor(case: Case, value, like, what: str):
    import torch

    if isinstance(value, (int, float)) and like.numel() == 1:
        value = torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise _Difference(f"{what}: expected a tensor of shape {tuple(like.shape)}, got "
                          f"{type(value).__name__}.")
    if value.numel() == like.numel() and value.shape != like.shape:
        value = value.reshape(like.shape)  # [rows] for [rows, 1] is fine
    if value.shape != like.shape:
        raise _Difference(f"{what}: expected shape {tuple(like.shape)}, got {tuple(value.shape)}.")
    return value.double()


def _close(a, b, atol=1e-6, rtol=1e-5) -> bool:
    import torch

    return bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol))


def _first_diff(yours, ref, what: str) -> str:
    i = int((yours.double() - ref.double()).abs().flatten().argmax())
    return (f"{what} differs from the reference: at flat index {i} yours is "
            f"{float(yours.flatten()[i]):.6g}, the reference {float(ref.flatten()[i]):.6g}.")


# --------------------------------------------------------------------------- exercise 1: RTN


def reference_rtn_group(w, bits: int, sym: bool, fp16_scale: bool = True, *, qmax=None,
                        include_zero: bool = True, zero_point: bool = True, rounding=None):
    """(q, scale, zero) for each row of w as one group; the keyword arguments make the slips
    the check names (defaults: the right answer, equal to ``minillm.quant.rtn``)."""
    import torch

    rounding = rounding or torch.round
    w = w.double()
    if sym:
        top = (2 ** (bits - 1) - 1) if qmax is None else qmax
        scale = w.abs().amax(-1, keepdim=True) / top
        zero = torch.zeros_like(scale)
        lo_q, hi_q = -top, top
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        if include_zero:
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        top = (2 ** bits - 1) if qmax is None else qmax
        scale = (hi - lo) / top
        lo_q, hi_q = 0, 2 ** bits - 1
    if fp16_scale:
        scale = scale.half().double()
    if not sym:
        zero = rounding(-lo / scale).clamp(0, 2 ** bits - 1) if zero_point else torch.zeros_like(scale)
    q = torch.clamp(rounding(w / scale) + zero, lo_q, hi_q)
    return q, scale, zero


@register(cases=5, nudge=(
    "The message names the case (symmetric or asymmetric, the bits, the row) and the first of q, "
    "scale and zero that differs. Work that row by hand: its range, its step, where its extreme "
    "value lands on the grid."), concept=(
    "A grid of integer levels is stretched over each group: the step (scale) is chosen so that the "
    "group's extreme value lands exactly on the last level, which makes every rounding error at "
    "most half a step. Symmetric grids are centred on 0 and use the levels that have a mirror; "
    "asymmetric grids shift all 2^b levels to cover the group's own range, which must still "
    "contain 0, through an integer zero point. Integers that fall outside the grid are clamped."))
def rtn_group(case: Case, fn) -> None:
    """Your rtn_group(w, bits, sym) -> (q, scale, zero): each row of w [rows, n] is one group;
    ŵ = (q − zero) · scale, scale and zero of shape [rows, 1], q integers on the grid
    (symmetric: zero = 0; asymmetric: a range that includes 0, all 2^b levels)."""
    import torch

    from minillm import quant

    if case.index < 2:
        w, bits, sym = torch.tensor([WORKED_EXAMPLE]), 4, case.index == 0
    else:
        rows, n = case.size(2, 5), case.choice([4, 8, 16, 32])
        w, bits, sym = case.randn(rows, n) * 0.1, case.choice([3, 4, 8]), case.index % 2 == 1
        if not sym:
            w[0] = w[0].abs() + 0.01  # a group of positive weights only
    ref = quant.rtn(w.float(), bits, None, sym)
    q_ref, s_ref, z_ref = reference_rtn_group(w, bits, sym)
    assert torch.equal(q_ref, ref.q.double()) and torch.equal(s_ref, ref.scale.double()), "oracle drift"
    out = case.call(fn, w.clone(), bits, sym)
    case.expect(isinstance(out, tuple) and len(out) == 3,
                f"return a tuple (q, scale, zero), got {type(out).__name__}: q the integers "
                f"[rows, n], scale and zero one per row [rows, 1].")
    kind = "symmetric" if sym else "asymmetric"
    q = _as_tensor(case, out[0], q_ref, f"q ({kind}, {bits} bits)")
    s = _as_tensor(case, out[1], s_ref, f"scale ({kind}, {bits} bits)")
    z = _as_tensor(case, out[2], z_ref, f"zero ({kind}, {bits} bits)")
    where = f"({kind}, {bits} bits, w = {[round(x, 4) for x in w[0].tolist()][:6]}{'...' if w.shape[1] > 6 else ''})"
    for fp16 in (True, False):
        q_r, s_r, z_r = reference_rtn_group(w, bits, sym, fp16)
        if _close(s, s_r, atol=0, rtol=1e-6 if fp16 else 1e-5) and torch.equal(q, q_r) and torch.equal(z, z_r):
            return
    slips = []
    if sym:
        slips += [
            (dict(qmax=2 ** bits - 1), f"your scale is about half the reference's: the symmetric grid "
             f"at {bits} bits is −{2 ** (bits - 1) - 1} … {2 ** (bits - 1) - 1}, and the largest |w| "
             f"must land on its top level, not on the top of an unsigned grid."),
            (dict(qmax=2 ** (bits - 1)), f"your largest |w| lands one level past the top of the "
             f"symmetric grid (−{2 ** (bits - 1) - 1} … {2 ** (bits - 1) - 1}): the step is slightly "
             f"too small, and that weight gets clamped."),
            (dict(rounding=torch.floor), "use round-to-nearest (torch.round), not floor: truncation "
             "doubles the worst error and biases every weight downwards."),
            (dict(rounding=torch.trunc), "use round-to-nearest (torch.round), not truncation toward 0."),
        ]
    else:
        slips += [
            (dict(include_zero=False), "your range stops at the group's own minimum and maximum: it "
             "must include 0, or a group of positive weights cannot represent 0 and its zero point "
             "falls outside the integer range."),
            (dict(zero_point=False), "your asymmetric grid has no zero point: its integers start at 0 "
             "for the group's lowest value, so the integer that stands for w = 0 must be added."),
            (dict(qmax=2 ** (bits - 1) - 1), f"your step is about twice the reference's: the "
             f"asymmetric grid uses all 2^b = {2 ** bits} levels at {bits} bits."),
            (dict(rounding=torch.floor), "use round-to-nearest (torch.round), not floor."),
        ]
    for kwargs, message in slips:
        for fp16 in (True, False):
            q_r, s_r, z_r = reference_rtn_group(w, bits, sym, fp16, **kwargs)
            if torch.equal(q, q_r) and _close(s, s_r, atol=0, rtol=1e-5) and not torch.equal(q_r, q_ref):
                raise _Difference(f"{where}: {message}")
    s_any = [reference_rtn_group(w, bits, sym, fp16)[1] for fp16 in (True, False)]
    if not any(_close(s, x, atol=0, rtol=1e-5) for x in s_any):
        raise _Difference(f"{where}: scale is {[round(x, 6) for x in s.flatten().tolist()]}, expected "
                          f"{[round(x, 6) for x in s_ref.flatten().tolist()]}, one per row: the step that "
                          f"puts the row's extreme value on the grid's last level.")
    if not any(torch.equal(z, reference_rtn_group(w, bits, sym, fp16)[2]) for fp16 in (True, False)):
        raise _Difference(f"{where}: zero is {z.flatten().tolist()}, expected {z_ref.flatten().tolist()}"
                          + (": symmetric quantization has zero = 0." if sym else
                             ": the zero point is the integer that stands for w = 0, within 0 … 2^b − 1."))
    lo_q, hi_q = quant.weights.qrange(bits, sym)
    if q.min() < lo_q or q.max() > hi_q:
        raise _Difference(f"{where}: q holds {int(q.min())} … {int(q.max())}, outside {lo_q} … {hi_q}: "
                          f"clamp after rounding.")
    if not torch.equal(q, q.round()):
        raise _Difference(f"{where}: q must hold integers: round(w / scale) (+ zero).")
    raise _Difference(f"{where}: " + _first_diff(q, q_ref, "q"))


# --------------------------------------------------------------------------- exercise 2: GPTQ


def gptq_inputs(w, H, bits: int, sym: bool, percdamp: float = 0.01):
    """What the exercise receives, computed as ``quant.gptq`` does: (U, scale, zero) with U the
    upper Cholesky factor of the damped H⁻¹, and scale/zero one group per row of w [out, 1]."""
    import torch

    from minillm.quant.weights import group_params

    H = H.double().clone()
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    scale, zero = group_params(w.float(), bits, sym)
    return U, scale.double(), zero.double()


def reference_gptq_columns(W, U, scale, zero, bits: int, sym: bool, *, feedback: bool = True,
                           divide: bool = True, sign: float = 1.0):
    """The loop of the exercise (keywords: the slips the check names)."""
    import torch

    from minillm.quant.weights import quantize_with

    W = W.double().clone()
    Q = torch.zeros_like(W)
    for i in range(W.shape[1]):
        col = W[:, i:i + 1]
        q = quantize_with(col, scale, zero, bits, sym).double()
        Q[:, i] = q[:, 0]
        if feedback:
            err = (col - (q - zero) * scale) / (U[i, i] if divide else 1.0)
            W[:, i:] -= sign * err @ U[i:i + 1, i:]
    return Q


@register(cases=4, nudge=(
    "The message says how far your Q agrees with the reference (the first column that differs) or "
    "which part of the update it recognised as missing or turned around."), concept=(
    "GPTQ rounds one column at a time and lets the columns not yet rounded absorb that column's "
    "error, in proportion to how their inputs correlate with its input: the inverse Hessian holds "
    "those proportions, and its Cholesky factor U hands them out one row per step, its diagonal "
    "entry setting the scale. Each column is rounded as it is after all earlier corrections."))
def gptq_columns(case: Case, fn) -> None:
    """Your gptq_columns(W, U, scale, zero, bits, sym) -> Q: quantize W [out, in] column by
    column on the fixed grid (scale, zero [out, 1]), correcting the later columns after each
    one through row i of U; Q is the integers, equal to quant.gptq's."""
    import torch

    from minillm import quant

    out_f, in_f = case.size(3, 10), case.size(6, 16)
    bits, sym = case.choice([3, 4]), case.index % 2 == 0
    W = case.randn(out_f, in_f).double() * 0.1
    mix = torch.eye(in_f, dtype=torch.float64) + 0.8 * case.randn(in_f, in_f).double() / in_f ** 0.5
    X = case.randn(4 * in_f, in_f).double() @ mix  # correlated inputs, so columns couple
    H = quant.hessian(X)
    U, scale, zero = gptq_inputs(W, H, bits, sym)
    ref = quant.gptq(W.float(), H, bits, None, sym, percdamp=0.01, blocksize=in_f)
    Q_ref = reference_gptq_columns(W, U, scale, zero, bits, sym)
    assert torch.equal(Q_ref, ref.q.double()), "oracle drift: the loop is not quant.gptq"
    out = case.call(fn, W.clone(), U.clone(), scale.clone(), zero.clone(), bits, sym)
    Q = _as_tensor(case, out, Q_ref, "Q")
    if torch.equal(Q, Q_ref):
        return
    where = f"(W {out_f}×{in_f}, {bits} bits, {'symmetric' if sym else 'asymmetric'})"
    if not torch.equal(Q, Q.round()):
        raise _Difference(f"{where}: return the integers Q (quantize_with(...)), not the "
                          f"dequantized weights.")
    slips = [
        (dict(feedback=False), "this is plain RTN: every column was rounded on its own, and no "
                               "column's error reached the columns after it."),
        (dict(divide=False), "the correction is off by a factor per column: the error was not "
                             "scaled by row i's diagonal entry of U, so each later column gets the "
                             "wrong share."),
        (dict(sign=-1.0), "the update has the wrong sign: the later columns moved in the same "
                          "direction as column i's error, adding to it instead of making up for it."),
    ]
    for kwargs, message in slips:
        if torch.equal(Q, reference_gptq_columns(W, U, scale, zero, bits, sym, **kwargs)):
            raise _Difference(f"{where}: {message}")
    first = int((Q != Q_ref).any(0).nonzero()[0])
    raise _Difference(f"{where}: columns 0..{first - 1} match, column {first} differs (yours "
                      f"{Q[:, first].long().tolist()}, reference {Q_ref[:, first].long().tolist()}). "
                      + ("Column 0 has no earlier error to absorb: it is plain rounding on the grid."
                         if first == 0 else
                         "Check the update after each column: it must use the error of the weight as "
                         "it was when rounded (already corrected by the earlier columns)."))


# --------------------------------------------------------------------------- exercise 3: AWQ


def reference_awq_scale(w, x, bits: int, group_size: int, sym: bool = False, grid: int = 20):
    """(s, alpha, errors) by ``quant.awq.search_scale`` for one linear layer y = x wᵀ."""
    import torch.nn.functional as F

    from minillm.quant import awq

    x2 = x.reshape(-1, x.shape[-1])
    act = x2.abs().mean(0)
    return awq.search_scale([w], act, lambda ws: F.linear(x2, ws[0]), F.linear(x2, w), bits,
                            group_size, sym, grid)


def _awq_variant(w, x, bits, group_size, stat="mean_abs", normalise=True, multiply=True, pick=min):
    import torch
    import torch.nn.functional as F

    from minillm.quant.awq import fake_quantize

    x2 = x.reshape(-1, x.shape[-1])
    act = {"mean_abs": x2.abs().mean(0), "max_abs": x2.abs().amax(0),
           "mean": x2.mean(0).abs()}[stat]
    ref = F.linear(x2, w)
    errs = []
    for i in range(20):
        a = i / 20
        s = act.clamp(min=1e-4).pow(a)
        if normalise:
            s = s / (s.max() * s.min()).sqrt()
        trial = fake_quantize(w * s, bits, group_size, False) / s if multiply else \
            fake_quantize(w / s, bits, group_size, False) * s
        errs.append((float((F.linear(x2, trial) - ref).pow(2).mean()), a, s))
    best = pick(errs, key=lambda e: e[0])
    return best[2], best[1]


@register(cases=3, nudge=(
    "The message names the slip it recognised, or the α you picked against the reference's with "
    "the reference's error at both: rerun your search and print its error for every α."), concept=(
    "Scaling input channel j of w up by s_j (and its input down by s_j, folded into the previous "
    "op) leaves the layer's output unchanged in exact arithmetic but shrinks that channel's "
    "rounding error. AWQ ranks channels by how loud their inputs are on average and searches one "
    "exponent that trades protecting the loud channels against resolution for the quiet ones; a "
    "setting is judged by the layer's output on real inputs, never by its weights."))
def awq_scale(case: Case, fn) -> None:
    """Your awq_scale(w, x, bits, group_size) -> (s, alpha): the grid search of the lab's text
    (α = 0, 0.05, …, 0.95; scales from mean|x|, normalised; asymmetric RTN), keeping the α whose
    fake-quantized output on x is closest to the float output."""
    import torch

    out_f, g = case.size(8, 24), case.choice([16, 32])
    in_f = g * case.size(2, 4)
    bits = case.choice([3, 4])
    w = case.randn(out_f, in_f) * 0.05
    spread = torch.ones(in_f)
    loud = torch.randperm(in_f, generator=case.gen)[:max(1, in_f // 16)]
    spread[loud] = 20.0 + 30.0 * case.rand(len(loud))  # a few outlier channels, as in real models
    x = case.randn(case.size(24, 64), in_f) * spread
    s_ref, a_ref, errors = reference_awq_scale(w, x, bits, g)
    out = case.call(fn, w.clone(), x.clone(), bits, g)
    case.expect(isinstance(out, tuple) and len(out) == 2,
                f"return a pair (s, alpha): the best scales [in_features] and their α, got "
                f"{type(out).__name__}.")
    s = _as_tensor(case, out[0], s_ref, "s")
    try:
        alpha = float(out[1])
    except (TypeError, ValueError):
        raise _Difference(f"alpha must be a number (the chosen exponent), got {out[1]!r}.") from None
    where = f"(w {out_f}×{in_f}, x {tuple(x.shape)}, {bits} bits, g{g}; the reference picks α = {a_ref:.2f})"
    if abs(alpha - a_ref) < 1e-9 and _close(s, s_ref, atol=1e-6, rtol=1e-4):
        return
    slips = [
        (dict(stat="max_abs"), "your saliency is each channel's peak |x|; AWQ ranks channels by how "
                               "large they are on average over the tokens."),
        (dict(stat="mean"), "your saliency averages signed activations, which cancel: use magnitudes."),
        (dict(normalise=False), "your scales are not normalised: they must straddle 1, as the lab's "
                                "text describes, so that the search's α = 0 is exactly RTN."),
        (dict(pick=max), "you kept the α with the largest output error."),
        (dict(multiply=False), "your scales shrink the salient channels before rounding: AWQ "
                               "enlarges them (and undoes it after rounding)."),
    ]
    for kwargs, message in slips:
        s_v, a_v = _awq_variant(w, x, bits, g, **kwargs)
        if abs(alpha - a_v) < 1e-9 and _close(s, s_v, atol=1e-6, rtol=1e-4) and not (
                abs(a_v - a_ref) < 1e-9 and _close(s_v, s_ref, atol=1e-6, rtol=1e-4)):
            raise _Difference(f"{where}: {message}")
    if abs(alpha - a_ref) > 1e-9:
        mine = [e for i, e in enumerate(errors) if abs(i / 20 - alpha) < 1e-9]
        raise _Difference(f"{where}: you picked α = {alpha:.2f}"
                          + (f" (reference error {mine[0]:.3g} there, against {min(errors):.3g} at "
                             f"α = {a_ref:.2f})" if mine else " (not on the grid 0, 0.05, …, 0.95)")
                          + ". Check how you score each α (the mean squared difference of the outputs on "
                            "x) and the clamp of the saliency before the power.")
    raise _Difference(f"{where}: α is right but " + _first_diff(s, s_ref, "s")
                      + " Check the clamp before the power and the normalisation.")
