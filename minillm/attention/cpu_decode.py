"""Decode attention over the paged KV cache on the CPU, reading K/V in place.

The serving engine's PyTorch decode path (`minillm.attention.paged`) gathers every decoding
sequence's K/V out of the block pool with `index_select`, then runs SDPA over the copy: the
cache crosses memory three times (read, write, read again), and on 2 cores that gather and
attention took a third of a 64-sequence decode step. `csrc/paged_decode_cpu.cpp` is the
CPU counterpart of the Triton `paged_decode_attention`: it follows the block table itself
and reads each K/V row once. `benchmarks/serving.py` measures both paths side by side.

The kernel is C++, built on first use by `minillm.cpp_extension` (about 40 s once, then
cached; `make setup` builds it ahead). Where it cannot be built, `load_kernel()` warns once
and returns None, and the engine keeps the PyTorch path: same results, slower.
MINILLM_CPU_KERNEL=0 switches it off.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import cpp_extension

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"


@cpp_extension.register("paged-decode attention")
def load_kernel():
    """The compiled extension, or None if switched off or not buildable here (warns once)."""
    return cpp_extension.load("minillm_paged_decode_cpu", SOURCE,
                              "the engine uses the slower PyTorch gather path")


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
