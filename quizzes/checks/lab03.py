"""Lab 03 checks: the online-softmax update, tiled attention in PyTorch, and the inner loop
of a FlashAttention kernel in Triton.

    check.online_softmax_update(online_softmax_update)   # (m, l, acc, scores, v) -> (m, l, acc)
    check.tiled_attention(tiled_attention)               # (q, k, v, causal, block_n) -> out
    check.flash_inner_loop(attn_inner_loop)              # a @triton.jit loop, run in the lab kernel

Oracles: ``minillm.kernels.tiled.online_softmax_update`` and ``naive_attention`` in float64.
When a result differs, the check recomputes the usual mistakes on the same inputs and with
the same tiles (a missed rescale, the block max instead of the running max, an off-by-one
causal mask, a wrong scale, a skipped last tile, unmasked padding keys ...). If the
student's numbers match one of them, the message names it and says what to write;
otherwise it shows yours vs reference with the mismatching rows marked.

Invariants: inputs are fresh random numbers (never zeros) on every call; the update check
includes blocks whose rows are all −inf (fully masked) and a block that raises the max;
the attention checks run causal and non-causal with T not a multiple of the tile (at
least in the first case). A mistake is only named when it reproduces the student's
output everywhere it is defined and differs from the reference.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import warnings

import numpy as np

from .core import Case, _Difference, register
from .mismatch import show_mismatch

__all__ = ["online_softmax_update", "tiled_attention", "flash_inner_loop"]

_UPD_TOL = dict(atol=1e-5, rtol=1e-4)
_ATT_TOL = dict(atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- helpers


def _isclose(a, b, atol: float, rtol: float):
    import torch

    return torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=True)


def _same(a, b, atol: float, rtol: float) -> bool:
    return tuple(a.shape) == tuple(b.shape) and bool(_isclose(a, b, atol, rtol).all())


def _reproduces(yours, variant, reference, atol: float, rtol: float) -> bool:
    """Does ``variant`` (a known mistake) explain ``yours``? It must equal yours wherever
    the variant is a number, and differ from the reference somewhere there."""
    import torch

    if tuple(yours.shape) != tuple(variant.shape):
        return False
    defined = ~torch.isnan(variant.double())
    if not bool(defined.any()):
        return False
    if bool(_isclose(variant[defined], reference[defined], atol, rtol).all()):
        return False  # this mistake would not show on these inputs
    return bool(_isclose(yours[defined], variant[defined], atol, rtol).all())


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _nan_note(yours, reference) -> str:
    import torch

    if _is_tensor(yours) and bool(torch.isnan(yours).any()) and not bool(torch.isnan(reference).any()):
        return ("\n  yours has NaN where the reference has numbers: exp(−inf − (−inf)) is NaN, and so "
                "is 0 / 0. A row that has seen only −inf scores must keep m = −inf, l = 0, acc = 0.")
    return ""


# --------------------------------------------------------------------------- 1. the update


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


_ALPHA = "alpha = exp(m − m_new), which is ≤ 1"


def _update_mistakes(field: str, x: dict) -> list[tuple[str, object]]:
    """(message, value of ``field`` under that mistake) for the usual mistakes."""
    import torch

    if field == "m":
        return [
            ("m is the max of this block only. The running max must also remember the old one: "
             "m_new = torch.maximum(m, scores_block.amax(dim=-1)).", x["s"].amax(dim=-1)),
            ("m did not change. Return the new running max, "
             "m_new = torch.maximum(m, scores_block.amax(dim=-1)).", x["m"]),
            ("m is 0 for rows that have seen only −inf scores; it must stay −inf there (the max "
             "of nothing). Use 0 in place of −inf only inside exp(), and return m_new itself.",
             x["m_safe"]),
        ]
    if field == "l":
        return [
            ("l was not rescaled. The old sum was taken relative to the old max m; when the max "
             f"grows to m_new, multiply it by {_ALPHA}, before adding this block: "
             "l_new = l * alpha + p.sum(dim=-1).", x["l"] + x["p"].sum(-1)),
            ("alpha is upside down: the old terms shrink when the max grows, so "
             f"{_ALPHA}, not exp(m_new − m).", x["l"] * x["inv_alpha"] + x["p"].sum(-1)),
            ("l counts this block only: the running sum must keep the old blocks, rescaled: "
             "l_new = l * alpha + p.sum(dim=-1).", x["p"].sum(-1)),
        ]
    return [
        ("acc was not rescaled. It was accumulated relative to the old max m; when the max grows "
         f"to m_new, multiply it by {_ALPHA}: acc_new = acc * alpha[..., None] + p @ v_block.",
         x["acc"] + x["pv"]),
        ("alpha is upside down: the old terms shrink when the max grows, so "
         f"{_ALPHA}, not exp(m_new − m).", x["acc"] * x["inv_alpha"][..., None] + x["pv"]),
        ("acc holds this block only: keep the old blocks, rescaled: "
         "acc_new = acc * alpha[..., None] + p @ v_block.", x["pv"]),
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
                "exp(−inf − (−inf)) = exp(NaN). Take exponents relative to 0 for such rows: "
                "m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new), use m_safe "
                "inside both exp() calls, and return m_new itself (still −inf).")
    if bool((nan_rows & first).any()) and not bool((nan_rows & ~dead & ~first).any()):
        return ("NaN in rows that see their first real score in this block (m was −inf). There "
                "alpha = exp(m − m_new) = exp(−inf) = 0 and l · alpha = 0; NaN means alpha was inf "
                "(0 · inf): is alpha upside down? It must be exp(m − m_new) ≤ 1, not exp(m_new − m).")
    return ("NaN where the reference has numbers: exp(−inf − (−inf)) and 0 · inf are both NaN. "
            "Check the rows whose m is −inf (before or after this block).")


@register(cases=3)
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


# --------------------------------------------------------------------------- 2. attention


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
    rescale_acc = ("acc = acc * alpha[:, None] + tl.dot(p, v)" if tri
                   else "acc = acc * alpha[..., None] + p @ v_tile (your online_softmax_update)")
    rescale_l = "l_i = l_i * alpha + tl.sum(p, 1)" if tri else "l = l * alpha + p.sum(-1) (your online_softmax_update)"
    offs = "offs_n = start_n + tl.arange(0, BLOCK_N)" if tri else "j = n0 + torch.arange(n1 - n0)"
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
        (f"acc was not rescaled when the running max grew: {rescale_acc}, with alpha = exp(m_old − m_new).",
         walk(update="no_rescale_acc")),
        (f"l was not rescaled when the running max grew: {rescale_l}, with alpha = exp(m_old − m_new).",
         walk(update="no_rescale_l")),
        ("the running max forgot the old max: m_new = maximum(m_old, rowmax(scores)), not the tile's "
         "max alone.", walk(update="block_max")),
        ("the output was multiplied by K instead of V: accumulate p @ v_tile.",
         _walk(q, k, k, causal, scale, block_n, **kw)),
    ]
    if t % block_n:
        if tri:
            out.append((f"keys past the end of the sequence (the padding of the last tile: T = {t} is not a "
                        f"multiple of {block_n}) took part in the softmax; they were loaded as 0 but not "
                        "masked. Mask the scores with offs_n < seq_len (to −inf) as well.",
                        walk(pad_tail=True)))
        else:
            out.append((f"the last, shorter tile was skipped (T = {t} is not a multiple of block_n = "
                        f"{block_n}): loop over range(0, S, block_n) and cut each tile at min(n0 + "
                        "block_n, S).", walk(skip_tail=True)))
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
        new_max = "tl.maximum(m_i, tl.max(s, 1))" if lang == "triton" else "torch.maximum(m, scores.amax(-1))"
        raise _Difference(
            f"{what}: yours overflowed to inf/NaN. Scores here reach ~150, and exp() overflows "
            "float32 above 88. Every exponent must be relative to the running max: "
            f"m_new = {new_max} is at least every score seen so far, so alpha = exp(m_old − m_new) "
            "≤ 1 and p = exp(s − m_new) ≤ 1. (The max of this tile alone is not enough: the old "
            f"tiles' max can be far larger.)\n{view.text()}")
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


@register(cases=3)
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


# --------------------------------------------------------------------------- 3. Triton


_STUB = re.compile(r"^\s*raise\s+NotImplementedError\s*\((.*)\)\s*$", re.MULTILINE)


def _source(fn) -> str:
    try:
        return inspect.getsource(getattr(fn, "fn", fn))
    except (OSError, TypeError):
        return getattr(fn, "src", "") or ""


def _stub_hint(fn) -> str | None:
    """The hint of a ``raise NotImplementedError("...")`` stub in fn's source, else None.

    Triton cannot compile a raise, so the stub is detected here and never launched."""
    m = _STUB.search(_source(fn))
    if m is None:
        return None
    try:
        return str(ast.literal_eval(m.group(1))) if m.group(1).strip() else ""
    except (ValueError, SyntaxError):
        return ""


def _unwrap_interpreter_error(exc: BaseException) -> BaseException:
    """Triton's interpreter wraps errors raised inside a kernel; return the original."""
    if type(exc).__name__ == "InterpreterError":
        inner = exc.__cause__ or exc.__context__
        while inner is not None and type(inner).__name__ == "InterpreterError":
            inner = inner.__cause__ or inner.__context__
        if inner is not None:
            return inner
    return exc


