"""Compile every candidate tile configuration of minillm's Triton kernels, without a GPU.

    python benchmarks/triton_compile_sweep.py [--arch 90] [--only NAME] [--most N]

The interpreter accepts programs the compiler rejects, and an autotuning pass
(``gpu_check.py --autotune``) only meets the candidates on a GPU. This compiles each
kernel's candidates (``Tunable.configs`` in ``minillm.kernels.tuning``) ahead of time for one
target with Triton's bundled ptxas (sm_90 is H100, sm_80 A100), in 16-bit, for each distinct
set of constexprs among the kernel's buckets at head dim 64 and 128 (one representative
bucket per set). It reports, per kernel, how many compiled, how many need more shared
memory than the target has (an autotuning pass skips those), and any other error (a real
bug), with the seconds compilation took. ``benchmarks/pin_configs.py --check`` compiles the
pinned configs of every bucket instead. Exit code 1 if any configuration failed to compile.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from pin_configs import SHARED_BYTES, shared_bytes, tuning


def representative_buckets(t: tuning.Tunable) -> list[dict]:
    """16-bit buckets at head dim 64 / 128 (where the kernel has one), one per distinct set
    of constexprs."""
    seen, out = set(), []
    for bucket in t.buckets():
        if bucket.get("dt", 16) != 16 or bucket.get("D", 64) not in (64, 128):
            continue
        if bucket.get("H", 16) != 16:  # paged decode: SmolLM2's group fits the 16-row tile
            continue
        key = tuple(sorted(t.constexprs(bucket).items()))
        if key not in seen:
            seen.add(key)
            out.append(bucket)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_BYTES))
    ap.add_argument("--only", default="", help="only the kernels whose name contains this")
    ap.add_argument("--most", type=int, help="at most this many configurations per bucket")
    args = ap.parse_args()
    failed = 0
    for name, t in tuning.tunables().items():
        if args.only not in name:
            continue
        for bucket in representative_buckets(t):
            configs = t.configs[:args.most]
            t0, outcome = time.perf_counter(), Counter()
            for cfg in configs:
                try:
                    fits = shared_bytes(t, bucket, cfg, args.arch) <= SHARED_BYTES[args.arch]
                    outcome["ok" if fits else "too much shared memory"] += 1
                except Exception as e:  # noqa: BLE001  (reported; the sweep goes on)
                    outcome["FAILED"] += 1
                    print(f"  {name} {tuning.bucket_key(bucket)} {cfg}: "
                          f"{type(e).__name__}: {str(e)[:300]}")
            failed += outcome["FAILED"]
            secs = time.perf_counter() - t0
            print(f"sm_{args.arch} {name} {tuning.bucket_key(bucket)}: {dict(outcome)} of "
                  f"{len(configs)} configurations, {secs:.0f} s "
                  f"({secs / len(configs):.1f} s each)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
