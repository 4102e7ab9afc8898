"""Build minillm's C++ CPU kernels on first use, or say why not and fall back.

Four kernels live in C++ (each beside the module that calls it, in a `csrc/` folder):
`attention/csrc/paged_decode_cpu.cpp` (decode attention read in place through the block
table), `layers/csrc/small_m_linear_cpu.cpp` (a weight product for a few rows that streams
the weight once), `layers/csrc/fused_glue_cpu.cpp` (RMSNorm, RoPE, SiLU·up and the residual
adds in one pass each) and `quant/csrc/quant_linear_cpu.cpp` (the small-M product for packed
4-bit and 8-bit weights, read without dequantizing). `csrc/vec_math.h` holds the SIMD
helpers they share. Each is compiled with `torch.utils.cpp_extension.load`
(a C++ compiler and `ninja`); a build takes 30–40 s once and is cached under
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR). `make setup` builds them all ahead, so
no notebook cell waits for the compiler.

Each calling module marks its `load_kernel` with `@cpp_extension.register(what)`, so this
module never imports its callers: `main` imports the subpackages that hold C++ sources and
builds whatever registered itself.

Where a kernel cannot be built (no compiler, another OS), `load` warns once and returns
None, and the caller keeps its PyTorch path: same results to rounding, slower.
MINILLM_CPU_KERNEL=0 switches every C++ kernel off (the PyTorch paths then run, e.g. to
compare against them).
"""
from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

_loaded: dict[str, object] = {}
INCLUDE = Path(__file__).with_name("csrc")  # vec_math.h: SIMD helpers the kernels share
# What each kernel does -> its module's `load_kernel`: every module with a C++ kernel adds
# itself when it is imported (`register`), so `main` builds them all without naming them.
KERNELS: dict[str, Callable[[], object]] = {}


def register(what: str):
    """Decorator for a module's `load_kernel`: lists it under `what` (e.g. "fused glue")
    for `main`. Returns the function unchanged."""
    def add(load_kernel: Callable[[], object]) -> Callable[[], object]:
        KERNELS[what] = load_kernel
        return load_kernel
    return add


def enabled() -> bool:
    """False when MINILLM_CPU_KERNEL=0 asks for the PyTorch paths."""
    return os.environ.get("MINILLM_CPU_KERNEL", "1") != "0"


def build_flags(stem: str, avx512: bool = False,
                avx512_bf16: bool = False) -> tuple[str, list[str]]:
    """(extension name, compiler flags) for this CPU. The name carries the instruction set,
    so a cache directory shared by different machines never hands one the other's build.

    `avx512=True` (a kernel written for 16-lane vectors) adds AVX-512 where PyTorch reports
    the CPU has it; the others keep AVX2, so their results do not change with the host.
    `avx512_bf16=True` (a kernel with a bf16 dot-product path, `__AVX512BF16__`) adds
    AVX-512 and its bf16 instructions where the CPU flags list `avx512_bf16`."""
    from .devices import cpu_has_flag

    capability = torch.backends.cpu.get_cpu_capability()
    vector_isa = capability in ("AVX2", "AVX512")
    dot_bf16 = avx512_bf16 and capability == "AVX512" and cpu_has_flag("avx512_bf16")
    wide = (avx512 and capability == "AVX512") or dot_bf16
    flags = ["-O3"] + (["-mavx2", "-mfma"] if vector_isa else [])
    if wide:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if dot_bf16:
        flags.append("-mavx512bf16")
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")  # at::parallel_for runs on PyTorch's OpenMP threads
    isa = ("avx512bf16" if dot_bf16 else "avx512" if wide else "avx2" if vector_isa
           else "generic")
    return f"{stem}_{isa}", flags


def load(stem: str, source: Path, fallback: str, avx512: bool = False,
         avx512_bf16: bool = False, on_load=None):
    """The compiled extension for `source`, or None if switched off or not buildable here.

    `fallback` names what the caller does instead; it goes into the one warning. `avx512`:
    see `build_flags`. `on_load(module)` runs once, right after a successful load (the
    kernels register their operators' shape functions there). `avx512_bf16`: the same."""
    if not enabled():
        return None
    if stem not in _loaded:
        name, flags = build_flags(stem, avx512, avx512_bf16)
        try:
            from torch.utils.cpp_extension import load as cpp_load

            _loaded[stem] = cpp_load(name, [str(source)], extra_cflags=flags,
                                     extra_include_paths=[str(INCLUDE)],
                                     extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                                     verbose=False)
        except Exception as e:  # compiler, ninja or headers missing: keep the torch path
            _loaded[stem] = None
            last = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
            warnings.warn(f"minillm: could not build {source.name} ({type(e).__name__}: {last}); "
                          f"{fallback} instead", RuntimeWarning, stacklevel=3)
        else:
            if on_load is not None:
                on_load(_loaded[stem])
    return _loaded[stem]


def kernel_packages() -> list[str]:
    """The subpackages of minillm with C++ sources (a `csrc/` folder beside their modules):
    importing them imports, and so registers, every module that loads a kernel."""
    root = Path(__file__).parent
    return sorted(f"{__package__}.{d.parent.name}" for d in root.glob("*/csrc") if d.is_dir())


def main() -> None:
    """Build (or load) every C++ kernel now and say how it went: `make setup` calls this
    (`from minillm.cpp_extension import main; main()`)."""
    for package in kernel_packages():
        importlib.import_module(package)
    for what, load_kernel in KERNELS.items():
        t0 = time.perf_counter()
        kernel = load_kernel()
        if kernel is None:
            print(f"minillm: the CPU {what} kernel is not available; the PyTorch path runs instead")
        else:
            print(f"minillm: CPU {what} kernel ready ({kernel.__file__}, "
                  f"{time.perf_counter() - t0:.0f} s)")
