"""Quantization, measured: quality of RTN / GPTQ / AWQ on SmolLM2, and batch-1 decode speed.

Quality (`--part quality`): every configuration of the table (w8 per-channel, w4 g64, w3 g64;
asymmetric) by each method, with the default calibration (128 windows of 512 tokens of the
Lee corpus), evaluated on the held-out articles against the fp32 model: perplexity, KL from
fp32 to the quantized model, top-1 agreement. Also the time each method takes, and the w4
RTN model with its LM head quantized (to 8 and to 4 bits).

Speed (`--part speed`): batch-1 decode tok/s, eager and compiled, for fp32, w8 and w4 (RTN:
speed depends on the format, not on how the integers were chosen), with the LM head float,
8-bit and 4-bit, interleaved round by round. Beside each: the weight bytes a step reads, and
the ceiling those bytes give at the bandwidth measured in this run. llama.cpp on the same
GGUF (Q4_1) when `llama-cpp-python` is installed.

    python benchmarks/quant.py [--part quality|speed|all] [--eval-windows N]

Writes benchmarks/results/quant.json (each part updates its own key) and prints Markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minillm  # noqa: E402
from minillm import quant, timing  # noqa: E402
from minillm.gguf_loader import find_model_path  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from minillm.perf import measure_bandwidth  # noqa: E402
from result_file import provenance, write_json  # noqa: E402  (benchmarks/result_file.py)

RESULTS = Path(__file__).with_name("results") / "quant.json"
PROMPT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
TABLE = [("w8 per-channel", 8, None), ("w4 g64", 4, 64), ("w3 g64", 3, 64)]


def machine() -> dict:
    return {"cpu": device_name("cpu"), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": date.today().isoformat()}


def save(key: str, value: dict, device) -> None:
    """Update one part of the results file, the other part kept as it was. Each part carries
    its own provenance: `--part quality` and `--part speed` may be runs days apart, and one
    entry for the whole file would misdescribe the part that this run did not write."""
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = {**value, "provenance": provenance(device=device)}
    write_json(RESULTS, data)


def quality(model, tok, eval_windows, calibration_windows):
    calibration = quant.calibration_windows(tok, calibration_windows, 512)
    models, rows = {}, []
    for method in quant.METHODS:
        for label, bits, group in TABLE:
            t0 = time.perf_counter()
            models[f"{method} {label}"] = quant.quantize_model(
                model, method, bits, group, calibration=calibration, progress=False)
            seconds = time.perf_counter() - t0
            rows.append({"method": method, "config": label, "bits": bits, "group_size": group,
                         "quantize_s": round(seconds, 1)})
            print(f"quantized {method} {label} in {seconds:.0f} s", flush=True)
    for head in (8, 4):
        models[f"rtn w4 g64, head w{head}"] = quant.quantize_model(model, "rtn", 4, 64,
                                                                 lm_head=head, progress=False)
        rows.append({"method": "rtn", "config": f"w4 g64, head w{head}", "bits": 4,
                     "group_size": 64, "lm_head_bits": head, "quantize_s": None})
    t0 = time.perf_counter()
    results = quant.evaluate_many({"fp32": model, **models}, tok, ref_model=model,
                                  max_windows=eval_windows)
    print(f"evaluated {len(models) + 1} models in {time.perf_counter() - t0:.0f} s")
    table = [{"method": "fp32", "config": "-", "bits": 32, "group_size": None,
              "quantize_s": None, **results["fp32"],
              "bytes_per_token": quant.weight_bytes(model)["per_token"]}]
    for row in rows:
        name = f"{row['method']} {row['config']}"
        table.append({**row, **results[name],
                      "bytes_per_token": quant.weight_bytes(models[name])["per_token"]})
    print("\n| method | config | ppl | KL | top-1 | MB/token | quantize s |\n|---|---|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['method']} | {r['config']} | {r['ppl']:.3f} | {r['kl']:.4f} | "
              f"{r['top1']:.3f} | {r['bytes_per_token'] / 1e6:.0f} | {r['quantize_s'] or '-'} |")
    return {"machine": machine(), "eval_tokens": results["fp32"]["tokens"],
            "calibration": f"{calibration_windows} x 512", "rows": table}


def decode_times(model, ids, n, compile):
    """(t(1 token), t(n tokens)) of one round; decode tok/s is (n − 1) / their difference."""
    t0 = time.perf_counter()
    minillm.generate(model, ids, 1, ignore_eos=True, compile=compile)
    t1 = time.perf_counter()
    minillm.generate(model, ids, n, ignore_eos=True, compile=compile)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def decode_tps(rounds, n):
    """(best, median) decode tok/s over rounds of (t1, tn): the best from the best of each
    time (`timing.decode_tok_s`), the median of the rounds' own ratios."""
    t_one, t_all = zip(*rounds)
    return (timing.decode_tok_s(t_one, t_all, n),
            statistics.median((n - 1) / (tn - t1) for t1, tn in rounds))


