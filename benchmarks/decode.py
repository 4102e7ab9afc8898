"""Batch-1 prefill and decode speed: minillm against Hugging Face `transformers` generate.

Both run the same model (SmolLM2-135M-Instruct from the same GGUF), prompt and dtype, in one
process, interleaved round by round so that machine noise hits all alike. minillm runs three
times: eager, with its decode steps compiled by torch.compile (`generate(..., compile=True)`;
the warm-up pays the compilation), and eager with BLAS for every weight product instead of
the C++ small-M kernel (`minillm_blas`: MINILLM_CPU_KERNEL=0, weights in BLAS's layout).
Decode tok/s is
measured as (N - 1) / (t(N tokens) - t(1 token)), which cancels the prefill from both.

With `--dtype float32` (the default) the same model also runs with bf16 weights and
activations (`minillm_bf16`, eager and compiled): half the bytes per step. Where the CPU has
native bf16 (`devices.cpu_native_bf16()`), `load_model(dtype="auto")` picks it.

Two ceilings, both measured in this run, each weight bytes / a bandwidth (batch-1 decode reads
every weight once per token, so no engine can beat them):
- STREAM: the best of copy, triad and sum (`perf.measure_bandwidth`), what the memory
  system can do;
- matvec: the best of BLAS's and minillm's matrix-vector stream over a model-sized matrix
  (`perf.measure_matvec_bandwidth`), what a decode step can actually get. The gap between
  the two is the price of the matvec shape itself (a reduction per short row), not of the
  engine; the gap between matvec and the measured decode is the engine's per-step overhead.

    python benchmarks/decode.py [--dtype float32] [--new-tokens 64] [--rounds 3] [--no-bf16]
"""
from __future__ import annotations

import argparse
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
from minillm import calc, cpu_select  # noqa: E402
from minillm.gguf_loader import find_model_path  # noqa: E402
from minillm.devices import cpu_native_bf16, device_name  # noqa: E402
from minillm.perf import measure_bandwidth, measure_matvec_bandwidth  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

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


