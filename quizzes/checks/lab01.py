"""Lab 01 checks: the three formulas of the roofline.

    check.decode_ceiling(decode_tokens_per_s)    # (num_params, dtype_bytes, bandwidth) -> tok/s
    check.matvec_intensity(matvec_intensity)     # (rows, cols, dtype_bytes) -> FLOPs/byte
    check.matmul_intensity(matmul_intensity)     # (m, n, k, dtype_bytes) -> FLOPs/byte
    check.ridge_point(ridge_point)               # (peak_flops, bandwidth) -> FLOPs/byte

Oracles: the functions of the same names in ``minillm.calc``. Inputs are random and span
real sizes (10⁸..10¹² parameters, fp32 to int4, 10 GB/s..5 TB/s), so a hard-coded number
or unit cannot pass. When an answer is wrong, the check tries the usual slips on the same
inputs (a missing dtype_bytes, a multiply-add counted as one FLOP, a ratio upside down,
the vector left out of the bytes ...) and names the one that reproduces it.

Invariant: a slip is named only when it reproduces the student's number within the
tolerance and the correct formula does not.
"""

from __future__ import annotations

import math

from .core import Case, _Difference, register

__all__ = ["decode_ceiling", "matvec_intensity", "matmul_intensity", "ridge_point"]

_RTOL = 1e-6


def _number(case: Case, yours, what: str) -> float:
    """The student's result as a float, or a clear message if it is not one number."""
    try:
        import torch

        if isinstance(yours, torch.Tensor) and yours.numel() == 1:
            yours = yours.item()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(yours, bool) or not isinstance(yours, (int, float)) and not hasattr(yours, "__float__"):
        raise _Difference(f"{what}: expected one number (a float), got {type(yours).__name__} {yours!r}. "
                          "Return the value, e.g. `return bandwidth / bytes_per_token`.")
    value = float(yours)
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


@register(cases=4, hint="bytes per token = num_params · dtype_bytes; tokens/s = bandwidth ÷ bytes per token.")
def decode_ceiling(case: Case, fn) -> None:
    """Your decode_tokens_per_s(num_params, dtype_bytes, bandwidth_bytes_per_s): the
    bandwidth-bound ceiling of batch-1 decode, bandwidth ÷ (num_params · dtype_bytes)."""
    from minillm import calc

    n = _log_uniform(case, 1e8, 1e12)
    db = case.choice([4, 2] if case.index == 0 else [4, 2, 1, 0.5])  # case 1 exposes a missing dtype_bytes
    bw = _log_uniform(case, 1e10, 5e12)
    ref = calc.decode_tokens_per_s(n, db, bw)
    yours = case.call(fn, n, db, bw)
    _judge(case, yours, ref, "tok/s", [
        (bw / n, "You left out dtype_bytes: each token reads num_params · dtype_bytes bytes of weights."),
        (bw * db / n, "dtype_bytes multiplies the bytes read (the denominator), not the bandwidth."),
        (n * db / bw, "Upside down: that is seconds per token. Tokens per second = bandwidth ÷ bytes per token."),
        (bw / (2 * n * db), "No factor 2 here: the 2 of 2·N is FLOPs per parameter, but decode's ceiling "
                            "counts bytes: each weight is read once per token."),
        (bw / (n * db) / 1e9, "Off by 10⁹: keep everything in bytes and bytes/s (no GB conversion inside)."),
    ])


@register(cases=4, hint="FLOPs = 2·rows·cols; bytes = (rows·cols + cols + rows) · dtype_bytes.")
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
        (flops / (r * c * db), "You counted only W's bytes. x (cols elements) is read and y (rows elements) "
                               "written too: bytes = (rows·cols + cols + rows) · dtype_bytes. It matters "
                               "for small matrices; for big ones it tends to 2 ÷ dtype_bytes."),
        (ref / 2, "A multiply-add is 2 FLOPs: W·x costs 2·rows·cols FLOPs."),
        (1 / ref, "Upside down: intensity is FLOPs ÷ bytes."),
        (flops / (r * c + c + r), "You left out dtype_bytes: bytes = elements · dtype_bytes."),
    ])


@register(cases=4, hint="FLOPs = 2·m·n·k; bytes = (m·k + k·n + m·n) · dtype_bytes.")
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
        (flops / (k * n * db), "You counted only B's bytes (the weights). A (m·k) is read and C (m·n) "
                               "written too: bytes = (m·k + k·n + m·n) · dtype_bytes."),
        (flops / ((m * k + k * n) * db), "You left out writing C: bytes = (m·k + k·n + m·n) · dtype_bytes."),
        (ref / 2, "A multiply-add is 2 FLOPs: the product costs 2·m·n·k FLOPs."),
        (1 / ref, "Upside down: intensity is FLOPs ÷ bytes."),
        (flops / (m * k + k * n + m * n), "You left out dtype_bytes: bytes = elements · dtype_bytes."),
    ])


@register(cases=4, hint="one division: peak FLOP/s ÷ bandwidth in bytes/s gives FLOPs per byte.")
def ridge_point(case: Case, fn) -> None:
    """Your ridge_point(peak_flops, bandwidth_bytes_per_s): the intensity (FLOPs/byte) where
    the roofline turns from the bandwidth slope to the flat compute roof."""
    from minillm import calc

    peak = _log_uniform(case, 1e10, 2e15)
    bw = _log_uniform(case, 1e10, 5e12)
    ref = calc.ridge_point(peak, bw)
    yours = case.call(fn, peak, bw)
    _judge(case, yours, ref, "ridge point", [
        (bw / peak, "Upside down: the ridge is peak FLOP/s ÷ bandwidth (FLOPs per byte)."),
        (ref / 2, "No factor 2: the ridge is simply peak FLOP/s ÷ bytes/s."),
        (ref * 2, "No factor 2: the ridge is simply peak FLOP/s ÷ bytes/s."),
    ])