def speed(model, tok, new_tokens, rounds):
    ids = tok.apply_chat_template(PROMPT)
    configs = {"fp32": model,
               "w8": quant.quantize_model(model, "rtn", 8, None, progress=False),
               "w4": quant.quantize_model(model, "rtn", 4, 64, progress=False),
               "w4, head w8": quant.quantize_model(model, "rtn", 4, 64, lm_head=8,
                                                   progress=False),
               "w4, head w4": quant.quantize_model(model, "rtn", 4, 64, lm_head=True,
                                                   progress=False)}
    bandwidth = measure_bandwidth()["sum"]  # a read-only stream, as decode reads weights
    runs = {(name, c): [] for name in configs for c in (False, True)}
    first_call = {}
    for (name, compile_) in runs:  # warm-up: the compiled runs pay their compilation here
        t0 = time.perf_counter()
        decode_times(configs[name], ids, 8, compile_)
        first_call[f"{name}{' compiled' if compile_ else ''}"] = round(time.perf_counter() - t0, 1)
    for _ in range(rounds):
        for (name, compile_), out in runs.items():
            out.append(decode_times(configs[name], ids, new_tokens, compile_))
    rows = []
    for (name, compile_), out in runs.items():
        nbytes = quant.weight_bytes(configs[name])["per_token"]
        best, median = decode_tps(out, new_tokens)
        rows.append({"model": name, "compiled": compile_, "tok_s": round(best, 1),
                     "tok_s_median": round(median, 1),
                     "bytes_per_token": nbytes, "ceiling_tok_s": round(bandwidth / nbytes, 1)})
    base = {r["compiled"]: r["tok_s"] for r in rows if r["model"] == "fp32"}
    for r in rows:
        r["vs_fp32"] = round(r["tok_s"] / base[r["compiled"]], 2)
        r["of_ceiling"] = round(r["tok_s"] / r["ceiling_tok_s"], 2)
    llama = llama_cpp_speed(ids, new_tokens, rounds)
    print(f"\nbandwidth {bandwidth / 1e9:.1f} GB/s; {new_tokens} new tokens, best of {rounds}")
    print("| model | path | tok/s | vs fp32 | MB/token | ceiling tok/s | of ceiling |\n|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {'compiled' if r['compiled'] else 'eager'} | {r['tok_s']} | "
              f"{r['vs_fp32']}x | {r['bytes_per_token'] / 1e6:.0f} | {r['ceiling_tok_s']} | "
              f"{r['of_ceiling']:.0%} |")
    if llama is None:
        print("llama.cpp: not installed (pip install llama-cpp-python to compare)")
    else:
        print(f"llama.cpp Q4_1: {llama} tok/s")
    return {"machine": machine(), "bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "new_tokens": new_tokens, "rounds": rounds, "rows": rows,
            "first_call_s": first_call, "llama_cpp_tok_s": llama}


def llama_cpp_speed(ids, n, rounds):
    """Decode tok/s of llama.cpp on the same GGUF, measured as minillm's is, or None."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(find_model_path()), n_ctx=2048, n_threads=torch.get_num_threads(),
                verbose=False)

    def run(k):
        llm.reset()
        t0 = time.perf_counter()
        for i, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1)):
            if i + 1 == k:
                break
        return time.perf_counter() - t0

    run(8)
    best = 0.0
    for _ in range(rounds):
        best = max(best, (n - 1) / (run(n) - run(1)))
    return round(best, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["quality", "speed", "all"], default="all")
    parser.add_argument("--eval-windows", type=int, default=None,
                        help="evaluate on the first N windows only (default: all)")
    parser.add_argument("--calibration-windows", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("MINILLM_THREADS", torch.get_num_threads())))
    model, tok = minillm.load_model()
    if args.part in ("quality", "all"):
        save("quality", quality(model, tok, args.eval_windows, args.calibration_windows),
             model.device)
    if args.part in ("speed", "all"):
        save("speed", speed(model, tok, args.new_tokens, args.rounds), model.device)


if __name__ == "__main__":
    main()
