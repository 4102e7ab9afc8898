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
tensors, W contiguous as `nn.Linear` stores it. For bf16 x and W (a bf16 model: half the bytes
per decode step) the products and sums are fp32 and y is rounded to bf16 once, so it equals
`(x.float() @ W.float().T).bfloat16()` up to that one rounding (the summation order may tip
a value to the neighbouring bf16). On CPUs with `avx512_bf16` the bf16 path is built with
its dot-product instruction (32 weights per instruction, `cpp_extension.build_flags`); that
streamed bf16 weights 1.6x faster than widening them on AVX2. Each output is summed in one fixed order, so
a row's result is bit-identical whichever other rows share the call (batch invariance): a
speculative verify pass over k + 1 rows computes each row exactly as a plain decode step.

`Linear.forward` uses it when `applies(x, W)` (CPU, fp32, W contiguous, at most `MAX_ROWS`
rows, no autograd) and the kernel is built; otherwise `F.linear`. Under `torch.compile` it is
called as the C++ operator `minillm_cpu::small_m_linear` (defined by the extension), so the
compiled decode path uses it too, with no Python in between.
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


# What the kernel multiplies: x and W both of one of these.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@cpp_extension.register("small-M linear")
def load_kernel():
    """The compiled extension, or None if switched off or not buildable here (warns once).
    Loading it also defines the operator `minillm_cpu::small_m_linear`."""
    return cpp_extension.load("minillm_small_m_linear_cpu", SOURCE,
                              "Linear uses torch.nn.functional.linear for every row count",
                              avx512_bf16=True, on_load=_register_fake)


def _register_fake(kernel) -> None:
    """The C++ operator's shape function, so torch.compile can trace it."""
    torch.library.register_fake("minillm_cpu::small_m_linear")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Would `Linear` send this product to the kernel? (Checks only: no build.)"""
    return (x.device.type == "cpu" and x.dtype in KERNEL_DTYPES
            and weight.dtype == x.dtype and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous()
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] with the C++ kernel (CPU, contiguous W, both
    fp32 or both bf16).

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


def linear(x: torch.Tensor, weight: torch.Tensor, kernel) -> torch.Tensor:
    """`Linear.forward`'s call, with the `kernel` it got from `load_kernel()`: the pybind
    function in eager mode, the C++ operator `minillm_cpu::small_m_linear` under
    `torch.compile` (a decode step makes 121 of these calls; a Python custom op would cost
    ~10 µs each, the operator ~2). The reshape to rows is traced into the graph."""
    if torch.compiler.is_compiling():
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.minillm_cpu.small_m_linear(rows, weight)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return _run(kernel, x, weight)
