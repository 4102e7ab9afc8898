"""Where a batch-1 decode step's microseconds go, by the PyTorch profiler: before and after.

Three ways of running SmolLM2-135M's decode step (fp32, CPU):

    eager, unfused   the model's glue as separate PyTorch ops (the fused C++ switched off)
    eager, fused     the glue through `minillm.layers.fused` (RMSNorm, RoPE, SiLU·up and the
                     residual adds, one C++ pass each)
    compiled         `generate(..., compile=True)`: the whole step one torch.compile graph

For each, the step is timed without the profiler (best of --rounds of S steps, the prefill
cancelled: t(1 + S tokens) - t(1 token)), then profiled over the same S steps, and each
op's self time is put in one of four bins, per step:

    weights     the 121 weight products (the C++ small-M kernel, or BLAS mm/mv)
    attention   SDPA over the cache, or the C++ decode kernel where this host chose it
    glue        every other op (norms, RoPE, SiLU, adds, cache writes, argmax, copies; in
                the compiled step, Inductor's generated loops)
    graph runtime   the compiled step's guard checks (TorchDynamo Cache Lookup) and the
                wrappers around its generated code
    outside     the profiled step's wall time minus all op self time: Python, dispatch

The weights' floor is their bytes over this machine's matvec bandwidth
(`perf.measure_matvec_bandwidth`), printed beside. The profiler adds its own cost per op,
so the bins are shares of the profiled step; the untimed step is the real one.

    python benchmarks/decode_profile.py [--steps 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minillm  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from minillm.attention import cpu_decode  # noqa: E402
from minillm.layers import cpu_linear, fused  # noqa: E402
from minillm.measure import step_profile  # noqa: E402
from minillm.perf import measure_matvec_bandwidth  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

RESULTS = Path(__file__).with_name("results") / "decode_profile.json"
PROMPT = [1, 504, 3937, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
# By exact name: Inductor names its generated loops after the ops they fused, so a loop
# that fused a norm with a product's reshape is called "..._small_m_linear_..." and is glue.
# In eager mode the C++ small-M kernel is a pybind call the profiler does not see as an op:
# Lab 01's forward hooks wrap every Linear in the range step_profile.WEIGHTS_RANGE instead.
WEIGHT_OPS = {step_profile.WEIGHTS_RANGE, "aten::mm", "aten::addmm", "aten::mv"}
# Each build of a C++ kernel names its operator after its ISA (minillm_cpu::small_m_linear_avx2,
# ..._avx512, ...: `minillm.cpu_select` chooses which runs).
WEIGHT_OP_PREFIXES = ("minillm_cpu::small_m_linear_", "minillm_cpu::w4_linear_",
                      "minillm_cpu::w8_linear_")
ATTENTION_OPS = {"aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "minillm_attention::paged_decode_cpu"}  # eager, where the kernel is chosen
# The compiled graph's own runtime: guard checks, the wrappers around the generated code.
BINS = ("weights", "attention", "glue", "graph runtime", "outside")
GRAPH_RUNTIME = ("TorchDynamo", "Torch-Compiled Region", "## Call CompiledFxGraph",
                 "Pregraph bytecode", "AOTDispatcher")


def labelled(name, fn):
    """fn, with a profiler label: the eager C++ kernels are pybind calls the profiler would
    not see (in the compiled step they are dispatcher operators and appear by name)."""
    def call(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return call


def label_kernels(linear, glue, attention):
    """Point the modules' `load_kernel` at wrappers of `linear`, `glue` (None: off) and
    `attention` (the decode kernel) whose every function carries a profiler label."""
    class Labelled:  # a kernel module, every function wrapped
        def __init__(self, module, prefix):
            for attr in dir(module):
                if not attr.startswith("_") and callable(getattr(module, attr)):
                    setattr(self, attr, labelled(f"{prefix}::{attr}", getattr(module, attr)))

    wrapped_linear = Labelled(linear, "minillm")
    wrapped_glue = None if glue is None else Labelled(glue, "minillm_fused")
    wrapped_attention = Labelled(attention, "minillm_attention")
    cpu_linear.load_kernel = lambda: wrapped_linear
    fused.load_kernel = lambda: wrapped_glue
    cpu_decode.load_kernel = lambda: wrapped_attention


def step_seconds(model, steps, ways, rounds):
    """{way: seconds per decode step}: t(1 + S tokens) - t(1 token), each the best of
    `rounds`, the ways interleaved round by round so that the machine's drift hits all."""
    best = {(w, n): float("inf") for w in ways for n in (1, 1 + steps)}
    for _ in range(rounds):
        for way, (compile, switch) in ways.items():
            switch()
            for n in (1, 1 + steps):
                t0 = time.perf_counter()
                minillm.generate(model, PROMPT, n, compile=compile, ignore_eos=True)
                best[way, n] = min(best[way, n], time.perf_counter() - t0)
    return {w: (best[w, 1 + steps] - best[w, 1]) / steps for w in ways}


