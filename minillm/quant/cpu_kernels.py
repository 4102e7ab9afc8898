"""Quantized weight products for a few rows on the CPU, reading the packed bytes: the decode
path of `QuantLinear`.

Decoding a token multiplies one activation row by every weight (a speculative verify pass
k + 1 rows, a small batch a few more), so a step costs what streaming the weights from memory
costs. Packed 4-bit weights are 1/8 of fp32's bytes (8-bit 1/4), but only a kernel that reads
them as packed gets that: dequantizing first writes and re-reads a float matrix.
`csrc/quant_linear_cpu.cpp` widens each packed byte to fp32 in registers and multiplies it by
all rows there, once per call; per group it sums s·Σu·x − s·z·Σx, with each group's Σx taken
once per row. Built with AVX-512 where the CPU has it (16 lanes: half the instructions per
weight of AVX2's 8, and this loop is bound by instructions, not by memory). `benchmarks/quant_linear.py` times it against the fp32 small-M kernel,
dequantize + F.linear and PyTorch's own int8 / int4 products, next to the bytes each reads.

Contract: `quant_linear(x [..., K], qweight, scales, zeros, group_size, bits)` equals
`F.linear(x, packing.dequantize_packed(qweight, scales, zeros, bits))` to fp32 rounding (only
the summation order differs), for fp32 CPU x with 1..`MAX_ROWS` rows and the packed layout of
`packing` (4-bit storage for bits <= 4, one byte per value for 5..8). Like the fp32 small-M
kernel, each output is summed in one fixed order, so a row's result is bit-identical whatever
other rows share the call.

`QuantLinear.forward` uses it when `applies(x, qweight)` and the kernel is built; otherwise it
dequantizes and calls `F.linear`. Under `torch.compile` the call goes to the C++ operators
`minillm_cpu::w4_linear` / `w8_linear` (defined by the extension itself, so a compiled step
calls them without going through Python), and the compiled decode path has no graph break.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import cpp_extension
from .packing import storage_bits
from .weights import MAX_BITS, MIN_BITS

SOURCE = Path(__file__).with_name("csrc") / "quant_linear_cpu.cpp"

# Rows up to which the kernel is used (and which it accepts): the same memory-bound regime
# as the fp32 small-M kernel (`layers/cpu_linear.py`); beyond it the products are
# compute-bound and dequantize + a BLAS GEMM is the better path.
MAX_ROWS = 16


@cpp_extension.register("quantized (W4/W8) linear")
def load_kernel():
    """The compiled extension, or None if switched off or not buildable here (warns once).
    Loading it also defines the operators `minillm_cpu::w4_linear` / `w8_linear`."""
    return cpp_extension.load("minillm_quant_linear_cpu", SOURCE,
                              "QuantLinear dequantizes the weight and calls "
                              "torch.nn.functional.linear", avx512=True, on_load=_register_fakes)


def _register_fakes(kernel) -> None:
    """Shape functions of the C++ operators, so torch.compile can trace them."""
    for name in ("minillm_cpu::w4_linear", "minillm_cpu::w8_linear"):
        torch.library.register_fake(name)(
            lambda x, qweight, scales, zeros, group_size:
            x.new_empty(*x.shape[:-1], qweight.shape[0]))


def applies(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Would `QuantLinear` send this product to the kernel? (Checks only: no build.)"""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and qweight.device.type == "cpu" and qweight.dtype == torch.uint8
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
            and not (torch.is_grad_enabled() and x.requires_grad))


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """x [..., K] @ Ŵ.T -> [..., N] with Ŵ stored packed (`packing`): the w4 kernel for
    bits <= 4, the w8 kernel for 5..8.

    Raises RuntimeError if the kernel is not available here (check `load_kernel()`) and
    ValueError on bad arguments (the kernel checks devices, dtypes, shapes and row count)."""
    _check_bits(bits)
    if torch.compiler.is_compiling():  # the C++ operator itself (see the .cpp's end)
        ops = torch.ops.minillm_cpu
        op = ops.w4_linear if storage_bits(bits) == 4 else ops.w8_linear
        return op(x, qweight, scales, zeros, group_size)
    return _run("w4_linear" if storage_bits(bits) == 4 else "w8_linear", x, qweight, scales,
                zeros, group_size)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bits: int) -> torch.Tensor:
    """Ŵ [N, K] fp32 from the packed layout, in one pass: bit-identical to
    `packing.dequantize_packed` (the same subtraction and multiplication per element), several
    times faster. `QuantLinear` uses it for products with more rows than `MAX_ROWS`, which
    then go to a BLAS GEMM. Raises RuntimeError if the kernel is not available here."""
    _check_bits(bits)
    return _run("w4_dequantize" if storage_bits(bits) == 4 else "w8_dequantize", qweight,
                scales, zeros)


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")


# The kernel's functions once built. A decode step makes ~120 of these calls, so the
# eager path looks them up here rather than through `load_kernel()` (about 1 µs a call)
# and leaves the reshaping of x [..., K] to the kernel (another 3 µs in Python).
_functions: dict[str, object] = {}


def _run(name: str, *args):
    """The kernel's function `name` called on `args`, its argument checks as ValueError."""
    fn = _functions.get(name)
    if fn is None:
        kernel = load_kernel()
        if kernel is None:
            raise RuntimeError("the CPU quantized linear kernels are not available here "
                               "(switched off by MINILLM_CPU_KERNEL=0, or they failed to "
                               "build: see the warning)")
        fn = _functions[name] = getattr(kernel, name)
    try:
        return fn(*args)
    except RuntimeError as e:  # the kernel's TORCH_CHECKs
        raise ValueError(str(e).splitlines()[0]) from None
