"""The serving engine's host time per step: what is left when the model costs ~nothing.

On a GPU the engine's decode step is one CUDA-graph replay, and the rest of the step is
Python on the host: scheduling (block tables, prefix-cache offers), building the step's
inputs, sampling's read-back, appending tokens, the outputs. That host time adds to every
step, so at batch 64 it decides how close the engine gets to the GPU (BENCHMARKS.md, "Measured on a GPU": 2.95 ms
per step at batch 64 with ~1 ms of GPU work). On a CPU it is the gap between the engine
and its GEMM-only replay (`benchmarks/serving.py`). It is measured here in two ways:

    bookkeeping   `run_step` with the scheduler and block manager of an engine, and a
                  forward pass and sampler that do nothing: schedule, advance, append
    host step     `LLMEngine.step` on the CUDA-graph path (`enforce_eager=False`) with the
                  graph's body (the model's layers; one replay on a GPU) replaced by nothing:
                  everything else the engine does, the step's inputs, the LM head of a
                  1-layer, 64-wide model with a 512-token vocabulary, sampling, the outputs
    async step    the same with async scheduling (`async_scheduling=True`, the default on
                  CUDA): the host's work per step when it runs beside the GPU's (placeholder
                  tokens, the device gather of the input ids, the read-back). On a GPU the
                  step then takes about max(this, the GPU's time) instead of their sum

at batch 1, 8 and 64, every sequence decoding (prompts of 128 tokens, timed from the
`--position`-th generated token on: the per-token work that grows with a sequence's length
shows). Each is the median of --rounds rounds of --steps steps.

    python benchmarks/engine_overhead.py [--batches 1 8 64] [--steps 50] [--rounds 5]
                                         [--position 300] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.config import ModelConfig  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from minillm.engine import LLMEngine  # noqa: E402
from minillm.engine.step import run_step  # noqa: E402
from minillm.model import LlamaModel  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)
from serving import decoding_engine  # noqa: E402

PROMPT_LEN = 128


def tiny_engine(batch: int, position: int, steps: int, **engine_kw) -> LLMEngine:
    """An engine whose `batch` requests (serving.decoding_engine's prompts) have each
    generated `position` tokens, with `steps` more to go."""
    config = ModelConfig.tiny(num_layers=1, vocab_size=512, max_position_embeddings=4096)
    model = LlamaModel(config).init_random_weights(0).eval()
    engine = decoding_engine(model, batch, position + steps + 8, PROMPT_LEN, **engine_kw)
    while any(len(r.output_token_ids) < position for r in engine.scheduler.running):
        engine.step()
    return engine


def median_us(step, steps: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        samples.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(samples)


def bookkeeping_us(batch: int, position: int, steps: int, rounds: int) -> float:
    engine = tiny_engine(batch, position, steps * rounds)
    sched = engine.scheduler
    return median_us(lambda: run_step(sched, lambda out: None,
                                      lambda _, rows: [5] * len(rows), time.perf_counter),
                     steps, rounds)


def host_step_us(batch: int, position: int, steps: int, rounds: int,
                 async_scheduling: bool = False) -> float:
    engine = tiny_engine(batch, position, steps * rounds, enforce_eager=False,
                         async_scheduling=async_scheduling)
    graphs = engine.runner.graphs
    graphs._forward = lambda b: None  # the replay: the hidden states stay as they were
    return median_us(engine.step, steps, rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--position", type=int, default=300,
                    help="generated tokens per sequence before the timed steps")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    # One thread: the few tiny products here are not what is measured, and a second OpenMP
    # thread waiting for a busy core once stalled a 64-row step by milliseconds.
    torch.set_num_threads(1)
    rows = []
    print(f"{device_name('cpu')}, {torch.get_num_threads()} threads; µs per step "
          f"(per sequence), median of {args.rounds} x {args.steps} steps, every sequence at "
          f"{PROMPT_LEN} + {args.position} tokens")
    print(f"{'batch':>5} | {'bookkeeping':>16} | {'host step':>16} | {'async step':>16}")
    for b in args.batches:
        book = bookkeeping_us(b, args.position, args.steps, args.rounds)
        host = host_step_us(b, args.position, args.steps, args.rounds)
        overlap = host_step_us(b, args.position, args.steps, args.rounds, async_scheduling=True)
        rows.append({"batch": b, "bookkeeping_us": book, "host_step_us": host,
                     "async_step_us": overlap})
        print(f"{b:>5} | {book:8.0f} ({book / b:5.1f}) | {host:8.0f} ({host / b:5.1f}) | "
              f"{overlap:8.0f} ({overlap / b:5.1f})")
    if args.out:
        write_result(args.out, {"host": device_name("cpu"), "args": vars(args) | {
            "out": str(args.out)}, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
