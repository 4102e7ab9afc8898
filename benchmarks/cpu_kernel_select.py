"""The CPU kernel selection, checked: each chosen build against BLAS (or gather) on the
shapes it was chosen for, and every build side by side.

`minillm.cpu_select` times, at first use, every build of each C++ CPU kernel against the
path it replaces and picks per bucket of shapes. This script (1) runs that first-use
measurement afresh (`select(refresh=True)`: what `make setup` runs, timed, and cached as
usual), then (2) measures every bucket again, independently, with more rounds, and prints
for each bucket the chosen variant, its time, the fallback's time and the ratio, every
build's weight stream in GB/s, and whether the re-measurement would choose the same. A
chosen kernel slower than its fallback in the re-measurement is flagged "SLOWER".

The GB/s columns answer, on any host, where a bf16 kernel loses: avx512bf16 (vdpbf16ps)
against avx512 (the same 16 lanes, bf16 widened) isolates the dot-product instruction;
avx512 against avx2 the vector width (a CPU that splits 512-bit instructions in two, Zen 4,
gains nothing from it); bf16 against fp32 of the same build the widening.

    python benchmarks/cpu_kernel_select.py [--rounds 9]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import cpp_extension, cpu_select  # noqa: E402
from minillm.devices import _cpuinfo_field, device_name  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

RESULTS = Path(__file__).with_name("results") / "cpu_kernel_select.json"


def weight_bytes(key: str) -> float | None:
    """Bytes of weights one pass of this bucket streams (small-M linear only), for GB/s."""
    kernel, group, bucket = key.split("/")
    if kernel != "small_m_linear":
        return None
    from minillm.layers import cpu_linear
    dtype, width = group.split()
    itemsize = 2 if dtype == "bfloat16" else 4
    shapes = cpu_linear._SHAPES[width]
    per = sum(n * k for n, k in shapes) * itemsize
    return per * max(1, cpu_linear.MEASURE_BYTES // per) * len(cpu_linear._BUCKET_ROWS[bucket])


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9, help="rounds of the re-measurement")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if cpp_extension.setting() != "auto":
        sys.exit(f"MINILLM_CPU_KERNEL={cpp_extension.setting()}: unset it (or set 1) to "
                 f"measure the selection")
    cpu = f"{device_name('cpu')} (family {_cpuinfo_field(('cpu family',))}, model " \
          f"{_cpuinfo_field(('model',))}), {torch.get_num_threads()} threads"
    print(f"{cpu}; builds this CPU runs: {', '.join(cpp_extension.host_isas()) or 'generic'}")
    groups = cpu_select.groups()
    for g in groups:  # build every variant first, so the timed selection is the measurement
        for v in g.variants:
            g.make(v, g.buckets[0])
    t0 = time.perf_counter()
    sel = cpu_select.select(refresh=True)
    first_use_s = time.perf_counter() - t0
    print(f"first-use measurement: {first_use_s:.1f} s ({sel.source})\n")
    for line in sel.lines():
        print(f"  {line}")

    print(f"\nre-measured, {args.rounds} rounds, medians (ms per pass of the bucket's shapes):")
    print(f"{'kernel / group / rows':40s}{'chosen':>11s}{'ms':>9s}{'fallback ms':>13s}"
          f"{'chosen vs fb':>14s}   every variant (ms; GB/s of weights)   same choice?")
    rows, slower, changed = [], [], []
    for g in groups:
        times = {}
        for bucket in g.buckets:
            rounds = cpu_select.time_variants(
                {v: functools.partial(g.make, v, bucket) for v in g.variants + (g.fallback,)},
                args.rounds)
            times[bucket] = {v: statistics.median(ts) for v, ts in rounds.items()}
        again = cpu_select.decide(g, times)
        for bucket in g.buckets:
            key, t = g.key(bucket), times[bucket]
            chosen = sel.choices[key]
            nbytes = weight_bytes(key)
            every = ", ".join(f"{v} {s * 1e3:.2f}" + (f" ({nbytes / s / 1e9:.1f})" if nbytes
                                                        else "") for v, s in t.items())
            ratio = t[g.fallback] / t[chosen] if chosen in t else float("nan")
            flag = "  SLOWER" if chosen != g.fallback and ratio < 1 else ""
            same = "yes" if again[bucket] == chosen else f"no ({again[bucket]})"
            print(f"{key:40s}{chosen:>11s}{t.get(chosen, float('nan')) * 1e3:9.2f}"
                  f"{t[g.fallback] * 1e3:13.2f}{ratio:13.2f}x   {every}   {same}{flag}")
            rows.append({"key": key, "chosen": chosen, "chosen_vs_fallback": ratio,
                         "ms": {v: s * 1e3 for v, s in t.items()},
                         "weight_GBps": ({v: nbytes / s / 1e9 for v, s in t.items()}
                                         if nbytes else None), "same_choice": again[bucket]})
            if flag:
                slower.append(key)
            if again[bucket] != chosen:
                changed.append(key)
    print(f"\nchosen kernels slower than their fallback in the re-measurement: "
          f"{', '.join(slower) or 'none'}")
    print(f"buckets the re-measurement would choose differently: {', '.join(changed) or 'none'}")
    out = write_result(args.out, {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu,
        "torch": torch.__version__, "host_isas": list(cpp_extension.host_isas()),
        "first_use_s": first_use_s, "selection": sel.choices,
        "selection_timings_ms": sel.timings_ms, "remeasured": rows,
        "slower_than_fallback": slower, "would_change": changed}, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
