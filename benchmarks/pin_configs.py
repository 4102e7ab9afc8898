"""Write and check the pinned Triton configs (``minillm/kernels/configs/sm_XY.json``).

    python benchmarks/pin_configs.py --check              # every bucket pinned, each compiles
    python benchmarks/pin_configs.py --merge tuned.json   # a GPU run's measurements, then --fill
    python benchmarks/pin_configs.py --fill               # pin every bucket nothing measured
    python benchmarks/pin_configs.py --fill --kernel decode_gemv   # ... of one kernel

No GPU is needed: configs are compiled ahead of time for each architecture with Triton's
bundled ptxas (as ``triton_compile_sweep.py`` does), and a config fits when the shared
memory it needs is within the architecture's per-block limit.

Sources, written into each entry (``minillm.kernels.tuning`` explains the files):

* ``measured: <GPU>, <date>, triton <v>`` - chosen by timing every candidate on that GPU
  (``gpu_check.py --autotune`` writes these; ``--merge`` takes its ``tuned`` file).
* ``nearest measured: <bucket>`` - a bucket nothing measured takes the config of the
  nearest measured bucket of the same kernel (same dtype width and head dim first, then
  the fewest class steps apart: ``Tunable.distance``; on sm_80 the sm_90 measurements
  count too) that fits this architecture.
* ``analytic (nothing measured near)`` - nothing measured fits: the kernel's own choice
  for the bucket (``Tunable.analytic``), where it has one.
* ``default`` - nothing measured fits and no analytic choice: the kernel's default config.

``--fill`` replaces every entry that is not measured, so carried-over configs follow new
measurements. ``--check`` exits 1 if a bucket has no entry, an entry is not one of the
kernel's candidates (or its default), or a config fails to compile or does not fit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

os.environ["TRITON_INTERPRET"] = "0"
torch.cuda.is_available = lambda: True  # define the kernels as compiled, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile  # noqa: E402

from minillm.kernels import tuning  # noqa: E402

SHARED_BYTES = {90: 232448, 89: 101376, 86: 101376, 80: 166912, 75: 65536}  # per block, max
DTYPES = {16: "bf16", 32: "fp32"}
_compiled: dict = {}


def compile_time_kwargs(t: tuning.Tunable, cfg) -> dict:
    """The config's kwargs that are compile-time constants of the kernel (W4A16's SPLIT_K
    is a run-time argument: every split count runs the same compiled program)."""
    constexpr = {p.name for p in t.fn.params if p.is_constexpr}
    return {k: v for k, v in cfg.kwargs.items() if k in constexpr}


def shared_bytes(t: tuning.Tunable, bucket: dict, cfg, arch: int, extra: dict | None = None,
                 dtype: str | None = None) -> int:
    """Shared memory of ``cfg`` for ``bucket`` compiled for ``arch`` (raises if it fails);
    ``extra``: constexprs beyond the bucket's (a variant the bucket does not name); ``dtype``:
    the tensors' Triton type ("bf16", "fp16", "fp32"; None: bf16 or fp32 by the bucket's
    ``dt``, which cannot tell fp16 from bf16)."""
    consts = {**t.constexprs(bucket), **(extra or {}), **compile_time_kwargs(t, cfg),
              **dict.fromkeys(t.unit_strides, 1)}  # as a launch specializes them
    dt = dtype or DTYPES[bucket.get("dt", 16)]
    key = (t.name, arch, tuple(sorted(consts.items())), dt, cfg.num_warps, cfg.num_stages)
    if key not in _compiled:
        types = {n: v.format(dt=dt) for n, v in t.signature_for(bucket).items()}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in t.fn.arg_names}
        kernel = triton_compile(ASTSource(t.fn, sig, consts, launch_attrs(t.fn, sig)),
                                target=GPUTarget("cuda", arch, 32),
                                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        _compiled[key] = kernel.metadata.shared
    return _compiled[key]


def launch_attrs(fn, sig: dict) -> dict:
    """What a launch tells the compiler about its arguments, as Triton specializes them:
    every pointer 16-byte aligned and every integer a multiple of 16 (SmolLM2's sizes and
    strides are, and a launch with any other is no bigger). Without it the compiler cannot
    pipeline the loads (cp.async, TMA) and the shared memory it reports is a fraction of a
    launch's: a D = 256 varlen FlashAttention tile checked at 65,536 bytes needed 294,912
    launched, over an H100's 232,448."""
    keep = {fn.arg_names[i] if isinstance(i, int) else i
            for i in getattr(fn, "do_not_specialize", ())}
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
            if sig[n] not in ("constexpr", "fp32", "fp64") and n not in keep}


