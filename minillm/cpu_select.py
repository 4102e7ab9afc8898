"""Which build of each C++ CPU kernel runs each shape on this machine, or the PyTorch path
instead: measured once per CPU, cached, printed by `python -m minillm info`, overridable.

Why measure: a kernel whose vector width and tiles were chosen on one CPU can lose to BLAS
on another. The small-M linear was tuned on a Zen 5 EPYC, which runs 512-bit instructions
at full width and `vdpbf16ps` at twice Zen 4's rate; on a Zen 4 EPYC (512-bit instructions
as two 256-bit halves) the same builds made bf16 decode only 1.07x fp32 and the engine's
products 12% slower than BLAS. The next host may be either, an AVX2 Xeon or a laptop. So
at first use every C++ kernel's builds (`cpp_extension.ISAS`: avx2, avx512, avx512bf16,
where the CPU runs them) are timed against the path they replace, on the shapes they
serve, and the fastest is used for each bucket of shapes.

Vocabulary:
- a *variant* is one build of a kernel (named by its ISA) or the path it replaces: "blas"
  (`F.linear`; for W4/W8, the C++ dequantize then `F.linear`), "gather" (decode attention
  through `index_select` and SDPA) or "sdpa" (decode attention over a contiguous cache);
- a *group* is what one kernel serves for one dtype and width class, e.g. the small-M
  linear on "float32 K<1024"; its *buckets* are row counts: "1", "2-4", "5-8", "9-16" (for
  decode attention over a contiguous cache, context lengths: "context 1-127", ...).

MINILLM_CPU_KERNEL (`cpp_extension.setting`): unset or 1 measures (this module); 0 or blas
runs the PyTorch paths everywhere; default runs each kernel's default build on every
shape it takes, measuring nothing (what the code did before this module existed, and what
the test suite runs: tests/conftest.py); avx2, avx512 or avx512bf16 forces that build (the
widest build of a kernel not wider than it, for kernels with fewer builds).

Invariants:
- Only variants this CPU runs are candidates (`cpp_extension.host_isas`), and only builds
  that built; a forced ISA this CPU cannot run is refused (ValueError).
- Batch invariance where it held before: within a group, every bucket that runs a kernel
  runs the same build, so a row's bits do not depend on which other rows share the call,
  among row counts that go to the kernel (rows that go to BLAS agree to rounding).
- Ties keep the default: another build must be MARGIN faster than the default build over
  the group's buckets, and BLAS MARGIN faster than the chosen build in a bucket, to be
  chosen. Where the default stays, results stay bit-identical to the code before this
  module, and measuring the same host again gives the same choice.
- The cache file (`cache_path`) is keyed by the CPU model string, its family, model and
  stepping numbers (a hypervisor may show Zen 4 and Zen 5 both as "AMD EPYC"), the CPU
  flags that decide the builds, the thread count, torch's version and a hash of the kernel
  sources: a file whose key differs in anything is measured again and overwritten, never
  reused.
- The measurement takes a few seconds (medians of interleaved rounds, `time_variants`);
  `make setup` runs it (`cpp_extension.main`), for the process's thread count and for the
  per-rank counts of `minillm.dist` worlds of 2 and 4 ranks, so no lab cell pays it.
- One process measures at a time per cache file (an exclusive lock beside it): the ranks of
  a distributed run that start together would otherwise all measure at once, find their
  rounds disagreeing (each slows the others), trust none of them and cache nothing, and the
  next launch would measure again. The others wait, then read what it cached.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib
import json
import os
import re
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from . import cpp_extension

SCHEMA = 2  # bump when the groups, buckets or decision rule change: old caches re-measure
MARGIN = 0.05  # a non-default choice must be this much faster (see the module docstring)
ROUNDS = 5  # timed rounds per bucket, after one warm-up round; medians
# Rounds that disagree by more than this (median `spread`) mean the machine was busy: the
# choices are not trusted (the defaults run, nothing is cached; `select` warns).
NOISY = 0.3
ROW_BUCKETS = ("1", "2-4", "5-8", "9-16")
_BUCKET_BOUNDS = ((1, "1"), (4, "2-4"), (8, "5-8"), (16, "9-16"))
ALL_ROWS = "all"  # the one bucket of a group whose choice does not depend on rows


def row_bucket(rows: int) -> str:
    """The bucket of `rows` (1..16): "1", "2-4", "5-8" or "9-16"."""
    for top, name in _BUCKET_BOUNDS:
        if rows <= top:
            return name
    raise ValueError(f"rows must be 1 to 16 for a C++ kernel bucket, got {rows}")


@dataclasses.dataclass(frozen=True)
class Group:
    """One kernel on one dtype and width class: the unit within which rows keep their bits.

    `variants`: the kernel's builds this CPU runs, the default build first. `fallback`: the
    path it replaces ("blas", "gather" or "sdpa"). `make(variant, bucket)`: a function that
    runs one pass of the bucket's shapes through `variant`, or None where that build is not
    available; called only when measuring (it may allocate, and build the kernel)."""

    kernel: str
    name: str
    buckets: tuple[str, ...]
    variants: tuple[str, ...]
    fallback: str
    make: Callable[[str, str], Callable[[], object] | None]

    def key(self, bucket: str) -> str:
        return f"{self.kernel}/{self.name}/{bucket}"


# kernel name -> (title, groups(isas) -> [Group]): every kernel module with builds to choose
# from adds itself when imported (`tuner`).
TUNERS: dict[str, tuple[str, Callable[[tuple[str, ...]], list[Group]]]] = {}


def tuner(kernel: str, title: str):
    """Decorator for a kernel module's `groups(isas) -> list[Group]`: registers it under
    `kernel` (the name in the selection's keys), with `title` for `python -m minillm info`."""
    def add(groups):
        TUNERS[kernel] = (title, groups)
        return groups
    return add


def groups(isas: tuple[str, ...] | None = None) -> list[Group]:
    """Every registered kernel's groups for a CPU that runs `isas` (default: this one)."""
    for package in cpp_extension.kernel_packages():
        importlib.import_module(package)
    isas = cpp_extension.host_isas() if isas is None else isas
    return [g for kernel in sorted(TUNERS) for g in TUNERS[kernel][1](isas)]


def candidates(builds: tuple[str, ...], default: str, isas: tuple[str, ...]) -> tuple[str, ...]:
    """A group's `variants`: `default` first, then the other `builds` a CPU that runs
    `isas` can run."""
    return (default,) + tuple(b for b in builds if b in isas and b != default)


def forced_variant(variants: tuple[str, ...], isa: str) -> str:
    """The build that MINILLM_CPU_KERNEL=<isa> runs for a kernel with `variants`: the widest
    one not wider than `isa` (a kernel without such a build runs its narrowest)."""
    order = {name: i for i, name in enumerate(("generic",) + cpp_extension.ISAS)}
    fits = [v for v in variants if order.get(v, 0) <= order[isa]]
    return max(fits, key=order.get) if fits else min(variants, key=order.get)


# --------------------------------------------------------------------------- measuring


def time_variants(makers: dict[str, Callable[[], Callable[[], object] | None]],
                  rounds: int = ROUNDS) -> dict[str, list[float]]:
    """{variant: seconds of one call, per round} for the variants whose maker gives a
    function (a build that is not available gives None and is left out): one warm-up
    round, then `rounds` rounds with the variants interleaved, so the machine's drift hits
    all alike. Tests replace this with a fake that makes and times nothing."""
    fns = {name: fn for name, make in makers.items() if (fn := make()) is not None}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return times


def spread(rounds: list[float]) -> float:
    """How much the rounds of one variant disagree: (slowest - fastest) / median."""
    return (max(rounds) - min(rounds)) / statistics.median(rounds)


def decide(group: Group, times: dict[str, dict[str, float]]) -> dict[str, str]:
    """{bucket: variant} for `group` from {bucket: {variant: seconds}}: one build for every
    bucket (the fastest over all of them, the default unless another is MARGIN faster),
    then per bucket the fallback where it is MARGIN faster than that build."""
    builds = [v for v in group.variants if all(v in times[b] for b in group.buckets)]
    if not builds:
        return {b: group.fallback for b in group.buckets}
    total = {v: sum(times[b][v] for b in group.buckets) for v in builds}
    build = min(builds, key=total.get)
    if builds[0] == group.variants[0] and total[builds[0]] <= total[build] * (1 + MARGIN):
        build = builds[0]
    return {b: group.fallback if times[b][group.fallback] * (1 + MARGIN) < times[b][build]
            else build for b in group.buckets}


def measure(group_list: list[Group], timer=None) -> tuple[dict[str, str], dict[str, dict], float]:
    """(choices, median ms per bucket and variant, noise) for `group_list`, measured now
    with `timer` (default `time_variants`). noise: the median `spread` of all rounds; a
    machine busy with other work shows it (see `NOISY`)."""
    timer = timer or time_variants
    choices, timings, spreads = {}, {}, []
    for group in group_list:
        times = {}
        for bucket in group.buckets:
            rounds = timer({v: functools.partial(group.make, v, bucket)
                            for v in group.variants + (group.fallback,)})
            times[bucket] = {v: statistics.median(ts) for v, ts in rounds.items()}
            spreads += [spread(ts) for ts in rounds.values()]
            timings[group.key(bucket)] = {v: round(t * 1e3, 4) for v, t in times[bucket].items()}
        for bucket, variant in decide(group, times).items():
            choices[group.key(bucket)] = variant
    return choices, timings, statistics.median(spreads) if spreads else 0.0


# --------------------------------------------------------------------------- the selection


@dataclasses.dataclass
class Selection:
    """What runs where: `choices` maps "kernel/group/bucket" to a variant. `setting` is
    MINILLM_CPU_KERNEL's (normalized); `timings_ms` holds the measured medians (empty when
    nothing was measured); `source` says where the choices came from."""

    setting: str
    choices: dict[str, str]
    timings_ms: dict[str, dict[str, float]]
    key: dict
    measured_at: str | None = None
    measurement_s: float = 0.0
    source: str = ""

    def choice(self, kernel: str, group: str, bucket: str) -> str | None:
        """The variant for this bucket, or None where no group of this host has it."""
        return self.choices.get(f"{kernel}/{group}/{bucket}")

    def lines(self) -> list[str]:
        """One line per group: its buckets' variants, and each against the fallback where
        measured (e.g. "avx2 1.21x" = the avx2 build, 1.21 times as fast as BLAS)."""
        out, by_group = [], {}
        for key, variant in self.choices.items():
            kernel, group, bucket = key.split("/")
            by_group.setdefault((kernel, group), []).append((bucket, key, variant))
        for (kernel, group), items in by_group.items():
            title = TUNERS[kernel][0] if kernel in TUNERS else kernel
            if len({v for _, _, v in items}) == 1 and not any(
                    self.timings_ms.get(key) for _, key, _ in items):  # one variant, untimed
                rows = "" if len(items) == 1 else f" for rows {items[0][0].split('-')[0]}-" \
                    f"{items[-1][0].split('-')[-1]}"
                out.append(f"{title}, {group}: {items[0][2]}{rows}")
                continue
            parts = []
            for bucket, key, variant in items:
                t = self.timings_ms.get(key, {})
                fallback = [v for v in t if v not in cpp_extension.ISAS + ("generic",)]
                ratio = (f" {t[fallback[0]] / t[variant]:.2f}x {fallback[0]}"
                         if fallback and variant in t and variant != fallback[0] else "")
                label = ("" if bucket == ALL_ROWS else f"rows {bucket}: " if bucket[0].isdigit()
                         else f"{bucket}: ")  # row buckets are bare numbers
                parts.append(f"{label}{variant}{ratio}")
            out.append(f"{title}, {group}: " + "; ".join(parts))
        return out


def cpu_key() -> dict:
    """What a cached selection must match to be reused (see the module docstring)."""
    from .devices import _cpu_flags, _cpuinfo_field, device_name

    flags = _cpu_flags()
    relevant = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                "amx_bf16", "avx512_vnni", "avx_vnni")
    sources = sorted(Path(__file__).parent.glob("*/csrc/*.cpp")) + \
        sorted(Path(__file__).parent.glob("csrc/*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    return {"schema": SCHEMA, "cpu": device_name("cpu"),
            "family": _cpuinfo_field(("cpu family",)), "model": _cpuinfo_field(("model",)),
            "stepping": _cpuinfo_field(("stepping",)),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "flags": sorted(f for f in relevant if f in flags),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "sources": digest}


def cache_path(key: dict | None = None) -> Path:
    """The cache file for this CPU: cpu-kernels-<model>-f<family>m<model>-<threads>t.json in
    `perf.cache_dir()`."""
    from .perf import cache_dir

    key = cpu_key() if key is None else key
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key["cpu"]).strip("-").lower() or "cpu"
    return cache_dir() / (f"cpu-kernels-{slug}-f{key['family']}m{key['model']}"
                          f"-{key['threads']}t.json")


