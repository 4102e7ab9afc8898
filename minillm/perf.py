"""Measure this machine: peak memory bandwidth, the bandwidth decode gets, and matmul
FLOP/s, cached on disk.

The course compares every speed it reports with *this* machine's limits, measured rather
than assumed. ``measure_machine()`` takes a few seconds on a laptop CPU, then caches its
result as JSON so later calls are instant; ``refresh=True`` measures again.

Invariants:
- Bandwidth counts the bytes a kernel must move, STREAM-style: copy = read + write
  (2 × size), triad a = b + s·c = 2 reads + 1 write (3 × size), sum = 1 read. CPU caches
  also read a line before writing it ("write-allocate"), which we do not count, so copy and
  triad can read low; we report the best of the three medians.
- The matvec stream is what batch-1 decode can actually get: y = W x over an fp32 W as
  large as SmolLM2's weights (512 MiB) with rows as short as decode's (K = 576), counting
  W's bytes. It is measured through BLAS and through the package's own few-row kernel
  (`layers.cpu_linear`, where it is built): a decode step cannot stream weights faster than
  the better of the two, so that, not STREAM's figure, is decode's honest ceiling. The two
  ceilings can differ widely: a matrix-vector product does a multiply-add per 4 bytes and
  reduces across each row, its rows are short, and BLAS's gemv may not use every thread.
- Matmul FLOP/s counts 2·n³ per n×n×n product (a multiply-add is 2 FLOPs).
- Timings are medians. On CUDA, work is timed with CUDA events after a synchronize.
- The cache file is keyed by device name (for a CPU also its family and model numbers: a
  hypervisor may name Zen 4 and Zen 5 both "AMD EPYC") and torch thread count, and reused
  only if it was measured with the same sizes.

The device and dtype choice (``minillm.devices``) and the timer (``minillm.timing``) are
re-exported here: ``perf.time_fn``, ``perf.default_device``, ``perf.default_dtype``,
``perf.device_name``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import time
import warnings
from pathlib import Path

import torch

from .devices import _dtype_key, _resolve, default_device, default_dtype, device_name  # noqa: F401
from .timing import time_fn

CACHE_ENV = "MINILLM_CACHE_DIR"

# Default problem sizes. CPU sizes keep the whole measurement to a few seconds: bandwidth
# arrays are 128 MiB (several times any L3 cache); fp16 matmuls are tiny because CPUs
# without native fp16 run them at about 1 GFLOP/s.
_DEFAULTS = {
    "cpu": {"bandwidth_bytes": 128 * 2**20, "matvec_bytes": 512 * 2**20,
            "matmul_n": {"float32": 1536, "bfloat16": 768, "float16": 192}},
    "cuda": {"bandwidth_bytes": 1024 * 2**20, "matvec_bytes": 1024 * 2**20,
             "matmul_n": {"float32": 4096, "bfloat16": 8192, "float16": 8192}},
}
_DEFAULT_REPEATS = 10
_BUDGET_S = 1.0  # rough seconds allowed per kernel measurement; repeats shrink to fit


# --------------------------------------------------------------------------- measurements


def _budgeted_median(fn, device: torch.device, repeats: int, budget_s: float = _BUDGET_S) -> float:
    """``time_fn`` with the repeats cut so the whole thing takes about ``budget_s``."""
    first = time_fn(fn, warmup=0, repeats=1, device=device)  # also the warmup
    fit = int(budget_s / max(first, 1e-9))
    return time_fn(fn, warmup=1, repeats=max(1, min(repeats, fit)), device=device)


def measure_bandwidth(device=None, num_bytes: int | None = None, repeats: int = _DEFAULT_REPEATS) -> dict[str, float]:
    """Bytes/s of copy, triad and sum over fp32 arrays of ``num_bytes`` each.

    Returns ``{"copy": ..., "triad": ..., "sum": ...}``; see the module docstring for how
    bytes are counted.
    """
    dev = _resolve(device)
    if num_bytes is None:
        num_bytes = _defaults(dev)["bandwidth_bytes"]
    n = max(1, int(num_bytes) // 4)
    size = n * 4
    a = torch.empty(n, dtype=torch.float32, device=dev).fill_(1.0)
    b = torch.empty(n, dtype=torch.float32, device=dev).fill_(2.0)
    c = torch.empty(n, dtype=torch.float32, device=dev).fill_(3.0)
    kernels = {
        "copy": (lambda: a.copy_(b), 2 * size),
        "triad": (lambda: torch.add(b, c, alpha=2.0, out=a), 3 * size),
        "sum": (lambda: b.sum(), size),
    }
    result = {}
    for name, (fn, moved) in kernels.items():
        result[name] = moved / _budgeted_median(fn, dev, repeats)
    del a, b, c
    return result


# Decode's rows: SmolLM2's hidden size. A matvec with K = 576 has the short rows (2.3 KB in
# fp32) of every product in a decode step but the LM head's transposed use; longer rows
# stream a little better.
MATVEC_K = 576


def measure_matvec_bandwidth(device=None, num_bytes: int | None = None,
                             repeats: int = _DEFAULT_REPEATS) -> dict[str, float]:
    """Bytes/s of W's bytes streamed by y = W x, fp32 W [num_bytes / (4 K), K], K = 576.

    Returns ``{"blas": ...}`` (``torch.mv``: MKL / OpenBLAS gemv on a CPU, cuBLAS on CUDA)
    and, on a CPU where the C++ kernel is built, ``"minillm": ...`` (the few-row kernel of
    ``layers.cpu_linear`` that decode uses). See the module docstring for what it means."""
    dev = _resolve(device)
    if num_bytes is None:
        num_bytes = _defaults(dev)["matvec_bytes"]
    n = max(1, int(num_bytes) // (4 * MATVEC_K))
    w = torch.randn(n, MATVEC_K, device=dev) * 0.02
    x = torch.randn(MATVEC_K, device=dev)
    moved = w.numel() * 4
    result = {name: moved / _budgeted_median(fn, dev, repeats)
              for name, fn in matvec_paths(w, x).items()}
    del w
    return result


def matvec_paths(w: torch.Tensor, x: torch.Tensor) -> dict:
    """{path: fn() -> W x [N]}: the products `measure_matvec_bandwidth` times."""
    paths = {"blas": lambda: torch.mv(w, x)}
    if w.device.type == "cpu" and w.dtype == torch.float32:
        from .layers import cpu_linear

        xm = x[None]
        # The build decode runs at one row (`cpu_select`), or the default one where BLAS is
        # chosen: the kernel's own stream either way.
        kernel = (cpu_linear.kernel_for(xm, w) if cpu_linear.applies(xm, w) else None) \
            or cpu_linear.load_kernel()
        if kernel is not None:
            paths["minillm"] = lambda: kernel.small_m_linear(xm, w)[0]
    return paths


def measure_matmul_flops(device=None, dtype=torch.float32, n: int | None = None,
                         repeats: int = _DEFAULT_REPEATS) -> float:
    """FLOP/s of an n×n by n×n matmul in ``dtype`` (2·n³ FLOPs per product).

    On CUDA, float32 is measured as torch runs it by default (TF32 off), i.e. true fp32.
    """
    dev = _resolve(device)
    if n is None:
        n = _defaults(dev)["matmul_n"][_dtype_key(dtype)]
    # Random values on the device itself (the values do not matter, only that they are not
    # zeros, which some hardware multiplies faster).
    x = torch.randn(n, n, device=dev).to(dtype)
    y = torch.randn(n, n, device=dev).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=dev)
    seconds = _budgeted_median(lambda: torch.matmul(x, y, out=out), dev, repeats)
    return 2 * n**3 / seconds


def _defaults(dev: torch.device) -> dict:
    return _DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]


# --------------------------------------------------------------------------- profile and cache


@dataclasses.dataclass
class MachineProfile:
    """What ``measure_machine`` found. Rates in bytes/s and FLOP/s; dtypes keyed by torch
    name ("float32", "bfloat16", "float16")."""

    device: str
    device_name: str
    num_threads: int
    bandwidth_bytes_per_s: float  # best of bandwidth_by_kernel
    bandwidth_by_kernel: dict[str, float]
    matvec_by_path: dict[str, float]  # measure_matvec_bandwidth: decode's honest ceiling
    matmul_flops: dict[str, float]
    measured_at: str  # ISO 8601, UTC
    measurement_s: float
    torch_version: str
    settings: dict

    @property
    def matvec_bytes_per_s(self) -> float:
        """The better matvec stream (BLAS or the package's kernel): the bandwidth a batch-1
        decode step can actually get, so its tok/s ceiling is this ÷ bytes per token."""
        return max(self.matvec_by_path.values())

    def peak_flops(self, dtype=None) -> float:
        """Measured matmul FLOP/s in ``dtype`` (default: ``default_dtype`` of the device)."""
        key = _dtype_key(default_dtype(self.device) if dtype is None else dtype)
        if key not in self.matmul_flops:
            raise ValueError(f"dtype must be one of {sorted(self.matmul_flops)}; got {dtype!r}.")
        return self.matmul_flops[key]

    def ridge_point(self, dtype=None) -> float:
        """Measured FLOPs per byte where this machine turns compute-bound."""
        return self.peak_flops(dtype) / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MachineProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"machine profile lacks fields {sorted(missing)}")
        return cls(**{k: data[k] for k in names})

    def __str__(self) -> str:
        lines = [f"{self.device_name} [{self.device}, {self.num_threads} threads, "
                 f"torch {self.torch_version}, measured {self.measured_at}]",
                 f"  bandwidth: {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s ("
                 + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in self.bandwidth_by_kernel.items()) + ")",
                 f"  matvec stream (decode's ceiling): {self.matvec_bytes_per_s / 1e9:.1f} GB/s ("
                 + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in self.matvec_by_path.items()) + ")"]
        for dt, flops in self.matmul_flops.items():
            lines.append(f"  matmul {dt}: {flops / 1e9:.1f} GFLOP/s, ridge point "
                         f"{flops / self.bandwidth_bytes_per_s:.2f} FLOP/byte")
        return "\n".join(lines)


def cache_dir() -> Path:
    """Folder for cached measurements: ``$MINILLM_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/minillm``, else ``~/.cache/minillm``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "minillm"


def _cache_path(name: str, num_threads: int, dev: torch.device | None = None) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "device"
    if dev is not None and dev.type == "cpu":
        # A hypervisor may name different CPUs alike ("AMD EPYC" for Zen 4 and Zen 5): the
        # family and model numbers tell them apart.
        from .devices import _cpuinfo_field
        family, model = _cpuinfo_field(("cpu family",)), _cpuinfo_field(("model",))
        if family or model:
            slug += f"-f{family}m{model}"
    return cache_dir() / f"machine-{slug}-{num_threads}threads.json"


def _settings(dev: torch.device, bandwidth_bytes, matmul_n, repeats, matvec_bytes=None) -> dict:
    defaults = _defaults(dev)
    sizes = dict(defaults["matmul_n"])
    if isinstance(matmul_n, int):
        sizes = {k: matmul_n for k in sizes}
    elif matmul_n is not None:
        unknown = set(matmul_n) - set(sizes)
        if unknown:
            raise ValueError(f"matmul_n keys must be among {sorted(sizes)}; got {sorted(unknown)}.")
        sizes.update(matmul_n)
    return {
        "bandwidth_bytes": int(bandwidth_bytes or defaults["bandwidth_bytes"]),
        "matvec_bytes": int(matvec_bytes or defaults["matvec_bytes"]),
        "matmul_n": sizes,
        "repeats": int(repeats or _DEFAULT_REPEATS),
    }


def _measure_profile(dev: torch.device, settings: dict) -> MachineProfile:
    t0 = time.perf_counter()
    bandwidth = measure_bandwidth(dev, settings["bandwidth_bytes"], settings["repeats"])
    matvec = measure_matvec_bandwidth(dev, settings["matvec_bytes"], settings["repeats"])
    flops = {}
    for key, n in settings["matmul_n"].items():
        try:
            flops[key] = measure_matmul_flops(dev, getattr(torch, key), n, settings["repeats"])
        except RuntimeError as err:  # a dtype this backend cannot multiply: leave it out
            warnings.warn(f"skipping {key} matmul on {dev}: {err}", stacklevel=3)
    return MachineProfile(
        device=str(dev),
        device_name=device_name(dev),
        num_threads=torch.get_num_threads(),
        bandwidth_bytes_per_s=max(bandwidth.values()),
        bandwidth_by_kernel=bandwidth,
        matvec_by_path=matvec,
        matmul_flops=flops,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
        measurement_s=time.perf_counter() - t0,
        torch_version=torch.__version__,
        settings=settings,
    )


def measure_machine(device=None, refresh: bool = False, *, bandwidth_bytes: int | None = None,
                    matmul_n: int | dict[str, int] | None = None,
                    repeats: int | None = None,
                    matvec_bytes: int | None = None) -> MachineProfile:
    """Measure (or load from cache) this machine's bandwidth (STREAM and matvec) and matmul
    FLOP/s.

    ``device``: None for ``default_device()``, or "cpu", "cuda", "cuda:1", ...
    ``refresh``: measure again even if a cached result exists.
    ``bandwidth_bytes`` (bytes per array), ``matvec_bytes`` (the matvec's matrix),
    ``matmul_n`` (one size, or a dict per dtype) and ``repeats`` override the default sizes,
    e.g. tiny ones in tests. A cached result is
    reused only if it was measured with the same settings.
    """
    dev = _resolve(device)
    settings = _settings(dev, bandwidth_bytes, matmul_n, repeats, matvec_bytes)
    path = _cache_path(device_name(dev), torch.get_num_threads(), dev)
    if not refresh and path.exists():
        try:
            cached = MachineProfile.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if cached.settings == settings and cached.device == str(dev):
                return cached
        except (OSError, ValueError, TypeError):
            pass  # unreadable or stale cache: measure again and overwrite it
    profile = _measure_profile(dev, settings)
    if not all(math.isfinite(v) and v > 0 for v in [profile.bandwidth_bytes_per_s, *profile.matvec_by_path.values(), *profile.matmul_flops.values()]):
        raise RuntimeError(f"measurement gave non-positive or non-finite rates: {profile}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_dict(), indent=2), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"could not cache the machine profile in {path}: {err}", stacklevel=2)
    return profile
