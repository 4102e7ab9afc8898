"""Lab 01 checks: the formulas of the roofline, derived by the student.

    check.decode_ceiling(decode_tokens_per_s)    # (num_params, dtype_bytes, bandwidth, kv_bytes) -> tok/s
    check.matvec_intensity(matvec_intensity)     # (rows, cols, dtype_bytes) -> FLOPs/byte
    check.matmul_intensity(matmul_intensity)     # (m, n, k, dtype_bytes) -> FLOPs/byte
    check.ridge_point(ridge_point)               # (peak_flops, bandwidth) -> FLOPs/byte
    check.decode_crossover_batch(decode_crossover_batch)  # (flops_per_seq, weight_bytes, kv_bytes_per_seq, ridge) -> B

Oracles: the functions of the same names in ``minillm.calc``. The lab prints none of these
formulas before its exercise: the student derives each from what the lab states (what a
token must read, how FLOPs and bytes are counted, where the two roofs meet). Inputs are random and span
real sizes (10⁸..10¹² parameters, fp32 to int4, 10 GB/s..5 TB/s), so a hard-coded number
or unit cannot pass. When an answer is wrong, the check tries the usual slips on the same
inputs (a missing dtype_bytes, a multiply-add counted as one FLOP, a ratio upside down,
the vector left out of the bytes ...) and names the one that reproduces it.

Invariant: a slip is named only when it reproduces the student's number within the
tolerance and the correct formula does not. No message, nudge or concept states a formula
the student is asked to derive: a slip's message says what is off (a missing term, a factor,
units, a ratio upside down), the nudge where to look, the concept the idea.
"""

from __future__ import annotations

import math

from .core import Case, _Difference, register

__all__ = ["decode_ceiling", "matvec_intensity", "matmul_intensity", "ridge_point", "decode_crossover_batch"]

_RTOL = 1e-6


def _number(case: Case, yours, what: str, allow_inf: bool = False) -> float:
    """The student's result as a float, or a clear message if it is not one number."""
    try:
        import torch

        if isinstance(yours, torch.Tensor) and yours.numel() == 1:
            yours = yours.item()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(yours, bool) or not isinstance(yours, (int, float)) and not hasattr(yours, "__float__"):
        raise _Difference(f"{what}: expected one number (a float), got {type(yours).__name__} {yours!r}. "
                          "Return the number itself (a float), not a string or a tuple.")
    value = float(yours)
    if math.isinf(value) and value > 0 and allow_inf:
        return value
    if not math.isfinite(value):
        raise _Difference(f"{what}: expected a finite number, got {value}.")
    return value


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _RTOL * abs(b) + 1e-12


def _judge(case: Case, yours, ref: float, what: str, slips: list[tuple[float, str]]) -> None:
    value = _number(case, yours, what)
    if _close(value, ref):
        return
    for candidate, message in slips:
        if _close(value, candidate) and not _close(candidate, ref):
            raise _Difference(f"{what}: expected {ref:.6g}, got {value:.6g}. {message}")
    ratio = value / ref if ref else float("nan")
    raise _Difference(f"{what}: expected {ref:.6g}, got {value:.6g} (yours is {ratio:.4g} × the reference; "
                      f"allowed relative error {_RTOL:g}).")


def _log_uniform(case: Case, low: float, high: float) -> float:
    return float(10 ** case.rng.uniform(math.log10(low), math.log10(high)))


@register(
    cases=4,
    nudge="Count what one token must read from memory, in bytes, then ask how many such reads fit "
          "in one second.",
    concept="At batch 1 nothing a token reads stays in a cache until the next token: every weight, "
            "and the KV cache on top, crosses the memory bus once per token. The bus moves a fixed "
            "number of bytes per second, and that alone caps the token rate, whatever the FLOP/s.")
