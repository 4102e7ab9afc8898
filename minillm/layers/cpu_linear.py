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

Contract: `small_m_linear(x [..., K], W [N, K]) == x @ W.T` to float32 rounding, for fp32 CPU
tensors, W contiguous as `nn.Linear` stores it. For bf16 x and W (a bf16 model: half the bytes
per decode step) the products and sums are fp32 and y is rounded to bf16 once, so it equals
`(x.float() @ W.float().T).bfloat16()` up to that one rounding (the summation order may tip
a value to the neighbouring bf16). On CPUs with `avx512_bf16` the bf16 path is built with
its dot-product instruction (32 weights per instruction, `cpp_extension.build_flags`); that
streamed bf16 weights 1.6x faster than widening them on AVX2. Each output is summed in one fixed order, so
a row's result is bit-identical whichever other rows share the call (batch invariance): a
speculative verify pass over k + 1 rows computes each row exactly as a plain decode step.

Builds (`BUILDS`, compiled as this CPU allows): avx2 (8 lanes; bf16 widened), avx512 (16
lanes; bf16 widened) and avx512bf16 (fp32 as avx2, bf16 through `vdpbf16ps`). Each sums in
its own fixed order, so builds differ in the last bits; the default (`default_variant`:
avx512bf16 where the CPU has it, else avx2) is the build that ran before builds were
measured. Which build runs, or BLAS, is chosen per dtype, width class (`width_class`) and
bucket of rows by measurement (`minillm.cpu_select`; `groups` below is what it measures):
on a Zen 4 EPYC, say, a build tuned on Zen 5 need not be the fastest, or faster than BLAS.

`Linear.forward` uses it when `applies(x, W)` (CPU, fp32 or bf16, W contiguous, at most
`MAX_ROWS` rows, no autograd) and `kernel_for(x, W)` names a build; otherwise `F.linear`.
Under `torch.compile` it is called as the C++ operator `minillm_cpu::small_m_linear_<isa>`
(defined by each build), so the compiled decode path uses it too, with no Python in
between.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .. import cpp_extension, cpu_select

SOURCE = Path(__file__).with_name("csrc") / "small_m_linear_cpu.cpp"

# Rows up to which the kernel is used. It is memory-bound up to ~8 rows, then its FMAs start
# to show; on the 2-core EPYC we measured it still beat BLAS at 32 and 48 rows
# (`benchmarks/small_m_linear.py --rows ...`), so 16 keeps a margin on other CPUs.
MAX_ROWS = 16


# What the kernel multiplies: x and W both of one of these.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# The builds of the kernel (`cpp_extension.ISAS`), and the width classes the selection
# tells apart: SmolLM2's products have rows of 576 (q|k|v, o, gate|up, LM head) or 1536
# (down) inputs.
BUILDS = cpp_extension.ISAS
LONG_K = 1024


def width_class(k: int) -> str:
    """The width class of a product with `k` inputs: "K<1024" or "K>=1024"."""
    return "K<1024" if k < LONG_K else "K>=1024"


def default_variant(isas: tuple[str, ...] | None = None) -> str:
    """The build that ran before builds were measured (MINILLM_CPU_KERNEL=default), for
    both dtypes: avx512bf16 where the CPU has it, else avx2 ("generic" without AVX2)."""
    return cpp_extension.default_isa(avx512_bf16=True, isas=isas)


@cpp_extension.register("small-M linear", builds=BUILDS)
def load_kernel(variant: str | None = None):
    """The compiled build `variant` (an ISA of `BUILDS`; None: the default build), or None
    if switched off or not buildable here (warns once). Loading a build also defines its
    operator `minillm_cpu::small_m_linear_<isa>`."""
    return cpp_extension.load("minillm_small_m_linear_cpu", SOURCE,
                              "Linear uses torch.nn.functional.linear for every row count",
                              on_load=_register_fake,
                              isa=variant or default_variant())


def _register_fake(kernel) -> None:
    """The C++ operator's shape function, so torch.compile can trace it."""
    torch.library.register_fake(f"minillm_cpu::{kernel.op_name}")(
        lambda x, weight: x.new_empty(*x.shape[:-1], weight.shape[0]))


