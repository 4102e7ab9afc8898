"""Paged KV waste, replayed without a model: the serving workload through the engine's own
scheduler and block manager, at several prefill chunk budgets.

Every request of benchmarks/workload.json arrives at t = 0 (SmolLM2's real pool size is not
needed: the pool is 2,048 blocks of 16, room for all 64 requests at full length, so nothing
is preempted). After each step the replay records the blocks held and the tokens whose KV
is computed; waste = 1 - computed tokens / (blocks held x block_size), averaged over steps
(the same figure `benchmarks/serving.py` samples during its real run). Deterministic: the
scheduler has no randomness and no clock, so any machine prints the same numbers.

Why budgets: a prompt longer than the budget is computed over several steps, and blocks
reserved for a whole prompt at admission sit empty until its last chunk is computed. With
blocks reserved per chunk, only the last block of each sequence is ever partly empty.

    python benchmarks/kv_waste.py [--budgets 512 128 64 32]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.engine.request import Request, SamplingParams  # noqa: E402
from minillm.engine.scheduler import Scheduler  # noqa: E402
from minillm.paged import BlockManager  # noqa: E402

WORKLOAD = Path(__file__).parent / "workload.json"
BLOCK_SIZE, NUM_BLOCKS = 16, 2048


def replay(requests: list[dict], budget: int, max_num_seqs: int = 64) -> dict:
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs, budget)
    for i, r in enumerate(requests):
        sched.add(Request(str(i), r["prompt_ids"], SamplingParams(max_tokens=r["max_tokens"],
                                                                  ignore_eos=True)))
    held = computed = steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.advance(out)
        sched.append_tokens([(s.request, 5) for s in out.seqs if s.samples], now=0.0)
        held += (NUM_BLOCKS - bm.num_free_blocks()) * BLOCK_SIZE
        computed += sum(r.num_computed_tokens for r in sched.running)
        steps += 1
    return {"budget": budget, "steps": steps, "paged_waste": 1 - computed / held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 128, 64, 32])
    args = ap.parse_args()
    requests = json.loads(WORKLOAD.read_text())["requests"]
    print(f"{'chunk budget (tokens/step)':>28s}{'steps':>8s}{'paged waste':>14s}")
    for b in args.budgets:
        r = replay(requests, b)
        print(f"{r['budget']:>28d}{r['steps']:>8d}{r['paged_waste']:>14.1%}")


if __name__ == "__main__":
    main()