def decode_ceiling(case: Case, fn) -> None:
    """Your decode_tokens_per_s(num_params, dtype_bytes, bandwidth_bytes_per_s, kv_bytes): the
    bandwidth-bound ceiling of batch-1 decode when each token reads every weight once and
    kv_bytes of KV cache (0 in the first case)."""
    from minillm import calc

    n = _log_uniform(case, 1e8, 1e12)
    db = case.choice([4, 2] if case.index == 0 else [4, 2, 1, 0.5])  # case 1 exposes a missing dtype_bytes
    bw = _log_uniform(case, 1e10, 5e12)
    kv = 0.0 if case.index == 0 else n * db * case.rng.uniform(0.05, 0.5)  # a KV cache of 5-50% of the weights
    ref = calc.decode_tokens_per_s(n, db, bw, kv)
    yours = case.call(fn, n, db, bw, kv)
    _judge(case, yours, ref, f"tok/s (kv_bytes = {kv:.4g})", [
        (bw / (n * db), "You left out the KV cache: each token reads kv_bytes on top of the weights."),
        (bw / ((n + kv) * db), "kv_bytes is already in bytes: only the weights need converting from "
                               "parameters to bytes."),
        (bw / (n + kv), "You left out dtype_bytes: num_params counts weights, not bytes."),
        (bw * db / (n + kv), "dtype_bytes belongs with the bytes read, not with the bandwidth."),
        (bw * db / n, "dtype_bytes belongs with the bytes read, not with the bandwidth."),
        ((n * db + kv) / bw, "Upside down: that is seconds per token."),
        (n * db / bw, "Upside down: that is seconds per token."),
        (ref / 2, "No factor 2 here: 2 FLOPs per parameter is compute; this ceiling counts bytes."),
        (ref / 1e9, "Off by 10⁹: keep everything in bytes and bytes/s (no GB conversion inside)."),
    ])


@register(
    cases=4,
    nudge="Count the FLOPs of the product (how many multiply-adds, and how many FLOPs is one?), then "
          "the bytes of every array it reads or writes, each once.",
    concept="Arithmetic intensity is work per byte of traffic: FLOPs over bytes moved, assuming each "
            "operand crosses memory exactly once. For a matrix-vector product the matrix dominates "
            "both counts, so the ratio is nearly fixed by the element size.")
def matvec_intensity(case: Case, fn) -> None:
    """Your matvec_intensity(rows, cols, dtype_bytes): FLOPs per byte of y = W·x with W of
    shape rows×cols, every operand read once and y written once."""
    from minillm import calc

    r, c = case.size(2, 400), case.size(2, 400)
    db = case.choice([4, 2] if case.index == 0 else [4, 2, 1])
    ref = calc.matvec_intensity(r, c, db)
    yours = case.call(fn, r, c, db)
    flops = 2 * r * c
    _judge(case, yours, ref, f"intensity of a {r}×{c} matvec ({db}-byte elements)", [
        (flops / (r * c * db), "You counted only W's bytes: x is read and y is written too. It matters "
                               "for small matrices like these."),
        (ref / 2, "Half the reference: a multiply-add is 2 FLOPs."),
        (1 / ref, "Upside down: intensity is FLOPs per byte."),
        (flops / (r * c + c + r), "You counted elements, not bytes: dtype_bytes is missing."),
    ])


@register(
    cases=4,
    nudge="The same counting as the matvec, with three matrices: which are read, which is written, "
          "and how many multiply-adds make C?",
    concept="When m tokens share one weight matrix it is still read once, so the FLOPs grow with m "
            "while the bytes barely do: that is why batching raises intensity.")
def matmul_intensity(case: Case, fn) -> None:
    """Your matmul_intensity(m, n, k, dtype_bytes): FLOPs per byte of C[m×n] = A[m×k]·B[k×n],
    every operand read once and C written once."""
    from minillm import calc

    m, n, k = case.size(1, 512), case.size(2, 600), case.size(2, 600)
    db = case.choice([4, 2] if case.index == 0 else [4, 2, 1])
    ref = calc.matmul_intensity(m, n, k, db)
    yours = case.call(fn, m, n, k, db)
    flops = 2 * m * n * k
    _judge(case, yours, ref, f"intensity of a {m}×{k} · {k}×{n} matmul ({db}-byte elements)", [
        (flops / (k * n * db), "You counted only B's bytes (the weights): A is read and C written too."),
        (flops / ((m * k + k * n) * db), "You left out writing C: the output crosses memory too."),
        (ref / 2, "Half the reference: a multiply-add is 2 FLOPs."),
        (1 / ref, "Upside down: intensity is FLOPs per byte."),
        (flops / (m * k + k * n + m * n), "You counted elements, not bytes: dtype_bytes is missing."),
    ])


