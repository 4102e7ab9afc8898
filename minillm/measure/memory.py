"""Peak memory of one attention call, on the device it runs on.

``attention_peak_growth(impl, seq_len, device=None)`` runs ``naive_attention`` or
``tiled_attention`` (``minillm.kernels.tiled``) once with SmolLM2's heads (9 query, 3 KV,
D = 64, fp32, causal, batch 1) and returns how many bytes its peak memory grew during the
call:

- on a CPU, in a child Python process: the growth of that process's peak resident set size
  (``VmHWM``, the kernel's high-water mark of its address space; ``ru_maxrss`` where there
  is no /proc). Each call starts a new process (the high-water mark of this one would hide
  anything below it). RSS is coarse: growths of a few tens of MiB move by ~10 MiB from run
  to run, so compare hundreds of MB (T >= 1024 for naive attention);
- on CUDA, in this process: the growth of the caching allocator's peak
  (``torch.cuda.max_memory_allocated``, reset just before the call), exact to the byte.

Invariants, both ways: a warm-up call on tiny inputs comes first, so library
initialisation is not counted; the inputs are allocated before the mark is read, so only
what the call itself allocates (its temporaries and its output) is counted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ..devices import resolve_device

IMPLS = ("naive_attention", "tiled_attention")
_ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from minillm.kernels.tiled import naive_attention, tiled_attention


def peak_bytes():
    # VmHWM belongs to this process's own address space. ru_maxrss does not: Linux carries
    # the parent's high-water mark across fork + exec, so a child of a big Jupyter kernel
    # would start with the kernel's peak and show no growth at all.
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


impl, t = {impl!r}, {t}
fn = naive_attention if impl == "naive_attention" else (
    lambda q, k, v, causal: tiled_attention(q, k, v, causal=causal, block_m=256, block_n=256))
g = torch.Generator().manual_seed(0)
small = [torch.randn(1, 9 if i == 0 else 3, 64, 64, generator=g) for i in range(3)]
fn(*small, causal=True)  # warm-up: library initialisation is not counted
q = torch.randn(1, 9, t, 64, generator=g)
k, v = torch.randn(1, 3, t, 64, generator=g), torch.randn(1, 3, t, 64, generator=g)
before = peak_bytes()
out = fn(q, k, v, causal=True)
print(peak_bytes() - before)
"""


def attention_peak_growth(impl: str, seq_len: int, threads: int = 2, device=None) -> int:
    """Bytes by which peak memory grows during one ``impl`` call at ``seq_len`` on ``device``
    (None: ``minillm.devices.default_device()``): a fresh process's peak RSS on a CPU
    (``threads`` OpenMP threads), the allocator's peak on CUDA."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    dev = resolve_device(device)
    if dev.type == "cuda":
        return _cuda_peak_growth(impl, seq_len, dev)
    code = _CHILD.format(root=str(_ROOT), impl=impl, t=seq_len)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return int(res.stdout.strip().splitlines()[-1])


def _inputs(t: int, g: torch.Generator, device: torch.device):
    heads = (9, 3, 3)  # q, k, v: SmolLM2's 9 query and 3 KV heads
    return [torch.randn(1, h, t, 64, generator=g).to(device) for h in heads]


def _cuda_peak_growth(impl: str, t: int, dev: torch.device) -> int:
    from ..kernels.tiled import naive_attention, tiled_attention

    def fn(q, k, v):
        if impl == "naive_attention":
            return naive_attention(q, k, v, causal=True)
        return tiled_attention(q, k, v, causal=True, block_m=256, block_n=256)

    g = torch.Generator().manual_seed(0)
    fn(*_inputs(64, g, dev))  # warm-up: library initialisation is not counted
    q, k, v = _inputs(t, g, dev)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.max_memory_allocated(dev)
    out = fn(q, k, v)
    torch.cuda.synchronize(dev)
    growth = torch.cuda.max_memory_allocated(dev) - before
    del q, k, v, out
    torch.cuda.empty_cache()
    return int(growth)