def _compile_job(job):
    name, bucket, cfg_dict, arch = job
    t = tuning.tunables()[name]
    try:
        return job, shared_bytes(t, bucket, tuning.config_from_dict(cfg_dict), arch), None
    except Exception as e:  # noqa: BLE001  (reported by the caller)
        return job, None, f"{type(e).__name__}: {str(e)[:200]}"


def precompile(jobs: list[tuple]) -> dict:
    """Compile (kernel name, bucket, config dict, arch) jobs on every core; returns
    {job index: (shared bytes or None, error or None)} and fills the cache."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    results = {}
    with ProcessPoolExecutor(max(1, os.cpu_count() or 1),
                             mp_context=multiprocessing.get_context("fork")) as pool:
        for i, (job, shared, error) in enumerate(pool.map(_compile_job, jobs)):
            results[i] = (shared, error)
            if shared is not None:
                name, bucket, cfg_dict, arch = job
                t, cfg = tuning.tunables()[name], tuning.config_from_dict(cfg_dict)
                consts = {**t.constexprs(bucket), **compile_time_kwargs(t, cfg)}
                _compiled[(name, arch, tuple(sorted(consts.items())),
                           DTYPES[bucket.get("dt", 16)], cfg.num_warps, cfg.num_stages)] = shared
    return results


def fits(t, bucket, cfg, arch) -> bool:
    try:
        return shared_bytes(t, bucket, cfg, arch) <= SHARED_BYTES[arch]
    except Exception:  # noqa: BLE001  (a config that does not compile does not fit)
        return False


def load(arch: int) -> dict:
    path = tuning.config_path(arch)
    return (json.loads(path.read_text()) if path.exists()
            else {"arch": f"sm_{arch}", "kernels": {}})


def measured_entries(tables: dict, name: str, arch: int) -> list[tuple[dict, dict]]:
    """(bucket, entry) of every measured entry that may serve ``arch``: its own, and for an
    older architecture the newer ones' too (checked to fit before use)."""
    out = []
    for a in sorted(tables, key=lambda a: (a != arch, -a)):
        if a == arch or a > arch:
            for key, entry in tables[a]["kernels"].get(name, {}).items():
                if entry.get("source", "").startswith("measured"):
                    out.append((tuning.parse_bucket_key(key), entry))
    return out


def options(t: tuning.Tunable, bucket: dict, measured: list[tuple[dict, dict]]) -> list:
    """(config, source) to try for a bucket nothing measured, best first: the kernel's own
    choice for the bucket where it has a rule (`Tunable.analytic`: split-K and tiles follow
    the shape, which another shape's measurement does not), the nearest measured buckets'
    configs, the kernel's default, then every candidate, small first."""
    out = ([(t.analytic(bucket), "analytic (a rule of the kernel's, not measured)")]
           if t.analytic is not None else [])
    out += [(tuning.config_from_dict(entry), f"nearest measured: {tuning.bucket_key(other)}")
            for other, entry in sorted(measured, key=lambda c: t.distance(bucket, c[0]))]
    out.append((t.default, "default"))
    out += [(c, "least shared memory (the default does not fit)")
            for c in sorted(t.configs, key=tuning.tile_size)]
    return out


def fill(tables: dict, arch: int, names: list[str] | None = None) -> int:
    """Pin every bucket of ``arch`` that has no measured entry (the first option that fits,
    see `options`); returns how many. Compiles in rounds, every core at once: round r
    compiles the r-th option of every bucket still without a fitting one. ``names``: only
    these kernels (None: all)."""
    kernels = tables[arch]["kernels"]
    todo = []  # [name, key, bucket, remaining options]
    for name, t in _kernels(names):
        entries = kernels.setdefault(name, {})
        measured = measured_entries(tables, name, arch)
        for bucket in t.buckets():
            key = tuning.bucket_key(bucket)
            if not entries.get(key, {}).get("source", "").startswith("measured"):
                todo.append([name, key, bucket, options(t, bucket, measured)])
    count = len(todo)
    while todo:
        precompile([(name, bucket, tuning.config_to_dict(opts[0][0]), arch)
                    for name, _, bucket, opts in todo])
        left = []
        for item in todo:
            name, key, bucket, opts = item
            t, (cfg, source) = tuning.tunables()[name], opts.pop(0)
            if fits(t, bucket, cfg, arch):
                kernels[name][key] = {**tuning.config_to_dict(cfg), "source": source}
            elif opts:
                left.append(item)
            else:
                kernels[name][key] = {"unsupported": (
                    f"no candidate fits the {SHARED_BYTES[arch]} bytes of shared memory of "
                    f"sm_{arch}")}
        todo = left
    return count


