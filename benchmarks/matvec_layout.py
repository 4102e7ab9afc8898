"""Batch-1 matrix-vector speed of SmolLM2's weight shapes in both memory layouts.

A decode step multiplies one activation row by every weight matrix, so its speed is how fast
each matrix streams from memory. `LlamaModel.use_matvec_layout` stores each matrix with its
longer side contiguous; this script measures, side by side in one run, `F.linear(x, W)` with
W stored [out, in] (PyTorch's default) and with W stored [in, out] (a transposed view), for
one layer's four matrices (x30, as in the model) and the tied LM head.

    python benchmarks/matvec_layout.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import ModelConfig  # noqa: E402


def timed(fn) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    c = ModelConfig.smollm2_135m()
    shapes = {"qkv_proj": (c.q_size + 2 * c.kv_size, c.hidden_size, c.num_layers),
              "o_proj": (c.hidden_size, c.q_size, c.num_layers),
              "gate_up_proj": (2 * c.intermediate_size, c.hidden_size, c.num_layers),
              "down_proj": (c.hidden_size, c.intermediate_size, c.num_layers),
              "lm_head": (c.vocab_size, c.hidden_size, 1)}
    print(f"{'matrix [out, in]':28s}{'[out,in] ms':>12s}{'[in,out] ms':>12s}{'ratio':>8s}  chosen")
    total = {"out_in": 0.0, "in_out": 0.0, "chosen": 0.0}
    for name, (out_f, in_f, count) in shapes.items():
        # `count` distinct matrices, as in the model, so nothing stays in cache between calls.
        row_major = [torch.randn(out_f, in_f) for _ in range(count)]
        col_major = [torch.randn(in_f, out_f).t() for _ in range(count)]
        x = torch.randn(1, in_f)
        t = {"out_in": [], "in_out": []}
        for _ in range(args.rounds):  # interleaved, so drift hits both alike
            t["out_in"].append(timed(lambda: [F.linear(x, w) for w in row_major]))
            t["in_out"].append(timed(lambda: [F.linear(x, w) for w in col_major]))
        a, b = statistics.median(t["out_in"]), statistics.median(t["in_out"])
        chosen = "[in,out]" if out_f >= in_f else "[out,in]"
        total["out_in"] += a
        total["in_out"] += b
        total["chosen"] += b if out_f >= in_f else a
        print(f"{name + f' [{out_f}, {in_f}] x{count}':28s}{a * 1e3:12.2f}{b * 1e3:12.2f}"
              f"{a / b:8.2f}  {chosen}")
    print(f"all matrices of one decode step: [out,in] {total['out_in'] * 1e3:.1f} ms, "
          f"[in,out] {total['in_out'] * 1e3:.1f} ms, longer side contiguous (what "
          f"load_model uses on CPU) {total['chosen'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