def profiled_bins(model, steps, compile):
    """Per-step µs in each bin: a profile of 1 + S tokens minus a profile of 1 token."""
    def run(n):
        hooks = [] if compile else step_profile.hook_linears(model)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                minillm.generate(model, PROMPT, n, compile=compile, ignore_eos=True)
                wall = time.perf_counter() - t0
        finally:
            for h in hooks:
                h.remove()
        bins = defaultdict(float)
        for e in prof.key_averages():
            name = e.key
            if name in WEIGHT_OPS or name.startswith(WEIGHT_OP_PREFIXES):
                bins["weights"] += e.self_cpu_time_total
            elif name in ATTENTION_OPS:
                bins["attention"] += e.self_cpu_time_total
            elif name.startswith(GRAPH_RUNTIME):
                bins["graph runtime"] += e.self_cpu_time_total
            else:
                bins["glue"] += e.self_cpu_time_total
        bins["outside"] = wall * 1e6 - sum(bins.values())
        return bins
    one, many = run(1), run(1 + steps)
    return {k: (many[k] - one[k]) / steps for k in BINS}


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True  # name Inductor's loops
    model, _ = minillm.load_model(dtype=torch.float32)
    if None in (cpu_linear.load_kernel(), fused.load_kernel(), cpu_decode.load_kernel()):
        sys.exit("the C++ kernels are not available here (see the warning above)")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    matvec = max(measure_matvec_bandwidth().values())
    floor_us = weight_bytes / matvec * 1e6
    load_linear, load_glue, load_attention = (cpu_linear.load_kernel, fused.load_kernel,
                                              cpu_decode.load_kernel)
    linear, glue, attention = load_linear(), load_glue(), load_attention()

    def glue_off():
        cpu_linear.load_kernel, fused.load_kernel = load_linear, (lambda: None)

    def glue_on():
        cpu_linear.load_kernel, fused.load_kernel = load_linear, load_glue

    ways = {"eager, unfused": (False, glue_off), "eager, fused": (False, glue_on),
            "compiled": (True, glue_on)}
    try:
        for compile, switch in ways.values():
            switch()
            minillm.generate(model, PROMPT, 4, compile=compile)  # warm-up (and compile)
        steps = step_seconds(model, args.steps, ways, args.rounds)
        results = {}
        for name, (compile, switch) in ways.items():
            switch()
            if not compile:  # (relabelling under compile would change what it guards on)
                label_kernels(linear, glue if name == "eager, fused" else None, attention)
            results[name] = {"step_us": steps[name] * 1e6,
                             "profiled_us": profiled_bins(model, args.steps, compile)}
    finally:
        glue_on()
        cpu_decode.load_kernel = load_attention
    print(f"{device_name('cpu')}, {args.threads} threads, fp32: batch-1 decode step, "
          f"{args.steps} steps; weights' floor {floor_us:.0f} µs ({weight_bytes / 1e6:.0f} MB "
          f"at the matvec stream's {matvec / 1e9:.1f} GB/s)\n")
    print(f"{'':16s}{'step µs':>9s}{'tok/s':>7s}{'of floor':>9s}   profiled µs per step: "
          + "".join(f"{b:>14s}" for b in BINS))
    for name, r in results.items():
        print(f"{name:16s}{r['step_us']:9.0f}{1e6 / r['step_us']:7.1f}"
              f"{floor_us / r['step_us']:9.0%}   {'':22s}"
              + "".join(f"{r['profiled_us'][b]:14.0f}" for b in BINS))
    out = {"benchmark": "decode_profile", "date": time.strftime("%Y-%m-%d %H:%M"),
           "cpu": device_name("cpu"), "threads": args.threads, "steps": args.steps,
           "weight_bytes": weight_bytes, "matvec_bytes_per_s": matvec, "floor_us": floor_us,
           "results": results}
    write_result(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
