"""Pinned Triton tile configurations: measured once per GPU architecture, kept in the repo.

A Triton kernel's speed depends on its tiles (``BLOCK_*``), warps and pipeline stages, and
the best choice depends on the GPU. Triton's autotuner finds it by compiling and timing
every candidate on the first call of each new key: on an H100 that cost up to 42 s for one
new flash-attention shape, and timing must never happen inside a CUDA-graph capture. Here
the search is something you ask for, not something a first run pays:

* Each kernel is a `Tunable`: its candidate configs, a default that is valid on every GPU,
  the config the interpreter runs, and its *bucket space*: a finite key (head dim, a coarse
  length class, dtype width ...) that every call's shape maps to, so that changing lengths
  never mean a new search and the pinned file can cover every key.
* ``configs/sm_XY.json`` holds one config per kernel and bucket for one architecture
  (sm_90: H100 / H200, sm_80: A100), each with its ``source``: measured on a named GPU, or
  carried over from the nearest measured bucket and checked to fit by compiling it ahead of
  time (``benchmarks/pin_configs.py`` writes and checks the files).
* A call looks its config up (a dict lookup: no timing, no host sync) and launches it, so
  the first call of a new shape compiles exactly one config.
* ``MINILLM_AUTOTUNE=1`` (or ``set_autotune(True)``; ``gpu_check.py --autotune``): the first
  call of each bucket times every candidate (``triton.testing.do_bench``, median) and keeps
  the fastest; ``measured()`` lists them and ``save_measured()`` merges them into the
  architecture's file.

Invariants:

* ``Tunable.run`` never times anything unless autotuning was asked for, and never while a
  CUDA graph is being captured (it then uses the pinned config).
* A launch function may be called several times (autotuning calls it once per candidate):
  it must rewrite its whole output each time (a kernel that accumulates zeroes first).
* An architecture without a file of its own uses the newest older file of the same major
  (sm_86 and sm_89 use sm_80), or the newest file for a newer major (an older GPU, none:
  each kernel's rule, ``analytic``, or its default); a pinned config the
  device cannot run (Triton's ``OutOfResources``: less shared memory) falls back to the
  kernel's default, or the smallest candidate that fits, with one warning.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch
import triton

from .interpreter import interpreter_enabled

CONFIG_DIR = Path(__file__).with_name("configs")
PINNED_ARCHS = (80, 90)  # the architectures with a file in CONFIG_DIR
CONFIG_FIELDS = ("num_warps", "num_stages")

_registry: dict[str, "Tunable"] = {}
_measured: dict[tuple[str, int, str], tuple[triton.Config, float]] = {}
# (kernel, arch, bucket) -> the config that ran after the pinned one did not fit
_fell_back: dict[tuple[str, int, str], triton.Config] = {}
_resolved: dict[tuple[str, str], "triton.Config | str"] = {}  # for torch.compile traces
_autotune_override: bool | None = None
# What `Tunable.run` launched for (kernel, device, bucket items) when nothing was left to
# search: the next call of that bucket is one dict lookup, not the ~7 µs of resolving it
# again (arch, key strings, file lookup, a new Config) on every eager launch. Emptied by
# whatever changes an answer: set_autotune, load_measured, save_measured, a search.
_ready: dict[tuple, triton.Config] = {}


def load_measured(path: str | Path) -> int:
    """Use the configs a `gpu_check --autotune` run measured (its ``tuned`` JSON) in this
    process, ahead of the pinned ones, without pinning them; returns how many. Read at
    import from ``MINILLM_TUNED`` (paths separated by os.pathsep): the next process of one
    GPU session uses what an earlier one measured."""
    rows = json.loads(Path(path).read_text())["measured"]
    for row in rows:
        cfg = config_from_dict({k: v for k, v in row.items()
                                if k not in ("kernel", "arch", "bucket")})
        _measured[(row["kernel"], int(row["arch"]), row["bucket"])] = (cfg, float(row["us"]))
    _ready.clear()
    return len(rows)


def autotune_enabled(name: str | None = None) -> bool:
    """True when new buckets of kernel ``name`` are searched: `set_autotune`, else
    ``MINILLM_AUTOTUNE`` (``1``: every kernel; or comma-separated kernel names)."""
    if _autotune_override is not None:
        return _autotune_override
    value = os.environ.get("MINILLM_AUTOTUNE", "0").strip()
    if value.lower() in ("", "0", "false", "no"):
        return False
    if value.lower() in ("1", "true", "yes", "all"):
        return True
    return name is not None and name in {v.strip() for v in value.split(",")}


def autotune_requested() -> bool:
    """True when some kernel's buckets are searched (all of them, or those MINILLM_AUTOTUNE
    names)."""
    if _autotune_override is not None:
        return _autotune_override
    return os.environ.get("MINILLM_AUTOTUNE", "0").strip().lower() not in ("", "0", "false",
                                                                           "no")


def set_autotune(on: bool | None) -> None:
    """Search every new bucket (True), never (False), or follow MINILLM_AUTOTUNE (None).
    MINILLM_AUTOTUNE is read when a bucket is first launched: a bucket launched before the
    variable changed keeps its config; this switch applies to every bucket at once."""
    global _autotune_override
    _autotune_override = on
    _ready.clear()


# ----------------------------------------------------------------------------- configs


def config_to_dict(cfg: triton.Config) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def config_from_dict(d: dict) -> triton.Config:
    kwargs = {k: v for k, v in d.items() if k not in CONFIG_FIELDS and k not in ("source", "us")}
    return triton.Config(kwargs, num_warps=int(d["num_warps"]), num_stages=int(d["num_stages"]))


def launch_options(cfg: triton.Config) -> dict:
    """The keyword arguments that launch a ``@triton.jit`` kernel with ``cfg``."""
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def bucket_key(bucket: dict) -> str:
    """A bucket as the pinned files spell it: ``"D=64,H=16,dt=16,lse=0"`` (sorted names)."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(bucket.items()))


