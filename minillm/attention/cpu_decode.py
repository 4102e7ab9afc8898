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
MINILLM_CPU_KERNEL=0 switches it off. Whether it beats the gather path on this host is
measured once (`minillm.cpu_select`, `groups` below, on a decode step shaped like the
engine's); `preferred()` is the answer `attention.paged.choose_decode_path` takes.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import cpp_extension, cpu_select

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"


@cpp_extension.register("paged-decode attention")
def load_kernel():
    """The compiled extension, or None if switched off or not buildable here (warns once)."""
    return cpp_extension.load("minillm_paged_decode_cpu", SOURCE,
                              "the engine uses the slower PyTorch gather path")


def preferred() -> bool:
    """Should the engine's decode rows take the kernel rather than the gather path here?
    (The measured choice, `minillm.cpu_select`; True for MINILLM_CPU_KERNEL=default or a
    forced build, False when the kernels are off.)"""
    return cpp_extension.enabled() and cpu_select.choice("paged_decode", "float32",
                                                         cpu_select.ALL_ROWS) != "gather"


# What the selection measures: one decode step's attention over MEASURE_LAYERS layers of a
# paged cache shaped like SmolLM2's (9 query heads, 3 KV heads of 64, blocks of 16), for
# 32 sequences with contexts 32..512 (sorted, as the engine's runner sorts its decodes),
# blocks scattered over the pool: the kernel against the gather path.
MEASURE_LAYERS = 4


@cpu_select.tuner("paged_decode", "paged-decode attention")
def groups(isas: tuple[str, ...]) -> list[cpu_select.Group]:
    """The selection's one group: the kernel's single build against the gather path."""
    variant = cpp_extension.default_isa(isas=isas)
    return [cpu_select.Group("paged_decode", "float32", (cpu_select.ALL_ROWS,), (variant,),
                             "gather", _workload)]


def _workload(variant: str, bucket: str):
    from .paged import PagedAttentionMetadata, decode_attention_gathered

    if variant != "gather" and load_kernel() is None:
        return None
    g = torch.Generator().manual_seed(0)
    hq, hkv, dim, block_size, batch = 9, 3, 64, 16, 32
    lens = sorted(torch.randint(32, 513, (batch,), generator=g).tolist())
    blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks), generator=g).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(perm[at:at + n])
        at += n
    caches = [(torch.randn(len(perm), block_size, hkv, dim, generator=g),
               torch.randn(len(perm), block_size, hkv, dim, generator=g))
              for _ in range(MEASURE_LAYERS)]
    q = torch.randn(batch, hq, dim, generator=g)
    meta = PagedAttentionMetadata.build([(t, n - 1, 1) for t, n in zip(tables, lens)],
                                        block_size, decode_groups=variant == "gather")
    if variant == "gather":
        return lambda: [decode_attention_gathered(q[i:j], k, v, slots, mask)
                        for k, v in caches for i, j, slots, mask in meta.decode_groups]
    return lambda: [paged_decode_cpu(q, k, v, meta.decode_block_tables, meta.decode_context_lens)
                    for k, v in caches]


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
