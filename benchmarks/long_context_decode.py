"""Batch-1 decode at long contexts on this CPU: generate()'s attention through the C++
kernel against SDPA, side by side.

A decode step over a context of L positions reads the weights once and the K/V cache of
L positions in each of 30 layers. At L = 2048, SmolLM2's fp32 cache is 2048 x 2 x 3 x 64
x 4 B = 3.1 MB per layer, 94 MB a step, a sixth of its 540 MB of weights, and it grows
with L. The C++ kernel reads that cache in place; at batch 1 it splits the
sequence's positions over the threads (split-K) where it used to run the whole sequence on
one thread while SDPA used both.

For each context length (a prompt of that many tokens of the Lee corpus), the decode steps
after the prefill are timed with the attention forced through the kernel and forced
through SDPA, alternately, round by round; the best of --rounds is kept. The script prints
ms per step, the ratio, the greedy tokens' agreement, and what this CPU's measured
selection chooses for that length (`python -m minillm info`).

    python benchmarks/long_context_decode.py [--contexts 128 512 2048]
                                             [--dtype float32 bfloat16] [--steps 16]
                                             [--rounds 3]
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
from minillm.attention import cpu_decode  # noqa: E402
from minillm.data import lee_corpus  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

WAYS = ("kernel", "sdpa")


@contextlib.contextmanager
def attention(way: str):
    """generate()'s decode attention forced to `way` ("kernel" or "sdpa") for every context
    length (the measured choice restored on exit, even after an error)."""
    if way not in WAYS:
        raise ValueError(f"way must be one of {WAYS}, got {way!r}")
    real = cpu_decode.contiguous_preferred
    cpu_decode.contiguous_preferred = lambda length, dtype=torch.float32: way == "kernel"
    try:
        yield
    finally:
        cpu_decode.contiguous_preferred = real


def step_seconds(model, ids, steps: int) -> tuple[float, list[int]]:
    """Seconds per decode step after the prefill of `ids`, and the greedy tokens."""
    stream = minillm.generate_stream(model, ids, 1 + steps, ignore_eos=True)
    tokens = [next(stream)]  # the prefill and the first token
    t0 = time.perf_counter()
    tokens.extend(stream)
    return (time.perf_counter() - t0) / steps, tokens


def compare(model, ids, steps: int, rounds: int) -> dict:
    """{"kernel_ms", "sdpa_ms", "same_tokens"} for a prompt `ids`, the ways interleaved."""
    best = {way: float("inf") for way in WAYS}
    tokens = {}
    for _ in range(rounds):
        for way in WAYS:
            with attention(way):
                t, tokens[way] = step_seconds(model, ids, steps)
            best[way] = min(best[way], t)
    same = sum(a == b for a, b in zip(tokens["kernel"], tokens["sdpa"]))
    return {"kernel_ms": best["kernel"] * 1e3, "sdpa_ms": best["sdpa"] * 1e3,
            "same_tokens": same, "tokens": 1 + steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "long_context_decode.json"))
    args = ap.parse_args()
    for name in args.dtype:
        if getattr(torch, name, None) not in cpu_decode.DTYPES:
            sys.exit(f"--dtype {name}: the kernel reads float32 or bfloat16 caches")
    if cpu_decode.load_kernel() is None:
        sys.exit("the C++ decode kernel is not available here (see the warning above)")
    text = " ".join(lee_corpus())
    rows = {}
    for name in args.dtype:
        model, tok = minillm.load_model(dtype=getattr(torch, name))
        corpus_ids = tok.encode(text)
        limit = model.config.max_position_embeddings - 1 - args.steps
        for n in args.contexts:
            if not 1 <= n <= min(limit, len(corpus_ids)):
                sys.exit(f"--contexts {n}: must be 1 to {min(limit, len(corpus_ids))}")
            row = compare(model, corpus_ids[:n], args.steps, args.rounds)
            row["selected"] = ("kernel" if cpu_decode.contiguous_preferred(n, model.dtype)
                               else "sdpa")
            rows[f"{name} {n}"] = row
        del model
    print(f"{device_name('cpu')}, {torch.get_num_threads()} threads: batch-1 eager decode, "
          f"{args.steps} steps after the prompt, best of {args.rounds} rounds\n")
    print(f"{'dtype, context':18s}{'kernel ms':>11s}{'sdpa ms':>9s}{'sdpa/kernel':>13s}"
          f"{'same tokens':>13s}{'selected':>10s}")
    for key, r in rows.items():
        print(f"{key:18s}{r['kernel_ms']:11.2f}{r['sdpa_ms']:9.2f}"
              f"{r['sdpa_ms'] / r['kernel_ms']:12.2f}x{r['same_tokens']:>8d}/{r['tokens']:<4d}"
              f"{r['selected']:>10s}")
    out = {"benchmark": "long_context_decode", "date": time.strftime("%Y-%m-%d %H:%M"),
           "cpu": device_name("cpu"), "threads": torch.get_num_threads(), "steps": args.steps,
           "rounds": args.rounds, "results": rows}
    write_result(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
