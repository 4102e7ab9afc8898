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

The contiguous cache of `minillm.generate` ([B, max_seq, Hkv, D] per layer) is a paged cache
too: blocks of max_seq slots, row b being block b (`ContiguousDecode`). There the
alternative is SDPA straight over the cache (no gather), and a batch-1 decode step calls
attention 30 times: SDPA's per-call setup cost ~9 µs more than the kernel's, a quarter of a
millisecond per step. That choice is measured separately (`contiguous_preferred()`).
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
    (The measured choice, `minillm.cpu_select`, on an fp32 cache; a bf16 engine takes the
    same choice: its gather path runs SDPA in bf16, slower still. True for
    MINILLM_CPU_KERNEL=default or a forced build, False when the kernels are off.)"""
    return cpp_extension.enabled() and cpu_select.choice("paged_decode", "float32",
                                                         cpu_select.ALL_ROWS) != "gather"


def contiguous_preferred(length: int, dtype: torch.dtype = torch.float32) -> bool:
    """Should a decode step over a contiguous cache of `dtype`, with `length` positions
    cached, take the kernel rather than SDPA here? (The measured choice for its dtype and
    `context_bucket`; True for MINILLM_CPU_KERNEL=default or a forced build, False when the
    kernels are off or for a dtype the kernel does not take.)"""
    return cpp_extension.enabled() and cpu_select.choice(
        "paged_decode", contiguous_group(dtype), context_bucket(length)) not in (None, "sdpa")


# Buckets of the contiguous group, by context length, each measured at the length given. At
# batch 1 the kernel splits the sequence's positions over the threads from 64 positions on
# (split-K, see the .cpp), and SDPA splits the heads: the two differ in fixed cost per call
# (short contexts) and in how they stream the cache (long ones), so each bucket is measured.
CONTEXT_BUCKETS = {"context 1-127": 64, "context 128-511": 256, "context 512+": 1024}


def context_bucket(length: int) -> str:
    """The bucket of `CONTEXT_BUCKETS` that a context of `length` positions falls in."""
    return ("context 1-127" if length < 128 else "context 128-511" if length < 512
            else "context 512+")


# What the selection measures: one decode step's attention over MEASURE_LAYERS layers of a
# paged cache shaped like SmolLM2's (9 query heads, 3 KV heads of 64, blocks of 16), for
# 32 sequences with contexts 32..512 (sorted, as the engine's runner sorts its decodes),
# blocks scattered over the pool: the kernel against the gather path.
MEASURE_LAYERS = 4


# The cache dtypes the kernel reads, and the contiguous groups, one per dtype: batch-1
# decode over generate's cache (CONTEXT_BUCKETS). In bf16 the alternative is SDPA in bf16,
# about twice its fp32 time.
DTYPES = (torch.float32, torch.bfloat16)


def contiguous_group(dtype: torch.dtype) -> str:
    """The name of the contiguous group of `dtype`, e.g. "float32 contiguous"."""
    return f"{str(dtype).removeprefix('torch.')} contiguous"


@cpu_select.tuner("paged_decode", "paged-decode attention")
def groups(isas: tuple[str, ...]) -> list[cpu_select.Group]:
    """The selection's groups: the kernel's single build against the gather path (the
    engine's paged cache), and against SDPA (generate's contiguous cache)."""
    variant = cpp_extension.default_isa(isas=isas)
    return [cpu_select.Group("paged_decode", "float32", (cpu_select.ALL_ROWS,), (variant,),
                             "gather", _workload),
            *(cpu_select.Group("paged_decode", contiguous_group(dtype), tuple(CONTEXT_BUCKETS),
                               (variant,), "sdpa", _contiguous_workload(dtype))
              for dtype in DTYPES)]


def _contiguous_workload(dtype: torch.dtype):
    """make(variant, bucket) for the contiguous group of `dtype`."""
    def make(variant: str, bucket: str):
        if variant != "sdpa" and load_kernel() is None:
            return None
        return _contiguous_pass(variant, dtype, CONTEXT_BUCKETS[bucket])
    return make


# A batch-1 step's attention over all of SmolLM2's layers: each layer's cache is read once
# per step and is cold by then (the layer's weights streamed through the caches since), so
# the measurement streams a whole step's K/V (24 MB at 1024 positions in bf16) rather than
# re-reading a few layers that stay in L2/L3. Timed over 4 warm layers, the kernel's one
# thread at 1024 positions lost to SDPA's two, while over generate's real step it won
# (benchmarks/long_context_decode.py).
CONTIGUOUS_LAYERS = 30


def _contiguous_pass(variant: str, dtype: torch.dtype, length: int):
    from .backends import decode_attention

    g = torch.Generator().manual_seed(0)
    hq, hkv, dim, max_seq = 9, 3, 64, length + 1
    caches = [(torch.randn(1, max_seq, hkv, dim, generator=g).to(dtype),
               torch.randn(1, max_seq, hkv, dim, generator=g).to(dtype))
              for _ in range(CONTIGUOUS_LAYERS)]
    q = torch.randn(1, hq, dim, generator=g).to(dtype)
    if variant == "sdpa":  # what TorchBackend.dense runs for one query over the cache
        return lambda: [decode_attention(q, k[:, :length].transpose(1, 2),
                                         v[:, :length].transpose(1, 2)) for k, v in caches]
    attend = ContiguousDecode(1)  # made once, as a generation's context makes it
    return lambda: [attend(q, k, v, length) for k, v in caches]


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
    """Can the kernel serve this cache? `DTYPES` on the CPU, head_dim a multiple of 8 (q must
    have the cache's dtype)."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in DTYPES
            and k_cache.shape[-1] % 8 == 0)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     sm_scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D], the same contract as `paged_decode_attention_ref`.

    k_cache / v_cache [num_blocks, block_size, Hkv, D] fp32 or bf16 (q the same: the sums
    are fp32 and the output is rounded to q's dtype once); block_tables [B, max_blocks]
    and context_lens [B] (any integer dtype). Raises RuntimeError if the kernel is not
    available here (check `load_kernel()` first) and ValueError on bad arguments (the
    kernel checks devices, dtypes, shapes and every index it will follow)."""
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU paged-decode kernel is not available here (switched off "
                           "by MINILLM_CPU_KERNEL=0, or it failed to build: see the warning)")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    try:
        return kernel.paged_decode_cpu(q.contiguous(), k_cache, v_cache, _int32(block_tables),
                                       _int32(context_lens), scale)
    except RuntimeError as e:  # the kernel's argument checks (TORCH_CHECK) raise these
        raise ValueError(str(e).splitlines()[0]) from None


class ContiguousDecode:
    """One query per row over a contiguous cache, for the layers of one generation of batch
    B: `self(q [B, Hq, D], k_cache, v_cache [B, max_seq, Hkv, D], length)` -> [B, Hq, D],
    the caches (fp32 or bf16, contiguous) filled in their first `length` slots of every row
    and read in place as B blocks of max_seq slots.

    The block table (row b is block b) is made once, the context lengths once per step, and
    the 30 layers of a step share them. Made with the generation's context, before its
    prefill, so that every decode step issues the same operators (`measure.count_step_ops`
    counts them per step)."""

    def __init__(self, batch: int):
        self.block_tables = torch.arange(batch, dtype=torch.int32)[:, None]
        self._length, self._context_lens = None, None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 length: int, sm_scale: float | None = None) -> torch.Tensor:
        if not 1 <= length <= k_cache.shape[1]:
            raise ValueError(f"length must be 1 to max_seq = {k_cache.shape[1]}, got {length}")
        if length != self._length:
            self._length = length
            self._context_lens = torch.full((self.block_tables.shape[0],), length,
                                            dtype=torch.int32)
        return paged_decode_cpu(q, k_cache, v_cache, self.block_tables, self._context_lens,
                                sm_scale)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int32 tensor (itself when it is one: no op on a decode step)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