def kernel_for(x: torch.Tensor, weight: torch.Tensor):
    """The build (extension module) that `Linear` runs x @ W.T through, chosen for this
    dtype, width and row count (`minillm.cpu_select`), or None: F.linear. Only for products
    that `applies` to. A decode step makes 121 products: each shape is decided once."""
    return cpu_select.memoized(_choose, x.numel() // x.shape[-1], x.dtype, x.shape[-1])


def _choose(rows: int, dtype: torch.dtype, k: int):
    if not cpp_extension.enabled():
        return None
    variant = cpu_select.choice("small_m_linear", f"{_dtype_name(dtype)} {width_class(k)}",
                                cpu_select.row_bucket(rows))
    if variant is None or variant == "blas":
        return None
    return load_kernel(variant)


def uses_kernel(dtype: torch.dtype, k: int) -> bool:
    """Will some row count of a product with this dtype and `k` inputs run the kernel (so W
    should be stored [out, in], as it reads it)? Builds the chosen kernels."""
    if dtype not in KERNEL_DTYPES or not cpp_extension.enabled():
        return False
    return any(_choose(rows, dtype, k) is not None for rows in (1, 4, 8, 16))


def prepare() -> None:
    """Load or measure the selection and build the kernels it chose, now: a measurement or
    a build inside a torch.compile trace would break the graph."""
    for dtype in KERNEL_DTYPES:
        for k in (LONG_K - 1, LONG_K):
            uses_kernel(dtype, k)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# What the selection measures (`minillm.cpu_select`): per dtype and width class, every
# build this CPU runs against F.linear, on weights (MEASURE_BYTES in all, more than a large
# L3, each a distinct matrix as in a decode step) shaped like SmolLM2's, at both ends of
# each bucket of rows.
MEASURE_BYTES = 48 * 2**20
_SHAPES = {"K<1024": [(960, 576), (3072, 576)], "K>=1024": [(576, 1536)]}
_BUCKET_ROWS = {"1": (1,), "2-4": (2, 4), "5-8": (5, 8), "9-16": (9, 16)}


@cpu_select.tuner("small_m_linear", "small-M linear")
def groups(isas: tuple[str, ...]) -> list[cpu_select.Group]:
    """The selection's groups for this kernel on a CPU that runs `isas`."""
    out, default = [], default_variant(isas)
    variants = cpu_select.candidates(BUILDS, default, isas)
    for dtype in KERNEL_DTYPES:
        for width, shapes in _SHAPES.items():
            out.append(cpu_select.Group("small_m_linear", f"{_dtype_name(dtype)} {width}",
                                        cpu_select.ROW_BUCKETS, variants, "blas",
                                        _workload(dtype, shapes)))
    return out


def _workload(dtype: torch.dtype, shapes: list[tuple[int, int]]):
    """make(variant, bucket) for `cpu_select.Group`: the weights are made on first use and
    shared by every variant of the group."""
    data: dict = {}

    def make(variant: str, bucket: str):
        kernel = None
        if variant != "blas":
            kernel = load_kernel(variant)
            if kernel is None:
                return None
        if "weights" not in data:
            g = torch.Generator().manual_seed(0)
            per = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
            data["weights"] = [(torch.randn(n, k, generator=g) * 0.05).to(dtype)
                               for _ in range(max(1, MEASURE_BYTES // per)) for n, k in shapes]
        ws = data["weights"]
        xs = {(m, k): torch.randn(m, k).to(dtype) for m in _BUCKET_ROWS[bucket]
              for k in {w.shape[1] for w in ws}}
        rows = _BUCKET_ROWS[bucket]
        if kernel is None:
            return lambda: [F.linear(xs[m, w.shape[1]], w) for m in rows for w in ws]
        fn = kernel.small_m_linear
        return lambda: [fn(xs[m, w.shape[1]], w) for m in rows for w in ws]
    return make


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Would `Linear` send this product to the kernel? (Checks only: no build.)"""
    # Asked once per product (121 per decode step): `is_cpu` costs a fifth of `device.type`.
    return (x.is_cpu and x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype
            and weight.is_cpu and weight.dim() == 2 and weight.is_contiguous()
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def small_m_linear(x: torch.Tensor, weight: torch.Tensor,
                   variant: str | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N] with the C++ kernel (CPU, contiguous W, both
    fp32 or both bf16), through build `variant` (an ISA of `BUILDS`; None: the build chosen
    for these rows, or the dtype's default build where BLAS is chosen).

    Raises RuntimeError if the kernel is not available here (check `load_kernel()`) and
    ValueError on bad arguments (the kernel checks devices, dtypes, shapes and layout)."""
    kernel = None
    if variant is not None:
        kernel = load_kernel(variant)
    elif cpp_extension.enabled():
        kernel = (kernel_for(x, weight) if applies(x, weight) else None) or load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU small-M linear kernel is not available here (switched off "
                           "by MINILLM_CPU_KERNEL=0, or it failed to build: see the warning)")
    return _run(kernel, x, weight)


def _run(kernel, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    try:  # the kernel keeps x's leading shape: [..., K] -> [..., N]
        return kernel.small_m_linear(x.contiguous(), weight)
    except RuntimeError as e:  # the kernel's TORCH_CHECKs
        raise ValueError(str(e).splitlines()[0]) from None


def linear(x: torch.Tensor, weight: torch.Tensor, kernel) -> torch.Tensor:
    """`Linear.forward`'s call, with the build `kernel` that `kernel_for` chose: the pybind
    function in eager mode, the build's C++ operator `minillm_cpu::small_m_linear_<isa>`
    under `torch.compile` (a decode step makes 121 of these calls; a Python custom op would
    cost ~10 µs each, the operator ~2). Both take x [..., K] and return [..., N]."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.minillm_cpu, kernel.op_name)(x.contiguous(), weight)
    return _run(kernel, x, weight)