def _kernels(names: list[str] | None) -> list[tuple[str, tuning.Tunable]]:
    """The registered kernels, or those named (a name that is none of them stops the run)."""
    every = tuning.tunables()
    unknown = sorted(set(names or ()) - set(every))
    if unknown:
        raise SystemExit(f"no kernel named {', '.join(unknown)}: the kernels are "
                         f"{', '.join(sorted(every))}")
    return [(n, t) for n, t in sorted(every.items()) if names is None or n in names]


def check(tables: dict, arch: int, names: list[str] | None = None) -> list[str]:
    """Every problem with the pinned file of ``arch`` (empty: it is complete and compiles);
    ``names``: only these kernels (None: all)."""
    problems, jobs, where = [], [], []
    kernels = tables[arch]["kernels"]
    for name, t in _kernels(names):
        allowed = {json.dumps(tuning.config_to_dict(c), sort_keys=True)
                   for c in (*t.configs, t.default)}
        for bucket in t.buckets():
            key = tuning.bucket_key(bucket)
            entry = kernels.get(name, {}).get(key)
            if entry is None:
                problems.append(f"sm_{arch} {name} {key}: no pinned config")
            elif "unsupported" in entry:
                continue  # the kernel refuses this bucket on this architecture, saying why
            elif json.dumps(tuning.config_to_dict(tuning.config_from_dict(entry)),
                            sort_keys=True) not in allowed:
                problems.append(f"sm_{arch} {name} {key}: {entry} is not a candidate config")
            else:
                jobs.append((name, bucket, tuning.config_to_dict(tuning.config_from_dict(entry)),
                             arch))
                where.append(f"sm_{arch} {name} {key}")
    for i, (used, error) in precompile(jobs).items():
        if error:
            problems.append(f"{where[i]}: does not compile ({error})")
        elif used > SHARED_BYTES[arch]:
            problems.append(f"{where[i]}: needs {used} bytes of shared memory, "
                            f"sm_{arch} has {SHARED_BYTES[arch]}")
    return problems


def merge(tables: dict, tuned: list[dict], source: str) -> None:
    for row in tuned:
        arch = int(row["arch"])
        tables.setdefault(arch, {"arch": f"sm_{arch}", "kernels": {}})
        cfg = {k: v for k, v in row.items() if k not in ("kernel", "arch", "bucket")}
        tables[arch]["kernels"].setdefault(row["kernel"], {})[row["bucket"]] = {
            **cfg, "source": f"measured: {source}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--fill", action="store_true")
    ap.add_argument("--merge", type=Path, help="a `tuned` JSON written by gpu_check --autotune")
    ap.add_argument("--arch", type=int, action="append", help="default: every pinned arch")
    ap.add_argument("--kernel", action="append",
                    help="fill or check only this kernel (repeatable; default: every kernel)")
    args = ap.parse_args(argv)
    archs = args.arch or list(tuning.PINNED_ARCHS)
    tables = {a: load(a) for a in tuning.PINNED_ARCHS}
    if args.merge:
        data = json.loads(args.merge.read_text())
        merge(tables, data["measured"], data["source"])
        args.fill = True
    if args.fill:
        for arch in archs:
            n = fill(tables, arch, args.kernel)
            tuning.write_table(tuning.config_path(arch), tables[arch])
            print(f"sm_{arch}: pinned {n} bucket(s) nothing measured")
        tuning.pinned_table.cache_clear()
    if args.check or not (args.fill or args.merge):
        problems = [p for arch in archs for p in check(tables, arch, args.kernel)]
        for p in problems:
            print(p)
        total = sum(len(t.buckets()) for _, t in _kernels(args.kernel))
        print(f"checked {total} buckets x {len(archs)} architecture(s), {len(_compiled)} "
              f"distinct compilations: {len(problems)} problem(s)")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