def _tolerance_for_device() -> dict:
    from minillm.kernels import interpreter_enabled

    # Compiled on a GPU an fp32 tl.dot runs on TF32 tensor cores (~1e-3 relative error);
    # the interpreter computes in exact fp32.
    return dict(_ATT_TOL) if interpreter_enabled() else dict(atol=2e-2, rtol=2e-2)


@register(cases=3)
def flash_inner_loop(case: Case, fn) -> None:
    """Your @triton.jit attn_inner_loop, run inside minillm's lab kernel
    (minillm.kernels.lab.flash_attention_lab, 16 x 16 tiles), against naive attention
    (float64), causal and not; T is not a multiple of 16 in the first case, and the last
    case has one very large score per row (overflow safety)."""
    import torch

    from minillm.kernels import interpreter_enabled, naive_attention
    from minillm.kernels.lab import LAB_BLOCK_M, LAB_BLOCK_N, flash_attention_lab, is_triton_function

    hint = _stub_hint(fn)
    if hint is not None:
        raise NotImplementedError(hint)
    case.expect(callable(fn) and is_triton_function(fn),
                f"expected your inner loop, a function decorated with @triton.jit; got "
                f"{type(fn).__name__}. Put @triton.jit on the line above `def attn_inner_loop(...)`, "
                "run that cell, and pass the function itself: check.flash_inner_loop(attn_inner_loop).")
    h, d = case.size(1, 2), case.choice([16, 32])
    t = case.size(LAB_BLOCK_M + 1, 3 * LAB_BLOCK_M)
    if case.index == 0 and t % LAB_BLOCK_N == 0:
        t -= 1
    device = "cpu" if interpreter_enabled() else "cuda"
    big = case.index == case.total - 1
    q, k, v = _attention_inputs(case, 1, h, t, d, big, device)
    scale = 1.0 / math.sqrt(d)
    tol = _tolerance_for_device()

    def run_lab_kernel(q, k, v, causal):
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy NaN noise
                return flash_attention_lab(q, k, v, fn, causal=causal)
        except Exception as exc:  # show the student's own error, not the interpreter's wrapper
            inner = _unwrap_interpreter_error(exc)
            if inner is exc:
                raise
            raise inner from None

    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    for causal in (True, False):
        ref = naive_attention(qc.double(), kc.double(), vc.double(), causal=causal).float()
        yours = case.call(run_lab_kernel, q, k, v, causal)
        yours = yours.cpu() if _is_tensor(yours) else yours
        hi = None
        if causal:  # the scaffold's loop bound: query row i walks tiles below min(start_m + BLOCK_M, T)
            hi = torch.clamp((torch.arange(t) // LAB_BLOCK_M + 1) * LAB_BLOCK_M, max=t)
        _compare_attention(case, yours, ref,
                           lambda: _attention_mistakes(qc, kc, vc, causal, scale, LAB_BLOCK_N, "triton", hi),
                           f"output (causal={causal}, T={t}, D={d}{', large scores' if big else ''})",
                           tol, big, "triton")
