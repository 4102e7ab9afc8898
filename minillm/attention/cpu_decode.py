"""Decode attention over the paged KV cache on the CPU, reading K/V in place.

The serving engine's PyTorch decode path (`minillm.attention.paged`) gathers every decoding
sequence's K/V out of the block pool with `index_select`, then runs SDPA over the copy: the
cache crosses memory three times (read, write, read again), and on 2 cores that gather and
attention took a third of a 64-sequence decode step. `csrc/paged_decode_cpu.cpp` is the
CPU counterpart of the Triton `paged_decode_attention`: it follows the block table itself
and reads each K/V row once. `benchmarks/serving.py` measures both paths side by side.

The kernel is C++ built on first use with `torch.utils.cpp_extension.load` (a C++ compiler
and `ninja`). The build takes about 40 s once; the result is cached under
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR). `make setup` builds it ahead
(`cpu_decode.main()`), so no notebook cell waits for the compiler. Where it cannot be
built (no compiler, another OS), `load_kernel()` warns once and returns None, and the engine
keeps the PyTorch path: same results, slower. MINILLM_CPU_KERNEL=0 switches it off.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
_kernel = None
_tried = False


def _build_flags() -> tuple[str, list[str]]:
    """(extension name, compiler flags) for this CPU. The name carries the instruction set,
    so a cache directory shared by different machines never hands one the other's build."""
    vector_isa = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    flags = ["-O3"] + (["-mavx2", "-mfma"] if vector_isa else [])
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")  # at::parallel_for runs on PyTorch's OpenMP threads
    return f"minillm_paged_decode_cpu_{'avx2' if vector_isa else 'generic'}", flags


def load_kernel():
    """The compiled extension, or None if switched off or not buildable here (warns once)."""
    global _kernel, _tried
    if os.environ.get("MINILLM_CPU_KERNEL", "1") == "0":
        return None
    if not _tried:
        _tried = True
        name, flags = _build_flags()
        try:
            from torch.utils.cpp_extension import load

            _kernel = load(name, [str(SOURCE)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                           verbose=False)
        except Exception as e:  # compiler, ninja or headers missing: keep the torch path
            warnings.warn(f"minillm: could not build the CPU paged-decode kernel ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[-1] if str(e).strip() else e!r}); "
                          "the engine uses the slower PyTorch gather path instead",
                          RuntimeWarning, stacklevel=2)
    return _kernel


def supports(k_cache: torch.Tensor) -> bool:
    """Can the kernel serve this cache? fp32 on the CPU, head_dim a multiple of 8."""
    return (k_cache.device.type == "cpu" and k_cache.dtype == torch.float32
            and k_cache.shape[-1] % 8 == 0)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     sm_scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D], the same contract as `paged_decode_attention_ref`.

    k_cache / v_cache [num_blocks, block_size, Hkv, D] fp32; block_tables [B, max_blocks]
    and context_lens [B] (any integer dtype). Raises RuntimeError if the kernel is not
    available here (check `load_kernel()` first) and ValueError on bad arguments (the
    kernel checks devices, dtypes, shapes and every index it will follow)."""
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU paged-decode kernel is not available here (switched off "
                           "by MINILLM_CPU_KERNEL=0, or it failed to build: see the warning)")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    try:
        return kernel.paged_decode_cpu(q.contiguous(), k_cache, v_cache,
                                       block_tables.to(torch.int32).contiguous(),
                                       context_lens.to(torch.int32).contiguous(), scale)
    except RuntimeError as e:  # the kernel's argument checks (TORCH_CHECK) raise these
        raise ValueError(str(e).splitlines()[0]) from None


def main() -> None:
    """Build (or load) the kernel now and say how it went: `make setup` calls this."""
    import time

    t0 = time.perf_counter()
    kernel = load_kernel()
    if kernel is None:
        print("minillm: the CPU paged-decode kernel is not available; the engine will use "
              "the PyTorch gather path")
    else:
        print(f"minillm: CPU paged-decode kernel ready ({kernel.__file__}, "
              f"{time.perf_counter() - t0:.0f} s)")