def parse_bucket_key(key: str) -> dict:
    return {k: int(v) for k, v in (item.split("=") for item in key.split(","))}


def dtype_bits(dtype: torch.dtype) -> int:
    """The ``dt`` field of a bucket: 16 for fp16 / bf16, 32 for fp32 (twice the tile bytes)."""
    return 8 * dtype.itemsize


# ----------------------------------------------------------------------------- architectures


def device_arch(device=None) -> int:
    """The compute capability as one number: 90 for an H100, 80 for an A100."""
    major, minor = _capability(torch.device("cuda") if device is None else torch.device(device))
    return 10 * major + minor


@lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def file_arch(arch: int) -> int | None:
    """Which pinned file serves ``arch`` (see the module docstring), or None (defaults)."""
    same_major = [a for a in PINNED_ARCHS if a // 10 == arch // 10 and a <= arch]
    if same_major:
        return max(same_major)
    newer = [a for a in PINNED_ARCHS if a // 10 < arch // 10]
    return max(newer) if newer else None


def config_path(arch: int) -> Path:
    return CONFIG_DIR / f"sm_{arch}.json"


@lru_cache(maxsize=None)
def pinned_table(arch: int) -> dict:
    """{kernel name: {bucket key: config dict}} of the file for ``arch`` (empty if none)."""
    path = config_path(arch)
    if not path.exists():
        return {}
    return json.loads(path.read_text())["kernels"]


# ----------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class Tunable:
    """One Triton kernel's tiles: candidates, default, interpreter config, bucket space.

    ``signature`` and ``constexprs`` serve ahead-of-time compilation (the pinned files'
    checks): the Triton types of the arguments that are not int32 scalars, with ``{dt}`` for
    the activation dtype (a dict, or a function of the bucket where the types depend on it:
    `signature_for`), and the constexpr arguments a bucket implies besides the config's.
    ``analytic`` (optional): a candidate chosen for a bucket by reasoning about its shapes,
    which ``pin_configs.py --fill`` pins where nothing measured is near (before the default).
    ``unit_strides``: see the field. ``searchable=False``: ``MINILLM_AUTOTUNE`` never
    searches this kernel; its candidates are timed by a benchmark of its own, which hands
    the fastest to `record_measured` (the decode GEMV's, from CUDA graphs over weights
    larger than L2: do_bench's loop re-reads a small weight from L2).
    """

    name: str
    fn: object
    configs: tuple
    default: triton.Config
    interpreter: triton.Config
    bucket_space: dict
    signature: dict | Callable[[dict], dict]
    constexprs: Callable[[dict], dict]
    analytic: Callable[[dict], triton.Config] | None = None
    # The arguments every launch passes as 1, each tensor's innermost stride: Triton makes
    # an argument equal to 1 a constant, and only then vectorizes (and pipelines) the loads
    # along it. Ahead-of-time checks compile them so (benchmarks/pin_configs.py).
    unit_strides: tuple[str, ...] = ()
    searchable: bool = True

    def signature_for(self, bucket: dict) -> dict:
        """The argument types of a launch in ``bucket`` (see ``signature``)."""
        return self.signature(bucket) if callable(self.signature) else self.signature

    def buckets(self) -> list[dict]:
        """Every bucket of the space, as dicts."""
        names = sorted(self.bucket_space)
        return [dict(zip(names, values))
                for values in itertools.product(*(self.bucket_space[n] for n in names))]

    def distance(self, a: dict, b: dict) -> tuple:
        """How far bucket ``b`` is from ``a``, to carry a measured config to a bucket nothing
        measured (``pin_configs.py --fill``): same dtype width first, then same head dim,
        then the fewest steps apart, class by class, in ``bucket_space`` (its classes are
        ordered: length, N, K, M). Counting differing classes alone tied a long-sequence
        bucket between the shortest and the next-shorter class, and the tie went to the
        shortest: FlashAttention at T = 4,096-8,192 ran on T <= 256's tiles, 0.68x SDPA on
        an H100 where the autotuned run had 0.87x. A value outside the space counts as the
        whole space away."""
        def steps(k):
            space = list(self.bucket_space.get(k, ()))
            if a[k] == b.get(k):
                return 0
            if a[k] in space and b.get(k) in space:
                return abs(space.index(a[k]) - space.index(b[k]))
            return max(1, len(space))
        return (a.get("dt") != b.get("dt"), a.get("D") != b.get("D"), sum(map(steps, a)))

    def check_bucket(self, bucket: dict) -> str:
        key = bucket_key(bucket)
        for name, value in bucket.items():
            if name not in self.bucket_space or value not in self.bucket_space[name]:
                raise ValueError(f"{self.name}: bucket {key} lies outside the kernel's bucket "
                                 f"space {self.bucket_space} (a bug in the kernel's wrapper)")
        return key

    def pinned(self, bucket: dict, arch: int) -> triton.Config:
        """The config pinned for ``bucket`` on ``arch``; where none is (a GPU older than
        every file), the kernel's rule for the bucket (``analytic``), else its default."""
        source = file_arch(arch)
        entry = pinned_table(source).get(self.name, {}).get(bucket_key(bucket)) \
            if source is not None else None
        if entry and "unsupported" in entry:
            raise ValueError(f"{self.name}: this shape class ({bucket_key(bucket)}) does not fit "
                             f"a sm_{arch} GPU: {entry['unsupported']}; use a smaller head "
                             f"dim or group, or 16-bit inputs")
        if entry:
            return config_from_dict(entry)
        return self.analytic(bucket) if self.analytic is not None else self.default

    def config_for(self, bucket: dict, device=None) -> triton.Config:
        """The config a call in ``bucket`` launches with on ``device`` (no search)."""
        if interpreter_enabled():
            return self.interpreter
        return self.config_on(bucket, device_arch(device))

    def config_on(self, bucket: dict, arch: int) -> triton.Config:
        """The config a call in ``bucket`` launches with on a GPU of ``arch``: the one that
        ran after the pinned one did not fit, else this process's measurement, else the
        pinned one."""
        key = self.check_bucket(bucket)
        if (self.name, arch, key) in _fell_back:
            return _fell_back[(self.name, arch, key)]
        found = _measured.get((self.name, arch, key))
        return found[0] if found else self.pinned(bucket, arch)

    def run(self, bucket: dict, launch: Callable[[triton.Config], None], device=None) -> None:
        """Launch through ``launch(config)`` with this bucket's config (see the module doc)."""
        if torch.compiler.is_compiling():
            # Traced by torch.compile (Inductor then compiles the kernel into its graph):
            # a plain dict lookup, resolved when the kernel registered (no files, no timing).
            found = _resolved.get((self.name, bucket_key(bucket)))
            if not isinstance(found, triton.Config):
                raise ValueError(found or f"{self.name}: bucket {bucket_key(bucket)} lies "
                                 f"outside the kernel's bucket space {self.bucket_space}")
            launch(found)
            return
        if interpreter_enabled():
            launch(self.interpreter)
            return
        ready = (self.name, device, tuple(bucket.items()))
        cfg = _ready.get(ready)
        if cfg is not None:
            launch(cfg)  # resolved before, and it ran: no search is pending
            return
        arch, key = device_arch(device), self.check_bucket(bucket)
        unsearched = ((self.name, arch, key) not in _measured and self.searchable
                      and autotune_enabled(self.name))
        if unsearched and not torch.cuda.is_current_stream_capturing():
            self._search(arch, key, launch)
            unsearched = False
        cfg = self.config_for(bucket, device)
        try:
            launch(cfg)
            if not unsearched:  # a search still due (asked for, during a capture) runs later
                _ready[ready] = cfg
        except triton.runtime.errors.OutOfResources as e:
            fitted = self._first_that_fits(launch, cfg, arch, key, e)
            _fell_back[(self.name, arch, key)] = fitted
            _resolved[(self.name, key)] = fitted  # what a later torch.compile trace launches
            _ready.pop(ready, None)
            warnings.warn(f"minillm.kernels: the {self.name} config pinned for bucket {key} "
                          f"({config_to_dict(cfg)}) does not fit this GPU (sm_{arch}: {e}); "
                          f"using {config_to_dict(fitted)}", RuntimeWarning, stacklevel=2)

    def _first_that_fits(self, launch, failed: triton.Config, arch: int, key: str,
                         error: Exception) -> triton.Config:
        """Launch the default, then the candidates from the smallest tiles up (a GPU with less
        shared memory than the pinned file's: an sm_86 reads sm_80's), until one fits; the
        one that ran. Each try rewrites the whole output (the launch invariant)."""
        tried = {repr(config_to_dict(failed))}
        for cfg in (self.default, *sorted(self.configs, key=tile_size)):
            if repr(config_to_dict(cfg)) in tried:
                continue
            tried.add(repr(config_to_dict(cfg)))
            try:
                launch(cfg)
                return cfg
            except triton.runtime.errors.OutOfResources:
                continue
        raise RuntimeError(f"{self.name}: no candidate tile fits this GPU (sm_{arch}) for shape "
                           f"class {key}, the default {config_to_dict(self.default)} included: "
                           f"{error}") from error

    def _search(self, arch: int, key: str, launch) -> None:
        from triton.testing import do_bench

        times = {}
        for cfg in self.configs:
            try:
                times[cfg] = do_bench(lambda c=cfg: launch(c), warmup=5, rep=25,
                                      return_mode="median")
            except (triton.runtime.errors.OutOfResources, triton.CompilationError):
                continue  # does not fit or compile for this GPU: not a candidate here
        if not times:
            raise RuntimeError(f"{self.name}: no candidate config ran for bucket {key} on sm_{arch}")
        best = min(times, key=times.get)
        _measured[(self.name, arch, key)] = (best, times[best] * 1e3)
        _ready.clear()


def tile_size(cfg: triton.Config) -> tuple:
    """A rough order of a config's shared memory, smallest first: its tile's elements times
    its pipeline stages, then its warps."""
    elements = 1
    for name, value in cfg.kwargs.items():
        if name.startswith("BLOCK"):
            elements *= value
    return (elements * cfg.num_stages, cfg.num_warps)


def register(tunable: Tunable) -> Tunable:
    """Add a kernel's Tunable to the registry (each kernel module does, at import), and on a
    CUDA machine resolve its configs for the current GPU (what a torch.compile trace reads)."""
    _registry[tunable.name] = tunable
    if torch.cuda.is_available() and not interpreter_enabled():
        try:
            arch = device_arch()
        except (AssertionError, RuntimeError):  # a CPU build told it has CUDA (the AOT scripts)
            return tunable
        resolve_for_tracing(tunable, arch)
    return tunable


def resolve_for_tracing(tunable: Tunable, arch: int) -> None:
    """Fill `_resolved` with every bucket's config on ``arch`` (or why it is unsupported)."""
    for bucket in tunable.buckets():
        key = bucket_key(bucket)
        try:
            found: triton.Config | str = (_measured[(tunable.name, arch, key)][0]
                                          if (tunable.name, arch, key) in _measured
                                          else tunable.pinned(bucket, arch))
        except ValueError as e:
            found = str(e)
        _resolved[(tunable.name, key)] = found


def tunables() -> dict[str, Tunable]:
    """Every registered kernel by name (importing ``minillm.kernels`` registers them all)."""
    from . import decode_gemv, flash_attention, paged_decode, w4a16  # noqa: F401  (they register)

    return dict(_registry)


# ----------------------------------------------------------------------------- measurements


def record_measured(name: str, arch: int, bucket: dict, cfg: triton.Config, us: float) -> None:
    """Keep ``cfg`` as measured for kernel ``name``'s ``bucket`` on ``arch`` (``us`` per call):
    for a kernel whose candidates a benchmark of its own times (``searchable=False``). This
    process then launches it, and `measured` / `save_measured` report it like a search's."""
    key = _registry[name].check_bucket(bucket)
    _measured[(name, arch, key)] = (cfg, float(us))
    _resolved[(name, key)] = cfg
    _ready.clear()


@contextlib.contextmanager
def trying(name: str, arch: int, bucket: dict, cfg: triton.Config) -> Iterator[None]:
    """Launch ``cfg`` for kernel ``name``'s ``bucket`` on ``arch`` inside the block, as if it
    had been measured; afterwards what was there before (a measurement, or none: the
    pinned config) is back. For a benchmark that times candidates through the kernel's own
    wrapper (gpu_check's w4a16_tiles); it then keeps the fastest with `record_measured`.
    A candidate that does not fit the GPU launches the fallback `run` finds (`config_on`
    then answers that one, not ``cfg``) only inside the block. Not thread-safe."""
    key = _registry[name].check_bucket(bucket)
    tables = ((_measured, (name, arch, key)), (_resolved, (name, key)),
              (_fell_back, (name, arch, key)))  # a candidate that does not fit falls back
    before = [table.pop(k, None) for table, k in tables]
    _measured[(name, arch, key)] = (cfg, 0.0)
    _resolved[(name, key)] = cfg
    _ready.clear()
    try:
        yield
    finally:
        for (table, k), old in zip(tables, before):
            if old is None:
                table.pop(k, None)
            else:
                table[k] = old
        _ready.clear()


def measured() -> list[dict]:
    """What this process's autotuning found: one dict per (kernel, arch, bucket)."""
    return [{"kernel": name, "arch": arch, "bucket": key, "us": round(us, 2),
             **config_to_dict(cfg)}
            for (name, arch, key), (cfg, us) in sorted(_measured.items(), key=lambda kv: kv[0])]


def save_measured(source: str, path: Path | None = None) -> list[Path]:
    """Merge this process's measurements into the pinned file of each measured architecture
    (or into ``path``, for one architecture); every entry written says ``source`` (the GPU,
    the date, the versions). Returns the files written."""
    written = []
    for arch in sorted({a for _, a, _ in _measured}):
        target = path or config_path(arch)
        data = (json.loads(target.read_text()) if target.exists()
                else {"arch": f"sm_{arch}", "kernels": {}})
        for (name, a, key), (cfg, us) in sorted(_measured.items(), key=lambda kv: kv[0]):
            if a == arch:
                data["kernels"].setdefault(name, {})[key] = {
                    **config_to_dict(cfg), "us": round(us, 2), "source": f"measured: {source}"}
        write_table(target, data)
        written.append(target)
    pinned_table.cache_clear()
    _ready.clear()
    return written


def write_table(path: Path, data: dict) -> None:
    """Write a pinned file: kernels and buckets sorted, one bucket per line (stable diffs)."""
    lines = ["{", f' "arch": {json.dumps(data["arch"])},', ' "kernels": {']
    kernels = sorted(data["kernels"].items())
    for i, (name, entries) in enumerate(kernels):
        lines.append(f"  {json.dumps(name)}: {{")
        items = sorted(entries.items())
        lines += [f"   {json.dumps(key)}: {json.dumps(entry)}" + ("," if j < len(items) - 1 else "")
                  for j, (key, entry) in enumerate(items)]
        lines.append("  }" + ("," if i < len(kernels) - 1 else ""))
    lines += [" }", "}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


for _path in filter(None, os.environ.get("MINILLM_TUNED", "").split(os.pathsep)):
    load_measured(_path)