def _fixed(setting: str, group_list: list[Group]) -> dict[str, str]:
    """The choices of a setting that measures nothing: blas, default or a forced ISA."""
    choices = {}
    for g in group_list:
        if setting == "blas" or not g.variants:
            variant = g.fallback
        elif setting == "default":
            variant = g.variants[0]
        else:
            variant = forced_variant(g.variants, setting)
        choices.update({g.key(b): variant for b in g.buckets})
    return choices


def select(setting: str | None = None, refresh: bool = False, timer=None) -> Selection:
    """The selection for MINILLM_CPU_KERNEL's `setting` (default: the environment's). For
    "auto": the cached one for this CPU if its key matches, else measured now (`timer`:
    default `time_variants`) and cached; `refresh` measures again."""
    setting = cpp_extension.setting() if setting is None else setting
    isas = cpp_extension.host_isas()
    if setting in cpp_extension.ISAS and setting not in isas:
        raise ValueError(f"MINILLM_CPU_KERNEL={setting}: this CPU cannot run {setting} builds "
                         f"(it runs {', '.join(isas) or 'generic builds only'}); use one of "
                         f"those, or 1 to measure and choose")
    group_list = groups(isas)
    key = cpu_key()
    if setting != "auto":
        return Selection(setting, _fixed(setting, group_list), {}, key, source="not measured")
    path = cache_path(key)
    wanted = {g.key(b) for g in group_list for b in g.buckets}
    if not refresh and (cached := _read_cache(path, key, wanted, setting)) is not None:
        return cached  # an unreadable or mismatched file is measured again and overwritten
    with _measuring(path):
        if not refresh and (cached := _read_cache(path, key, wanted, setting)) is not None:
            return cached  # another process measured while this one waited for the lock
        return _measure_and_cache(setting, group_list, key, path, timer)


