"""The CPU paged-decode attention kernel on an engine-like batch: time, GB/s, and A/B.

One engine decode step attends, in each of 30 layers, for every running sequence, over
all of its cached K/V. This script builds such a step: --seqs sequences whose context
lengths are spread uniformly over --min-len..--max-len and SORTED (as the engine's runner
orders its decodes), blocks scattered through a 30-layer paged cache (SmolLM2-135M's 3 KV
heads x 64), so nothing stays in cache between layers. It times the kernel over the 30
layers and prints ms per layer and the K/V bytes it read per second, beside this machine's
STREAM bandwidth (`perf.measure_bandwidth`), the ceiling for a kernel that reads each K/V
row once.

--compare-source FILE builds another version of the kernel's C++ (e.g. an older commit's,
`git show REV:minillm/attention/csrc/paged_decode_cpu.cpp > old.cpp`) and alternates the
two, round by round, after checking that both give the same output.

    python benchmarks/paged_decode_cpu.py [--seqs 50] [--min-len 40] [--max-len 400]
                                          [--compare-source old.cpp] [--rounds 8]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import cpp_extension  # noqa: E402
from minillm.attention import cpu_decode  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from minillm.paged import PagedKVCache  # noqa: E402
from minillm.perf import measure_bandwidth  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

RESULTS = Path(__file__).with_name("results") / "paged_decode_cpu.json"
LAYERS, HKV, HQ, D, BLOCK = 30, 3, 9, 64, 16


def build_step(seqs: int, min_len: int, max_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (seqs,), generator=g).sort().values.int()
    max_blocks = -(-max_len // BLOCK)
    num_blocks = seqs * max_blocks + 1
    cache = PagedKVCache(LAYERS, num_blocks, BLOCK, HKV, D)
    for kc, vc in zip(cache.k_caches, cache.v_caches):
        kc.normal_(generator=g)
        vc.normal_(generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:seqs * max_blocks].view(seqs, max_blocks)
    q = torch.randn(seqs, HQ, D, generator=g)
    return q, cache, tables.int(), lens


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=50)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-source", type=Path, default=None)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"this tree": cpu_decode.load_kernel()}
    if kernels["this tree"] is None:
        sys.exit("the CPU paged-decode kernel is not available here (see the warning above)")
    if args.compare_source is not None:
        kernels[str(args.compare_source)] = cpp_extension.load(
            "minillm_paged_decode_compare", args.compare_source, "nothing to compare")
        if kernels[str(args.compare_source)] is None:
            sys.exit(f"--compare-source {args.compare_source} did not build (see above)")
    q, cache, tables, lens = build_step(args.seqs, args.min_len, args.max_len)
    scale = D ** -0.5
    outs = [k.paged_decode_cpu(q, cache.k_caches[0], cache.v_caches[0], tables, lens, scale)
            for k in kernels.values()]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)
    best = {name: float("inf") for name in kernels}
    for _ in range(args.rounds):
        for name, k in kernels.items():
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                k.paged_decode_cpu(q, cache.k_caches[layer], cache.v_caches[layer], tables,
                                   lens, scale)
            best[name] = min(best[name], (time.perf_counter() - t0) / LAYERS)
    kv_bytes = int(lens.sum()) * 2 * HKV * D * 4  # K and V rows, fp32, read once each
    stream = max(measure_bandwidth().values())  # best of copy, triad and sum
    print(f"{device_name('cpu')}, {args.threads} threads: {args.seqs} sequences, contexts "
          f"{args.min_len}..{args.max_len} (sorted), {kv_bytes / 1e6:.1f} MB of K/V per layer; "
          f"STREAM {stream / 1e9:.1f} GB/s")
    for name, t in best.items():
        print(f"  {name:30s} {t * 1e3:7.3f} ms per layer  {kv_bytes / t / 1e9:5.1f} GB/s "
              f"({kv_bytes / t / stream:.0%} of STREAM)")
    if len(best) == 2:
        a, b = best.values()
        print(f"  this tree is {b / a:.2f}x the compared source")
    result = {"benchmark": "paged_decode_cpu", "date": time.strftime("%Y-%m-%d %H:%M"),
              "cpu": device_name("cpu"), "threads": args.threads, "seqs": args.seqs,
              "context_range": [args.min_len, args.max_len], "kv_bytes_per_layer": kv_bytes,
              "stream_bytes_per_s": stream, "ms_per_layer": {k: v * 1e3 for k, v in best.items()}}
    write_result(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
