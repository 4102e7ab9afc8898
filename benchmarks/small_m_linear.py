"""Few-row weight products on the CPU: the C++ small-M kernel against BLAS, side by side.

Decode multiplies 1 row by every weight; a speculative verify pass k + 1 rows; a small
serving batch a few more. This script times, in one run and interleaved, SmolLM2-135M's
121 weight products (30 layers x 4 plus the LM head, each a distinct matrix so nothing stays
in cache) for M rows through:

    blas [out,in]   F.linear with W as nn.Linear stores it
    blas [in,out]   F.linear with W stored transposed (what `use_matvec_layout` picks
                    for BLAS: faster for 1 row)
    kernel          minillm.layers.cpu_linear (W [out, in]), the build this CPU's selection
                    chose for the row count (`minillm.cpu_select`; its default build where
                    the selection chose BLAS); benchmarks/cpu_kernel_select.py compares
                    every build

and prints each one's time, the kernel's speedup over the faster BLAS layout, and the cost
of M rows relative to 1 row (the "verify cost" of speculative decoding, for the products).

--dtype bfloat16 runs the same in bf16 (x and W; the kernel's bf16 path, which uses the
bf16 dot-product instruction where the CPU has `avx512_bf16`) and writes
results/small_m_linear_bf16.json.

    python benchmarks/small_m_linear.py [--rows 1 2 3 5 8 16 24 32] [--rounds 7]
                                        [--dtype float32]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import ModelConfig  # noqa: E402
from minillm.layers import cpu_linear  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

RESULTS = Path(__file__).with_name("results") / "small_m_linear.json"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16, 24, 32])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    results = RESULTS if dtype == torch.float32 else RESULTS.with_name("small_m_linear_bf16.json")
    if cpu_linear.load_kernel() is None:
        sys.exit("the C++ small-M kernel is not available here (see the warning above)")
    c = ModelConfig.smollm2_135m()
    shapes = [(c.q_size + 2 * c.kv_size, c.hidden_size, c.num_layers),
              (c.hidden_size, c.q_size, c.num_layers),
              (2 * c.intermediate_size, c.hidden_size, c.num_layers),
              (c.hidden_size, c.intermediate_size, c.num_layers),
              (c.vocab_size, c.hidden_size, 1)]
    g = torch.Generator().manual_seed(0)
    out_in = [torch.randn(n, k, generator=g).to(dtype) for n, k, count in shapes
              for _ in range(count)]
    in_out = [w.t().contiguous().t() for w in out_in]
    ways = {"blas [out,in]": lambda x, w: F.linear(x, w),
            "blas [in,out]": lambda x, w: F.linear(x, w),
            "kernel": cpu_linear.small_m_linear}
    weights = {"blas [out,in]": out_in, "blas [in,out]": in_out, "kernel": out_in}
    print(f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
          f"{len(out_in)} products, {sum(w.numel() * w.element_size() for w in out_in) / 1e6:.0f}"
          f" MB of {args.dtype} weights per pass; median of", args.rounds, "rounds\n")
    print(f"{'rows':>4s}" + "".join(f"{k + ' ms':>18s}" for k in ways)
          + f"{'kernel vs BLAS':>16s}{'kernel M/1 row':>16s}{'BLAS M/1 row':>14s}")
    rows_out, base = [], {}
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {s[1] for s in shapes}}
        t = {k: [] for k in ways}
        for _ in range(args.rounds + 1):  # interleaved, so drift hits all alike; first is warm-up
            for name, fn in ways.items():
                t[name].append(timed(lambda: [fn(xs[w.shape[1]], w) for w in weights[name]]))
        ms = {k: statistics.median(v[1:]) * 1e3 for k, v in t.items()}
        blas = min(ms["blas [out,in]"], ms["blas [in,out]"])
        base = base or {"kernel": ms["kernel"], "blas": blas}
        rows_out.append({"rows": m, **{k: round(v, 2) for k, v in ms.items()}})
        print(f"{m:4d}" + "".join(f"{v:18.1f}" for v in ms.values())
              + f"{blas / ms['kernel']:15.2f}x{ms['kernel'] / base['kernel']:16.2f}"
              f"{blas / base['blas']:14.2f}")
    write_result(results, {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "threads": torch.get_num_threads(), "dtype": args.dtype,
                           "rows": rows_out}, indent=1)
    print(f"\nwrote {results.relative_to(Path.cwd()) if results.is_relative_to(Path.cwd()) else results}")


if __name__ == "__main__":
    main()