@register(
    cases=4,
    nudge="Write the memory roof's FLOP/s at intensity I, set it equal to the compute roof, and "
          "solve for I. Check the units: FLOPs per byte.",
    concept="Below the ridge, FLOP/s grow with intensity because bytes are the bottleneck; above it, "
            "the arithmetic units are. The ridge is the one intensity at which both are saturated.")
def ridge_point(case: Case, fn) -> None:
    """Your ridge_point(peak_flops, bandwidth_bytes_per_s): the intensity (FLOPs/byte) where
    the roofline turns from the bandwidth slope to the flat compute roof."""
    from minillm import calc

    peak = _log_uniform(case, 1e10, 2e15)
    bw = _log_uniform(case, 1e10, 5e12)
    ref = calc.ridge_point(peak, bw)
    yours = case.call(fn, peak, bw)
    _judge(case, yours, ref, "ridge point", [
        (bw / peak, "Upside down: the ridge is in FLOPs per byte."),
        (ref / 2, "Half the reference: no factor 2 here."),
        (ref * 2, "Twice the reference: no factor 2 here (FLOPs are already counted in the peak)."),
    ])


@register(
    cases=4,
    nudge="Write the step's FLOPs and bytes for a batch of B (what is shared by the batch, what is "
          "per sequence?), set their ratio equal to the ridge, and solve for B. Then ask when that "
          "equation has no positive solution.",
    concept="Batching shares the weight read but not the KV cache: each sequence reads its own. As B "
            "grows the intensity climbs toward a limit set by the per-sequence FLOPs and KV bytes "
            "alone, and if that limit is below the ridge, no batch turns the step compute-bound.")
def decode_crossover_batch(case: Case, fn) -> None:
    """Your decode_crossover_batch(flops_per_seq, weight_bytes, kv_bytes_per_seq, ridge): the
    batch B at which a decode step (B·f FLOPs; the weights read once, B KV caches) reaches the
    ridge, and math.inf when no batch does (one case); kv_bytes_per_seq is 0 in one case."""
    from minillm import calc

    f = _log_uniform(case, 1e8, 2e11)               # about 2·N FLOPs per sequence
    w = f * case.rng.uniform(0.4, 2.5)              # weight bytes: 0.5 to 2 bytes per FLOP/2
    ridge = _log_uniform(case, 2.0, 400.0)
    if case.index == 0:
        kv = 0.0
    elif case.index == 1:
        kv = f / ridge * case.rng.uniform(1.05, 3.0)  # the KV cache alone keeps it below the ridge
    else:
        kv = f / ridge * case.rng.uniform(0.05, 0.8)
    ref = calc.decode_crossover_batch(f, w, kv, ridge)
    yours = case.call(fn, f, w, kv, ridge)
    what = f"crossover batch (f = {f:.4g}, W = {w:.4g}, k = {kv:.4g}, ridge = {ridge:.4g})"
    if math.isinf(ref):
        value = _number(case, yours, what, allow_inf=True)
        if not math.isinf(value) and _close(value, ridge * w / f):
            raise _Difference(f"{what}: expected math.inf, got {value:.6g}. You left out the KV cache: "
                              "every sequence of the batch reads its own, and here that alone keeps "
                              "the step below the ridge at any batch.")
        if not math.isinf(value):
            raise _Difference(f"{what}: expected math.inf, got {value:.6g}. Here f ÷ k is at or below "
                              "the ridge: even an infinite batch stays memory-bound, so no batch "
                              "reaches it. Return math.inf in that case.")
        return
    value = _number(case, yours, what, allow_inf=True)
    if math.isinf(value):
        raise _Difference(f"{what}: expected {ref:.6g}, got inf. This batch does reach the ridge: "
                          "return math.inf only when no positive batch does.")
    _judge(case, value, ref, what, [
        (ridge * w / f, "You left out the KV cache: every sequence of the batch reads its own."),
        (ridge * w / (f + ridge * kv), "The KV term has the wrong sign: it lowers the intensity, so "
                                       "it raises the batch needed."),
        (f / (ridge * w), "Upside down: that is one over the batch."),
        (ridge * (w + kv) / f, "The KV cache is per sequence: it grows with B, the weights do not."),
    ])
