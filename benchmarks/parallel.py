"""What tensor and pipeline parallelism cost on this CPU, beside what calc predicts on GPUs.

Tensor parallelism (SmolLM2, greedy, a chat prompt, --new-tokens decode steps), each TP size
in its own `minillm.dist.run_tp` launch (gloo over 127.0.0.1; each rank gets cores // TP
threads, at least 1):
  prefill_s / decode_step_s   wall time on rank 0 (median over the decode steps)
  comm_s                      rank 0's time inside collectives in a decode step (waiting for
                              the slower ranks included); compute_s = step − comm; medians
  allreduce_us                median time of one decode all-reduce (2.3 KB fp32)
The tokens of every TP size are checked against TP = 1 (same text). Then the all-reduce
alone (a decode step's 2.3 KB and a prefill's [41, 576] fp32) on 2 and on 3 ranks: 3 ranks
on 2 cores means one rank is always descheduled, and every all-reduce waits for it.

Pipeline parallelism (`run_pipeline`): a batch of --pp-batch prompts of --pp-tokens tokens,
one forward (the median of --pp-repeats), PP = 1 (the same machinery on one rank, 2 threads)
against PP = 2 (1 thread per rank) at several microbatch counts: makespan, measured bubble
against calc.pp_bubble_fraction.

GPU prediction (`calc.tp_step_time_s`, bf16, H100 HBM 3.35 TB/s and 989 TFLOP/s dense bf16,
links per direction: NVLink 450 GB/s, PCIe Gen5 32 GB/s; link latency not modelled): the
same decode step and prefill (logits of the last position only) at each TP size.

    python benchmarks/parallel.py [--tp 1 3] [--new-tokens 32] [--pp-microbatches 1 2 4 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minillm  # noqa: E402
from minillm import calc, dist  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

PROMPT = "Explain in a few sentences why the sky is blue."
H100 = {"hbm_bandwidth_bytes_per_s": 3.35e12, "peak_flops": 989e12}
LINKS = {"NVLink": calc.NVLINK_H100_BYTES_PER_S, "PCIe Gen5": calc.PCIE_GEN5_BYTES_PER_S}


def tp_rows(prompt_ids, sizes, new_tokens):
    rows, reference = [], None
    for tp in sizes:
        start = time.perf_counter()
        run = dist.run_tp(tp, prompt_ids, new_tokens)
        wall = time.perf_counter() - start
        reference = reference or run.tokens
        decode = run.step_times_s[1:]
        steps = len(decode)
        comm_per_step = [sum(r.time_s for r in run.ledger.select(step=i)) for i in
                         range(1, steps + 1)]  # ledger step 0 is the prefill
        comm = statistics.median(comm_per_step) if steps else 0.0
        compute = statistics.median(t - c for t, c in zip(decode, comm_per_step))
        reduces = [r.time_s for r in run.ledger.select("all_reduce", "decode")]
        rows.append({
            "tp": tp, "threads_per_rank": max(1, (os.cpu_count() or 1) // tp),
            "same_tokens_as_tp1": run.tokens == reference, "decode_steps": steps,
            "prefill_s": run.step_times_s[0], "decode_step_s": statistics.median(decode),
            "comm_s": comm, "compute_s": compute,
            "allreduce_us": 1e6 * statistics.median(reduces) if reduces else 0.0,
            "allreduces_per_step": run.ledger.num_allreduces("decode") // max(steps, 1),
            "bytes_per_decode_step": run.ledger.bytes(phase="decode") // max(steps, 1),
            "param_mb_per_rank": [b / 1e6 for b in run.param_bytes_per_rank],
            "launch_wall_s": wall})
        r = rows[-1]
        print(f"TP={tp}: prefill {r['prefill_s'] * 1e3:7.1f} ms, decode step "
              f"{r['decode_step_s'] * 1e3:6.1f} ms (comm {comm * 1e3:6.1f} ms, "
              f"{r['allreduces_per_step']} all-reduces of {r['allreduce_us']:.0f} µs median), "
              f"{r['param_mb_per_rank'][0]:.0f} MB/rank, same tokens: {r['same_tokens_as_tp1']}",
              flush=True)
    return rows


def _allreduce_times(rank, world_size, sizes, repeats):
    """Median seconds of one gloo all-reduce of each size (fp32 elements) on this group."""
    out = {}
    for n in sizes:
        x = torch.randn(n)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.distributed.all_reduce(x)
            times.append(time.perf_counter() - start)
        out[n] = statistics.median(times)
    return out


def allreduce_rows(hidden_size, prompt_tokens, worlds=(2, 3), repeats=200):
    """The all-reduce alone, with nothing else running: 2 ranks fit the 2 cores, 3 do not."""
    sizes = [hidden_size, prompt_tokens * hidden_size]
    rows = []
    for world in worlds:
        times = dist.launch(_allreduce_times, world, sizes, repeats)
        for n in sizes:
            rows.append({"ranks": world, "bytes": 4 * n, "median_us": 1e6 * times[n]})
            print(f"all-reduce alone, {world} ranks, {4 * n:7,d} B: {1e6 * times[n]:8.0f} µs",
                  flush=True)
    return rows


def pp_rows(batch, microbatches, repeats):
    rows = []
    one = dist.run_pipeline(1, 1, batch, repeats=repeats)
    rows.append({"pp": 1, "microbatches": 1, "makespan_s": one.makespan_s,
                 "measured_bubble": one.measured_bubble_fraction, "predicted_bubble": 0.0,
                 "max_abs_logit_diff_vs_pp1": 0.0})
    for m in microbatches:
        run = dist.run_pipeline(2, m, batch, repeats=repeats)
        rows.append({"pp": 2, "microbatches": m, "makespan_s": run.makespan_s,
                     "measured_bubble": run.measured_bubble_fraction,
                     "predicted_bubble": run.predicted_bubble_fraction,
                     "max_abs_logit_diff_vs_pp1": float((run.logits - one.logits).abs().max())})
    for r in rows:
        print(f"PP={r['pp']} M={r['microbatches']}: makespan {r['makespan_s'] * 1e3:7.1f} ms "
              f"({one.makespan_s / r['makespan_s']:.2f}x PP=1), bubble measured "
              f"{r['measured_bubble']:.2f}, predicted {r['predicted_bubble']:.2f}", flush=True)
    return rows


def gpu_rows(config, sizes, prompt_tokens):
    rows = []
    for tp in sizes:
        for phase, tokens in (("decode", 1), ("prefill", prompt_tokens)):
            for link, bw in LINKS.items():
                t = calc.tp_step_time_s(config, tokens, tp, bw, dtype_bytes=2, logit_rows=1,
                                        **H100)
                rows.append({"tp": tp, "phase": phase, "link": link, **t,
                             "comm_fraction": t["comm_s"] / t["total_s"]})
                print(f"GPU TP={tp} {phase:7s} {link:9s}: compute {t['compute_s'] * 1e6:7.2f} µs"
                      f" + comm {t['comm_s'] * 1e6:7.2f} µs = {t['total_s'] * 1e6:7.2f} µs",
                      flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--pp-batch", type=int, default=8)
    parser.add_argument("--pp-tokens", type=int, default=32)
    parser.add_argument("--pp-microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--pp-repeats", type=int, default=5,
                        help="forwards per PP launch; the median makespan's timeline is kept")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "parallel.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    model, tok = minillm.load_model()
    config = model.config
    del model
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    text = tok.encode(" ".join([PROMPT] * 20))[:args.pp_tokens]
    batch = torch.tensor([text[i:] + text[:i] for i in range(args.pp_batch)])
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, load average "
          f"{load_before[0]:.1f}; prompt {len(prompt_ids)} tokens", flush=True)
    result = {
        "command": "python benchmarks/parallel.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__},
        "prompt_tokens": len(prompt_ids),
        "tp": tp_rows(prompt_ids, args.tp, args.new_tokens),
        "allreduce_alone": allreduce_rows(config.hidden_size, len(prompt_ids)),
        "pp": pp_rows(batch, args.pp_microbatches, args.pp_repeats),
        "gpu_prediction": {"assumptions": {**H100, "dtype_bytes": 2, "links": LINKS,
                                           "latency_s": 0.0},
                           "rows": gpu_rows(config, sorted({1, 3, 9} | set(args.tp)),
                                            len(prompt_ids))},
    }
    result["load_average_before_after"] = [load_before, os.getloadavg()]
    write_result(args.out, result, indent=1)
    print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
