"""Quantized weight products for a few rows on the CPU, reading the packed bytes: the decode
path of `QuantLinear`.

Decoding a token multiplies one activation row by every weight (a speculative verify pass
k + 1 rows, a small batch a few more), so a step costs what streaming the weights from memory
costs. Packed 4-bit weights are 1/8 of fp32's bytes (8-bit 1/4), but only a kernel that reads
them as packed gets that: dequantizing first writes and re-reads a float matrix.
`csrc/quant_linear_cpu.cpp` widens each packed byte to fp32 in registers and multiplies it by
all rows there, once per call; per group it sums s·Σu·x − s·z·Σx, with each group's Σx taken
once per row. Two builds (`BUILDS`): avx2 (8 lanes) and avx512 (16 lanes: half the
instructions per weight, and this loop is bound by instructions, not by memory), the
default where the CPU has it. Which build runs, or dequantize + F.linear, is measured per
host, storage width and bucket of rows (`minillm.cpu_select`, `groups` below): a CPU that
runs 512-bit instructions as two halves (Zen 4) may do as well with 8 lanes.
`benchmarks/quant_linear.py` times it against the fp32 small-M kernel, dequantize +
F.linear and PyTorch's own int8 / int4 products, next to the bytes each reads.

Contract: `quant_linear(x [..., K], qweight, scales, zeros, group_size, bits)` equals
`F.linear(x, packing.dequantize_packed(qweight, scales, zeros, bits))` to fp32 rounding (only
the summation order differs), for fp32 CPU x with 1..`MAX_ROWS` rows and the packed layout of
`packing` (4-bit storage for bits <= 4, one byte per value for 5..8). Like the fp32 small-M
kernel, each output is summed in one fixed order, so a row's result is bit-identical whatever
other rows share the call.

`QuantLinear.forward` uses it when `applies(x, qweight)` and `kernel_for(x, bits)` names a
build; otherwise it dequantizes and calls `F.linear`. Under `torch.compile` the call goes to
the build's C++ operators `minillm_cpu::w4_linear_<isa>` / `w8_linear_<isa>` (defined by the
extension itself, so a compiled step calls them without going through Python), and the
compiled decode path has no graph break.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .. import cpp_extension, cpu_select
from .packing import storage_bits
from .weights import MAX_BITS, MIN_BITS

SOURCE = Path(__file__).with_name("csrc") / "quant_linear_cpu.cpp"

# Rows up to which the kernel is used (and which it accepts): the same memory-bound regime
# as the fp32 small-M kernel (`layers/cpu_linear.py`); beyond it the products are
# compute-bound and dequantize + a BLAS GEMM is the better path.
MAX_ROWS = 16


# The kernel's builds: 8 lanes (avx2) and 16 (avx512, used where the group size allows).
BUILDS = ("avx2", "avx512")


def default_variant(isas: tuple[str, ...] | None = None) -> str:
    """The build that ran before builds were measured (MINILLM_CPU_KERNEL=default): avx512
    where the CPU has it, else avx2 ("generic" without AVX2)."""
    return cpp_extension.default_isa(avx512=True, isas=isas)


@cpp_extension.register("quantized (W4/W8) linear", builds=BUILDS)
def load_kernel(variant: str | None = None):
    """The compiled build `variant` (avx2 or avx512; None: the default build), or None if
    switched off or not buildable here (warns once). Loading a build also defines its
    operators `minillm_cpu::w4_linear_<isa>` / `w8_linear_<isa>`."""
    return cpp_extension.load("minillm_quant_linear_cpu", SOURCE,
                              "QuantLinear dequantizes the weight and calls "
                              "torch.nn.functional.linear", on_load=_register_fakes,
                              isa=variant or default_variant())


def _register_fakes(kernel) -> None:
    """Shape functions of the C++ operators, so torch.compile can trace them."""
    for op in ("w4_linear", "w8_linear"):
        torch.library.register_fake(f"minillm_cpu::{op}_{kernel.isa}")(
            lambda x, qweight, scales, zeros, group_size:
            x.new_empty(*x.shape[:-1], qweight.shape[0]))


def _group(bits: int) -> str:
    return f"w{storage_bits(bits)}"


def kernel_for(x: torch.Tensor, bits: int) -> str | None:
    """The build (its ISA) that `QuantLinear` runs these rows through, chosen by measurement
    (`minillm.cpu_select`), or None: dequantize and F.linear. Only for products that
    `applies` to."""
    return cpu_select.memoized(_choose, x.numel() // x.shape[-1], storage_bits(bits))


def _choose(rows: int, bits: int) -> str | None:
    if not cpp_extension.enabled():
        return None
    variant = cpu_select.choice("quant_linear", _group(bits), cpu_select.row_bucket(rows))
    if variant in (None, "blas") or load_kernel(variant) is None:
        return None
    return variant


# What the selection measures: per storage width, each build against dequantize + F.linear,
# at the top of each bucket of rows, on packed weights shaped like SmolLM2's (g = 64,
# MEASURE_BYTES of them in all: dequantizing them writes 8x (w4) or 4x (w8) as many).
MEASURE_BYTES = 16 * 2**20
_SHAPES = [(960, 576), (3072, 576), (576, 1536)]
_BUCKET_ROWS = {"1": 1, "2-4": 4, "5-8": 8, "9-16": 16}


@cpu_select.tuner("quant_linear", "W4/W8 linear")
def groups(isas: tuple[str, ...]) -> list[cpu_select.Group]:
    """The selection's groups for this kernel on a CPU that runs `isas`."""
    default = default_variant(isas)
    variants = cpu_select.candidates(BUILDS, default, isas)
    return [cpu_select.Group("quant_linear", f"w{bits}", cpu_select.ROW_BUCKETS, variants,
                             "blas", _workload(bits)) for bits in (4, 8)]


