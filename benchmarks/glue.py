"""A layer's glue at 1 to 512 rows: eager PyTorch ops, the fused C++, and torch.compile.

Between its four weight products each Llama layer runs elementwise glue: the input RMSNorm,
RoPE on q and k, SiLU(gate)·up, the residual adds and the post-attention RMSNorm. This
script times, side by side and interleaved, one layer's glue for SmolLM2-135M's shapes at
row counts from a decode step (1) to the serving engine's prefill chunks (512), three ways:

    eager      the plain PyTorch expressions (`minillm.layers.fused.*_ref`, `apply_rope`)
    fused C++  `minillm.layers.fused` (one pass per group, `csrc/fused_glue_cpu.cpp`)
    compiled   the same plain expressions under torch.compile, dynamic=False: one graph per
               row count, i.e. what shape buckets would reuse (Inductor fuses the glue into
               a few generated loops). The first call per row count compiles and is not timed.

Why it matters: the engine pads nothing (a step costs the tokens it computes), so with
buckets each step would run at the next bucket size, and each bucket is one more compile.
The fused C++ needs neither. Prints µs per layer and the speedups; --out writes JSON.

    python benchmarks/glue.py [--rows 1 8 64 256 512] [--rounds 200]
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import ModelConfig  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from minillm.layers import fused  # noqa: E402
from minillm.model import apply_rope, rope_cos_sin  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

RESULTS = Path(__file__).with_name("results") / "glue.json"


def eager_glue(x, attn_out, mlp_out, heads, gate_up, cos, sin, w1, w2, n_rot, eps):
    """One layer's glue as the unfused model runs it (same order, same ops)."""
    h = fused.rms_norm_ref(x, w1, eps)
    qk = apply_rope(heads[:, :, :n_rot], cos, sin)
    s = x + attn_out
    h2 = fused.rms_norm_ref(s, w2, eps)
    act = fused.silu_mul_ref(gate_up)
    return h, qk, h2, act, s + mlp_out


def fused_glue(x, attn_out, mlp_out, heads, gate_up, cos, sin, w1, w2, n_rot, eps):
    h = fused.rms_norm(x, w1, eps)
    qk = fused.rope_(heads, n_rot, cos, sin)
    s, h2 = fused.add_rms_norm(x, attn_out, w2, eps)
    act = fused.silu_mul(gate_up)
    return h, qk, h2, act, s + mlp_out


def inputs(c: ModelConfig, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cos, sin = rope_cos_sin(c.head_dim, c.max_position_embeddings, c.rope_theta)
    pos = torch.randint(0, c.max_position_embeddings, (1, rows), generator=g)
    d = c.hidden_size
    return (torch.randn(1, rows, d, generator=g), torch.randn(1, rows, d, generator=g),
            torch.randn(1, rows, d, generator=g),
            torch.randn(1, rows, c.num_heads + 2 * c.num_kv_heads, c.head_dim, generator=g),
            torch.randn(1, rows, 2 * c.intermediate_size, generator=g), cos[pos], sin[pos],
            torch.randn(d, generator=g), torch.randn(d, generator=g),
            c.num_heads + c.num_kv_heads, c.rms_norm_eps)


def per_call_us(fn, args, rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn(*args)
    return (time.perf_counter() - t0) / rounds * 1e6


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats; best counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if fused.load_kernel() is None:
        sys.exit("the fused glue kernel is not available here (see the warning above)")
    c = ModelConfig.smollm2_135m()
    compiled = torch.compile(eager_glue, dynamic=False)
    ways = {"eager": eager_glue, "fused C++": fused_glue, "compiled": compiled}
    results, compile_s = {}, {}
    for rows in args.rows:
        a = inputs(c, rows)
        t0 = time.perf_counter()
        compiled(*a)  # compile this row count's graph (one "bucket")
        compile_s[rows] = time.perf_counter() - t0
        for fn in ways.values():
            fn(*a)
        best = {name: float("inf") for name in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                best[name] = min(best[name], per_call_us(fn, a, args.rounds))
        results[rows] = best
    print(f"{device_name('cpu')}, {args.threads} threads, torch {torch.__version__}: one "
          f"layer's glue (SmolLM2-135M shapes), µs per layer, best of {args.repeats}\n")
    print(f"{'rows':>5s}{'eager':>10s}{'fused C++':>11s}{'compiled':>10s}"
          f"{'C++ vs eager':>14s}{'C++ vs compiled':>17s}{'compile s':>11s}")
    for rows, r in results.items():
        print(f"{rows:5d}{r['eager']:10.1f}{r['fused C++']:11.1f}{r['compiled']:10.1f}"
              f"{r['eager'] / r['fused C++']:13.2f}x{r['compiled'] / r['fused C++']:16.2f}x"
              f"{compile_s[rows]:11.1f}")
    out = {"benchmark": "glue", "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": {"cpu": device_name("cpu"), "platform": platform.platform(),
                       "threads": args.threads, "torch": torch.__version__},
           "rounds": args.rounds, "repeats": args.repeats,
           "us_per_layer": {str(k): v for k, v in results.items()},
           "compile_s_per_row_count": {str(k): v for k, v in compile_s.items()}}
    write_result(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
