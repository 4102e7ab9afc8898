"""How much of an eager batch-1 decode step is not the weight products, on this CPU.

The step is timed as it is, then again with every C++ weight product replaced by an empty
output of its shape: the same Python, dispatch, glue, attention and sampling, no weight
streamed. The second time is the step's *overhead*; the difference is what the 121 products
cost. The overhead is what stands between the eager step and the matvec ceiling
(`benchmarks/decode.py`): on a VM whose memory streams faster, the products shrink and the
overhead does not, so the fraction of the ceiling falls (BENCHMARKS.md, "CPU hosts").

Each time is (t(1 + N tokens) - t(1 token)) / N, the best of --rounds, the two ways
interleaved round by round. SmolLM2-135M, greedy, the prompt of `benchmarks/decode.py`.
Only products that run the C++ kernel are replaced: a shape this CPU's selection gives to
BLAS (`python -m minillm info`) stays in the overhead, and the script says so.

    python benchmarks/decode_overhead.py [--dtype float32 bfloat16] [--new-tokens 64]
                                         [--rounds 5]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by file from the tests too

import minillm  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from minillm.layers import cpu_linear  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

PROMPT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


@contextlib.contextmanager
def without_products():
    """Every build of the C++ small-M kernel returns an empty [..., N] instead of x @ W.T
    (restored on exit, even after an error)."""
    builds = [k for b in cpu_linear.BUILDS if (k := _build(b)) is not None]
    originals = [(k, k.small_m_linear) for k in builds]
    try:
        for k in builds:
            k.small_m_linear = lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0])
        yield
    finally:
        for k, fn in originals:
            k.small_m_linear = fn


def _build(isa: str):
    from minillm import cpp_extension
    return cpu_linear.load_kernel(isa) if isa in cpp_extension.host_isas() else None


def step_seconds(model, ids, new_tokens: int, rounds: int) -> dict[str, float]:
    """{"step", "overhead"}: seconds per decode step, as it is and without the products."""
    def timed(n):
        t0 = time.perf_counter()
        minillm.generate(model, ids, n, ignore_eos=True)
        return time.perf_counter() - t0

    ways = {"step": contextlib.nullcontext, "overhead": without_products}
    for make in ways.values():  # warm-up
        with make():
            timed(1 + new_tokens)
    best = {(w, n): float("inf") for w in ways for n in (1, 1 + new_tokens)}
    for _ in range(rounds):
        for way, make in ways.items():
            with make():
                for n in (1, 1 + new_tokens):
                    best[way, n] = min(best[way, n], timed(n))
    return {w: (best[w, 1 + new_tokens] - best[w, 1]) / new_tokens for w in ways}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_overhead.json"))
    args = ap.parse_args()
    rows = {}
    for name in args.dtype:
        dtype = getattr(torch, name, None)
        if dtype not in cpu_linear.KERNEL_DTYPES:
            sys.exit(f"--dtype {name}: the C++ products take float32 or bfloat16")
        model, tok = minillm.load_model(dtype=dtype)
        ids = tok.apply_chat_template(PROMPT)
        blas = [k for k in (576, 1536) if not cpu_linear.uses_kernel(dtype, k)]
        t = step_seconds(model, ids, args.new_tokens, args.rounds)
        rows[name] = {"step_ms": t["step"] * 1e3, "overhead_ms": t["overhead"] * 1e3,
                      "products_ms": (t["step"] - t["overhead"]) * 1e3,
                      "blas_widths": blas}
        del model
    print(f"{device_name('cpu')}, {torch.get_num_threads()} threads: batch-1 eager decode, "
          f"{args.new_tokens} tokens, best of {args.rounds} rounds\n")
    print(f"{'dtype':10s}{'step ms':>9s}{'products ms':>13s}{'overhead ms':>13s}{'overhead':>10s}")
    for name, r in rows.items():
        print(f"{name:10s}{r['step_ms']:9.2f}{r['products_ms']:13.2f}{r['overhead_ms']:13.2f}"
              f"{r['overhead_ms'] / r['step_ms']:10.0%}")
        if r["blas_widths"]:
            print(f"  ({name}: products of width {r['blas_widths']} run BLAS here and stay in "
                  f"the overhead)")
    out = {"benchmark": "decode_overhead", "date": time.strftime("%Y-%m-%d %H:%M"),
           "cpu": device_name("cpu"), "threads": torch.get_num_threads(),
           "new_tokens": args.new_tokens, "rounds": args.rounds, "results": rows}
    write_result(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