def time_minillm(model, ids, n, compile=False, cuda_graph=None):
    t0 = time.perf_counter()
    out = minillm.generate(model, ids, n, ignore_eos=True, compile=compile,
                           cuda_graph=cuda_graph)
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
    ap.add_argument("--no-bf16", action="store_true",
                    help="skip the bf16 model that runs beside the fp32 one")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with_bf16 = dtype == torch.float32 and not args.no_bf16
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
    bytes_per_elem = {name: dtype.itemsize for name in engines}
    if with_bf16:
        model16, _ = minillm.load_model(dtype=torch.bfloat16)
        engines["minillm_bf16"] = lambda k: time_minillm(model16, ids, k)
        engines["minillm_bf16_compiled"] = lambda k: time_minillm(model16, ids, k, compile=True)
        bytes_per_elem.update(minillm_bf16=2, minillm_bf16_compiled=2)
    first_call = {}
    for name, run in engines.items():  # warm-up (the compiled ones compile here)
        t0 = time.perf_counter()
        run(2)
        first_call[name] = time.perf_counter() - t0

    samples = {name: {"prefill": [], "decode": []} for name in engines}
    stream, matvec = [], []
    for r in range(args.rounds):
        stream.append(max(measure_bandwidth().values()))
        matvec.append(measure_matvec_bandwidth())
        for name, run in engines.items():
            t1 = run(1)
            tn = run(n)
            samples[name]["prefill"].append(len(ids) / t1)
            samples[name]["decode"].append((n - 1) / (tn - t1))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} decode {v['decode'][-1]:.1f} tok/s" for k, v in samples.items()), flush=True)

    bw = statistics.median(stream)
    matvec_by_path = {p: statistics.median(m[p] for m in matvec) for p in matvec[0]}
    mv = max(matvec_by_path.values())
    num_params = model.config.num_params()
    weight_bytes = calc.weight_bytes(num_params, dtype.itemsize)
    ceiling = bw / weight_bytes
    ceiling_of = {name: bw / calc.weight_bytes(num_params, b) for name, b in bytes_per_elem.items()}
    matvec_ceiling_of = {name: mv / calc.weight_bytes(num_params, b)
                         for name, b in bytes_per_elem.items()}
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in samples.items()}
    hf_decode = med["transformers"]["decode"]
    ratio = med["minillm"]["decode"] / hf_decode
    ratio_compiled = med["minillm_compiled"]["decode"] / hf_decode
    result = {
        "benchmark": "decode", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads",
        "cpu": device_name("cpu"), "cpu_native_bf16": cpu_native_bf16(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "dtype": args.dtype,
        "prompt_tokens": len(ids), "new_tokens": n, "rounds": args.rounds,
        "bandwidth_GBps": bw / 1e9, "matvec_GBps": mv / 1e9,
        "matvec_by_path_GBps": {p: v / 1e9 for p, v in matvec_by_path.items()},
        "weight_MB": weight_bytes / 1e6,
        "ceiling_tok_s": ceiling, "matvec_ceiling_tok_s": mv / weight_bytes,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "minillm": med["minillm"], "minillm_compiled": med["minillm_compiled"],
        "minillm_blas": med["minillm_blas"],
        "small_m_kernel_speedup": med["minillm"]["decode"] / med["minillm_blas"]["decode"],
        "transformers": med["transformers"],
        "decode_ratio": ratio, "decode_ratio_compiled": ratio_compiled,
        "minillm_fraction_of_ceiling": med["minillm"]["decode"] / ceiling,
        "minillm_compiled_fraction_of_ceiling": med["minillm_compiled"]["decode"] / ceiling,
        "transformers_fraction_of_ceiling": med["transformers"]["decode"] / ceiling,
        "fraction_of_matvec_ceiling": {k: med[k]["decode"] / matvec_ceiling_of[k] for k in med},
        "first_call_s": first_call,
        "samples": samples,
    }
    result["cpu_kernel_selection"] = cpu_select.current().lines()
    if with_bf16:
        result["minillm_bf16"] = med["minillm_bf16"]
        result["minillm_bf16_compiled"] = med["minillm_bf16_compiled"]
        result["bf16_vs_fp32"] = med["minillm_bf16"]["decode"] / med["minillm"]["decode"]
        result["bf16_vs_fp32_compiled"] = (med["minillm_bf16_compiled"]["decode"]
                                           / med["minillm_compiled"]["decode"])
    print()
    print(f"{'':22s}{'prefill tok/s':>14s}{'decode tok/s':>13s}{'of STREAM':>11s}"
          f"{'of matvec':>11s}{'vs transformers':>17s}{'first call s':>14s}")
    for name in engines:
        d = med[name]["decode"]
        print(f"{name:22s}{med[name]['prefill']:14.1f}{d:13.1f}{d / ceiling_of[name]:11.0%}"
              f"{d / matvec_ceiling_of[name]:11.0%}{d / hf_decode:16.2f}x"
              f"{first_call[name]:14.1f}")
    print(f"{result['cpu']} (native bf16: {'yes' if result['cpu_native_bf16'] else 'no'}), "
          f"{torch.get_num_threads()} threads")
    print(f"bandwidth: STREAM {bw / 1e9:.1f} GB/s, matvec {mv / 1e9:.1f} GB/s ("
          + ", ".join(f"{p} {v / 1e9:.1f}" for p, v in matvec_by_path.items())
          + f"); {args.dtype} weights {weight_bytes / 1e6:.0f} MB -> ceilings "
          f"{ceiling:.1f} / {mv / weight_bytes:.1f} tok/s")
    print(f"vs transformers: eager {ratio:.2f}x, compiled {ratio_compiled:.2f}x")
    if with_bf16:
        print(f"bf16 against fp32: eager {result['bf16_vs_fp32']:.2f}x, compiled "
              f"{result['bf16_vs_fp32_compiled']:.2f}x")
    print(f"the C++ small-M kernel against BLAS for every weight product (both eager): "
          f"{result['small_m_kernel_speedup']:.2f}x")
    print("CPU kernel selection (minillm.cpu_select):")
    for line in result["cpu_kernel_selection"]:
        print(f"  {line}")
    write_result(args.out, result, device=model.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
