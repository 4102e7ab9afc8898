"""A weight product for a few rows on the CPU that reads the weight once: the decode path.

Decoding one token multiplies one activation row by every weight matrix; verifying k
speculative tokens multiplies k + 1 rows; a small serving batch, a few more. In all of these
the weights (hundreds of MB) dwarf the activations (KB), so the step should cost what it
costs to stream the weights from memory, whatever the row count. BLAS (MKL, OpenBLAS) gets
that for 1 row only: for 2..16 rows it takes its GEMM path, which re-reads the weight in
panels, and on a 2-core CPU 5 rows cost about 1.7 times 1 row. `csrc/small_m_linear_cpu.cpp`
multiplies each 4-row tile of W by all rows while it is in registers: 1 row is faster than
BLAS's own matrix-vector product, and 5 rows cost well under 2 (`benchmarks/small_m_linear.py`
measures both side by side).

Contract: `small_m_linear(x [M, K], W [N, K]) == x @ W.T` to float32 rounding, for fp32 CPU
tensors, W contiguous as `nn.Linear` stores it. Each output is summed in one fixed order, so
a row's result is bit-identical whichever other rows share the call (batch invariance): a
speculative verify pass over k + 1 rows computes each row exactly as a plain decode step.

`Linear.forward` uses it when `applies(x, W)` (CPU, fp32, W contiguous, at most `MAX_ROWS`
rows, no autograd) and the kernel is built; otherwise `F.linear`. Under `torch.compile` it is
called as the custom op `minillm::small_m_linear`, so the compiled decode path uses it too.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import cpp_extension

SOURCE = Path(__file__).with_name("csrc") / "small_m_linear_cpu.cpp"

# Rows up to which the kernel is used. It is memory-bound up to ~8 rows, then its FMAs start
# to show; on the 2-core EPYC we measured it still beat BLAS at 32 and 48 rows
# (`benchmarks/small_m_linear.py --rows ...`), so 16 keeps a margin on other CPUs.
MAX_ROWS = 16


def load_kernel():
    """The compiled extension, or None if switched off or not buildable here (warns once)."""
    return cpp_extension.load("minillm_small_m_linear_cpu", SOURCE,
                              "Linear uses torch.nn.functional.linear for every row count")


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Would `Linear` send this product to the kernel? (Checks only: no build.)"""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous()
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] with the C++ kernel (fp32 CPU, contiguous W).

    Raises RuntimeError if the kernel is not available here (check `load_kernel()`) and
    ValueError on bad arguments (the kernel checks devices, dtypes, shapes and layout)."""
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU small-M linear kernel is not available here (switched off "
                           "by MINILLM_CPU_KERNEL=0, or it failed to build: see the warning)")
    return _run(kernel, x, weight)


def _run(kernel, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    try:
        y = kernel.small_m_linear(rows, weight)
    except RuntimeError as e:  # the kernel's TORCH_CHECKs
        raise ValueError(str(e).splitlines()[0]) from None
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("minillm::small_m_linear", mutates_args=())
def _small_m_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return small_m_linear(x, weight)


@_small_m_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, kernel) -> torch.Tensor:
    """`Linear.forward`'s call, with the `kernel` it got from `load_kernel()`: direct in
    eager mode (the custom-op wrapper costs a few µs per call, and a decode step makes 121
    of them), as the custom op under `torch.compile`."""
    if torch.compiler.is_compiling():
        return _small_m_linear_op(x, weight)
    return _run(kernel, x, weight)