def _read_cache(path: Path, key: dict, wanted: set, setting: str) -> Selection | None:
    """The selection cached in `path` if it was measured for `key` and covers `wanted`."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key or set(data.get("choices", {})) != wanted:
            return None
        return Selection(setting, data["choices"], data.get("timings_ms", {}), key,
                         data.get("measured_at"), data.get("measurement_s", 0.0),
                         f"cached in {path}")
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None  # missing or unreadable


@contextlib.contextmanager
def _measuring(path: Path):
    """Hold an exclusive lock on `<cache file>.lock` (POSIX; elsewhere no lock)."""
    try:
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks without spinning while another process measures
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _measure_and_cache(setting: str, group_list: list[Group], key: dict, path: Path,
                       timer) -> Selection:
    t0 = time.perf_counter()
    with torch.inference_mode():
        choices, timings, noise = measure(group_list, timer)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if noise > NOISY:
        warnings.warn(f"minillm: the CPU kernel measurement was too noisy to trust (rounds "
                      f"disagree by {noise:.0%}: is the machine busy?); the default builds "
                      f"run, and nothing is cached. Measure again on a quiet machine: "
                      f"python -m minillm info --refresh", RuntimeWarning, stacklevel=3)
        return Selection(setting, _fixed("default", group_list), timings, key, now,
                         round(time.perf_counter() - t0, 2),
                         f"too noisy ({noise:.0%}): the default builds, not cached")
    sel = Selection(setting, choices, timings, key, now, round(time.perf_counter() - t0, 2),
                    f"measured now, cached in {path}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({k: v for k, v in dataclasses.asdict(sel).items()
                                   if k not in ("setting", "source")}, indent=1),
                       encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"could not cache the CPU kernel selection in {path}: {err}",
                      stacklevel=2)
    return sel


_current: dict[str, Selection] = {}
# (choose, MINILLM_CPU_KERNEL's setting, its arguments) -> what choose returned: the kernel
# modules ask per product (a decode step makes 121), so each shape is decided once.
_chosen: dict = {}


def current() -> Selection:
    """The selection in force for MINILLM_CPU_KERNEL as it is now (measured or loaded at
    most once per process and setting)."""
    setting = cpp_extension.setting()
    sel = _current.get(setting)
    if sel is None:
        sel = _current[setting] = select(setting)
    return sel


def reset() -> None:
    """Forget the selections of this process (the next `current()` loads or measures), and
    with them every remembered per-shape choice (`memoized`)."""
    _current.clear()
    _chosen.clear()


def memoized(choose: Callable, *args):
    """`choose(*args)`, a kernel module's decision for one shape from the selection,
    remembered per MINILLM_CPU_KERNEL value until `reset`. Under torch.compile it is
    called afresh (its arguments may be symbolic; the module prepared its kernels first)."""
    if torch.compiler.is_compiling():
        return choose(*args)
    key = (choose, cpp_extension.setting()) + args  # a bad setting raises, as choose would
    result = _chosen.get(key, _chosen)
    if result is _chosen:
        result = _chosen[key] = choose(*args)
    return result


def choice(kernel: str, group: str, bucket: str) -> str | None:
    """`current().choice(...)`: the variant for this bucket (None where there is no such
    group on this host)."""
    return current().choice(kernel, group, bucket)