def _workload(bits: int):
    data: dict = {}

    def make(variant: str, bucket: str):
        if load_kernel(None if variant == "blas" else variant) is None:
            return None
        if "weights" not in data:
            g, group_size = torch.Generator().manual_seed(0), 64
            per = sum(n * k for n, k in _SHAPES) * bits // 8
            data["weights"] = []
            for _ in range(max(1, MEASURE_BYTES // per)):
                for n, k in _SHAPES:
                    q = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=g)
                    s = torch.rand(n, k // group_size, generator=g) * 0.01 + 1e-3
                    z = torch.full((n, k // group_size), 2.0 ** (bits - 1))
                    data["weights"].append((q, s, z, group_size))
        ws, m = data["weights"], _BUCKET_ROWS[bucket]
        xs = {k: torch.randn(m, k) for k in {q.shape[1] * 8 // bits for q, *_ in ws}}
        if variant == "blas":
            return lambda: [F.linear(xs[q.shape[1] * 8 // bits], dequantize(q, s, z, bits))
                            for q, s, z, _ in ws]
        return lambda: [quant_linear(xs[q.shape[1] * 8 // bits], q, s, z, g, bits, variant)
                        for q, s, z, g in ws]
    return make


def applies(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Would `QuantLinear` send this product to the kernel? (Checks only: no build.)"""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and qweight.device.type == "cpu" and qweight.dtype == torch.uint8
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
            and not (torch.is_grad_enabled() and x.requires_grad))


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, bits: int,
                 variant: str | None = None) -> torch.Tensor:
    """x [..., K] @ Ŵ.T -> [..., N] with Ŵ stored packed (`packing`): the w4 kernel for
    bits <= 4, the w8 kernel for 5..8, of build `variant` (None: the default build).

    Raises RuntimeError if the kernel is not available here (check `load_kernel()`) and
    ValueError on bad arguments (the kernel checks devices, dtypes, shapes and row count)."""
    _check_bits(bits)
    name = "w4_linear" if storage_bits(bits) == 4 else "w8_linear"
    if torch.compiler.is_compiling():  # the C++ operator itself (see the .cpp's end)
        return getattr(torch.ops.minillm_cpu, f"{name}_{variant or default_variant()}")(
            x, qweight, scales, zeros, group_size)
    return _run(variant, name, x, qweight, scales, zeros, group_size)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               bits: int) -> torch.Tensor:
    """Ŵ [N, K] fp32 from the packed layout, in one pass: bit-identical to
    `packing.dequantize_packed` (the same subtraction and multiplication per element), several
    times faster. `QuantLinear` uses it for products with more rows than `MAX_ROWS`, which
    then go to a BLAS GEMM. Raises RuntimeError if the kernel is not available here."""
    _check_bits(bits)
    return _run(None, "w4_dequantize" if storage_bits(bits) == 4 else "w8_dequantize", qweight,
                scales, zeros)


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")


# The kernel's functions once built. A decode step makes ~120 of these calls, so the
# eager path looks them up here rather than through `load_kernel()` (about 1 µs a call)
# and leaves the reshaping of x [..., K] to the kernel (another 3 µs in Python).
_functions: dict[tuple[str | None, str], object] = {}


def _run(variant: str | None, name: str, *args):
    """Build `variant`'s function `name` called on `args`, its argument checks as
    ValueError."""
    fn = _functions.get((variant, name))
    if fn is None:
        kernel = load_kernel(variant)
        if kernel is None:
            raise RuntimeError("the CPU quantized linear kernels are not available here "
                               "(switched off by MINILLM_CPU_KERNEL=0, or they failed to "
                               "build: see the warning)")
        fn = _functions[variant, name] = getattr(kernel, name)
    try:
        return fn(*args)
    except RuntimeError as e:  # the kernel's TORCH_CHECKs
        raise ValueError(str(e).splitlines()[0]) from None
