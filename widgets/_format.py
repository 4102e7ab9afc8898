"""How the widgets print numbers: bytes, FLOP/s, bandwidth and times with SI prefixes
(1 GB = 10^9 bytes, as ``minillm.calc`` counts), parameter counts as '135M' / '70B'.

Three significant digits. ``fmt_bytes``/``fmt_flops``/``fmt_bandwidth`` print
an infinite value as '∞ B' and None or NaN as 'n/a B'; ``fmt_time`` prints '∞' for
anything not finite.
"""
from __future__ import annotations

import math

__all__ = ["fmt_bytes", "fmt_flops", "fmt_bandwidth", "fmt_time", "fmt_params"]


def _scaled(value: float, unit: str, prefixes=(("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))) -> str:
    if value is None or not math.isfinite(value):
        return f"∞ {unit}" if value == math.inf else f"n/a {unit}"
    for prefix, scale in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def fmt_bytes(n: float) -> str:
    """1.34e9 -> '1.34 GB' (SI prefixes, as ``minillm.calc`` uses)."""
    return _scaled(n, "B")


def fmt_flops(f: float) -> str:
    """1.7e11 -> '170 GFLOP/s'."""
    return _scaled(f, "FLOP/s")


def fmt_bandwidth(b: float) -> str:
    """2.039e12 -> '2.04 TB/s'."""
    return _scaled(b, "B/s")


def fmt_time(s: float) -> str:
    """0.0543 -> '54.3 ms'."""
    if not math.isfinite(s):
        return "∞"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_params(n: float) -> str:
    """1.345e8 -> '135M'; 7e10 -> '70B'."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"
