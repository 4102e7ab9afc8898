"""Batch-1 prefill and decode speed: minillm against Hugging Face `transformers` generate.

Both run the same model (SmolLM2-135M-Instruct from the same GGUF), prompt and dtype, in one
process, interleaved round by round so that machine noise hits all alike. minillm runs three
times: eager, with its decode steps compiled by torch.compile (`generate(..., compile=True)`;
the warm-up pays the compilation), and eager with BLAS for every weight product instead of
the C++ small-M kernel (`minillm_blas`: MINILLM_CPU_KERNEL=0, weights in BLAS's layout).
Decode tok/s is
measured as (N - 1) / (t(N tokens) - t(1 token)), which cancels the prefill from both.

The bandwidth-bound ceiling is weight bytes / measured bandwidth (measured in this run too):
batch-1 decode reads every weight once per token, so no engine can beat it.

    python benchmarks/decode.py [--dtype float32] [--new-tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import minillm  # noqa: E402
from minillm import calc  # noqa: E402
from minillm.gguf_loader import find_model_path  # noqa: E402
from minillm.perf import measure_bandwidth  # noqa: E402

PROMPT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


def load_hf(dtype):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    path = find_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=dtype).eval()


def time_minillm(model, ids, n, compile=False):
    t0 = time.perf_counter()
    out = minillm.generate(model, ids, n, ignore_eos=True, compile=compile)
    assert len(out) == n
    return time.perf_counter() - t0


@torch.inference_mode()
def time_hf(model, ids, n):
    x = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    if x.is_cuda:
        torch.cuda.synchronize()
    assert out.shape[1] == len(ids) + n
    return time.perf_counter() - t0


@contextmanager
def kernel_off():
    """MINILLM_CPU_KERNEL=0 inside: every weight product goes to BLAS."""
    before = os.environ.get("MINILLM_CPU_KERNEL")
    os.environ["MINILLM_CPU_KERNEL"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MINILLM_CPU_KERNEL"]
        else:
            os.environ["MINILLM_CPU_KERNEL"] = before


def time_blas(model, ids, n):
    with kernel_off():
        return time_minillm(model, ids, n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    model, tok = minillm.load_model(dtype=dtype)
    with kernel_off():  # the same weights in the layout BLAS's matvec reads fastest
        model_blas, _ = minillm.load_model(dtype=dtype)
    hf = load_hf(dtype)
    ids = tok.apply_chat_template(PROMPT)
    n = args.new_tokens
    engines = {"minillm": lambda k: time_minillm(model, ids, k),
               "minillm_compiled": lambda k: time_minillm(model, ids, k, compile=True),
               "minillm_blas": lambda k: time_blas(model_blas, ids, k),
               "transformers": lambda k: time_hf(hf, ids, k)}
    for run in engines.values():  # warm-up
        run(2)

    samples = {name: {"prefill": [], "decode": []} for name in engines}
    bandwidths = []
    for r in range(args.rounds):
        bandwidths.append(max(measure_bandwidth().values()))
        for name, run in engines.items():
            t1 = run(1)
            tn = run(n)
            samples[name]["prefill"].append(len(ids) / t1)
            samples[name]["decode"].append((n - 1) / (tn - t1))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} decode {v['decode'][-1]:.1f} tok/s" for k, v in samples.items()), flush=True)

    bw = statistics.median(bandwidths)
    weight_bytes = calc.weight_bytes(model.config.num_params(), dtype.itemsize)
    ceiling = bw / weight_bytes
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in samples.items()}
    hf_decode = med["transformers"]["decode"]
    ratio = med["minillm"]["decode"] / hf_decode
    ratio_compiled = med["minillm_compiled"]["decode"] / hf_decode
    result = {
        "benchmark": "decode", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads",
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "dtype": args.dtype,
        "prompt_tokens": len(ids), "new_tokens": n, "rounds": args.rounds,
        "bandwidth_GBps": bw / 1e9, "weight_MB": weight_bytes / 1e6,
        "ceiling_tok_s": ceiling,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "minillm": med["minillm"], "minillm_compiled": med["minillm_compiled"],
        "minillm_blas": med["minillm_blas"],
        "small_m_kernel_speedup": med["minillm"]["decode"] / med["minillm_blas"]["decode"],
        "transformers": med["transformers"],
        "decode_ratio": ratio, "decode_ratio_compiled": ratio_compiled,
        "minillm_fraction_of_ceiling": med["minillm"]["decode"] / ceiling,
        "minillm_compiled_fraction_of_ceiling": med["minillm_compiled"]["decode"] / ceiling,
        "transformers_fraction_of_ceiling": med["transformers"]["decode"] / ceiling,
        "samples": samples,
    }
    print()
    print(f"{'':18s}{'prefill tok/s':>15s}{'decode tok/s':>15s}{'of ceiling':>12s}"
          f"{'vs transformers':>17s}")
    for name in engines:
        print(f"{name:18s}{med[name]['prefill']:15.1f}{med[name]['decode']:15.1f}"
              f"{med[name]['decode'] / ceiling:12.0%}{med[name]['decode'] / hf_decode:16.2f}x")
    print(f"bandwidth {bw / 1e9:.1f} GB/s, {args.dtype} weights {weight_bytes / 1e6:.0f} MB "
          f"-> ceiling {ceiling:.1f} tok/s")
    print(f"goal: decode >= 1.5x transformers and >= 60% of the ceiling; "
          f"eager {ratio:.2f}x / {med['minillm']['decode'] / ceiling:.0%}, "
          f"compiled {ratio_compiled:.2f}x / {med['minillm_compiled']['decode'] / ceiling:.0%}")
    print(f"the C++ small-M kernel against BLAS for every weight product (both eager): "
          f"{result['small_m_kernel_speedup']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
