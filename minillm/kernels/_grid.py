"""Launch-grid arithmetic on the host, in plain Python.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in triton 3.7: called
from Python they go through Triton's JIT wrapper, ~1.5 µs a call against ~0.06 µs for the
arithmetic itself (measured on the 2-core EPYC), and an eager decode step of SmolLM2 on a
GPU sizes ~300 launches with them (30 layers of glue, attention and W4A16 wrappers). The
kernels themselves keep `tl.cdiv`. Both equal Triton's for every non-negative int
(`tests/test_kernels.py`).
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
