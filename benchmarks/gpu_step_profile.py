"""The GPU's idle gaps in a decode step, by torch.profiler: eager against CUDA graphs.

On a GPU a small model's decode step is launch-bound: the GPU finishes each small kernel
before Python has launched the next, and waits. This profiles S decode steps of SmolLM2
(bf16, Triton attention) in four ways:

    generate eager        batch 1, `generate(cuda_graph=False)`
    generate graph        batch 1, `generate(cuda_graph=True)` (one replay per token)
    engine eager, B       LLMEngine(enforce_eager=True), B sequences decoding
    engine graph, B       LLMEngine(enforce_eager=False): the padded bucket's graph

and reports per step: wall time, GPU busy time (the union of the kernels' intervals), the
idle share (1 - busy / wall), the kernels per step, the CUDA API calls the CPU made
(launches, copies, syncs) and the ten kernels that take the most time
(`step_breakdown.kernel_breakdown`, as benchmarks/gpu_check.py's breakdowns). A graph step
should show ~1 launch and a small idle share; an eager one, ~900 launches and the GPU idle
most of the time.

    python benchmarks/gpu_step_profile.py [--steps 32] [--batch 64] [--out FILE]

The glue between the weight products runs as Triton kernels on CUDA (`minillm.kernels.glue`,
~9 kernels per layer); MINILLM_TRITON_GLUE=0 runs the plain PyTorch ops instead (~22), for
the comparison.

Needs a CUDA GPU (it prints one line and exits 0 without one).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import minillm  # noqa: E402
import step_breakdown  # noqa: E402
from serving import step_until_decoding  # noqa: E402
from step_breakdown import device_kernels, kernel_breakdown, profile_steps  # noqa: E402
from minillm.engine import LLMEngine, SamplingParams  # noqa: E402

PROMPT = list(range(1000, 1040))


def profiled(fn, steps: int) -> dict:
    """Profile `fn` (one decode step) `steps` times after one untimed call."""
    events, wall_us = profile_steps(fn, steps, cuda=True)
    kernels = device_kernels(events, cuda=True)
    api = [e.name for e in events if e.device_type == DeviceType.CPU
           and e.name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy",
                                  "cudaStreamSynchronize", "cudaDeviceSynchronize",
                                  "cudaEventSynchronize"))]
    kb = kernel_breakdown(kernels, steps, top=10)
    return {"wall_ms": wall_us / steps / 1e3, "gpu_busy_ms": kb["busy_us_per_step"] / 1e3,
            "idle_share": 1 - kb["busy_us_per_step"] * steps / wall_us,
            "kernels_per_step": kb["kernels_per_step"],
            "api_calls_per_step": {n: api.count(n) / steps for n in sorted(set(api))},
            "top_kernels": kb["top"]}


def generate_step(model, cuda_graph: bool, compile: bool = False):
    """One decode token per call: generate_stream kept open, advanced by next()."""
    return step_breakdown.generate_step(model, PROMPT, cuda_graph, compile=compile)


def engine_step(model, batch: int, enforce_eager: bool):
    engine = LLMEngine(model, max_num_seqs=batch, enforce_eager=enforce_eager)
    for i in range(batch):
        engine.add_request(str(i), [p + i for p in PROMPT],
                           SamplingParams(max_tokens=2000, ignore_eos=True))
    step_until_decoding(engine)
    return engine.step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32, help="profiled steps (at most 500)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--compiled", action="store_true",
                    help="also profile generate's graph of the torch.compile'd step")
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2's shapes with random weights (no GGUF needed)")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results")
                    / "gpu_step_profile.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step_profile: no CUDA device, nothing to profile")
        return 0
    step_breakdown.init_profiler_for_cuda_graphs()  # before the first graph is captured
    if args.random_weights:
        model = minillm.LlamaModel(minillm.ModelConfig.smollm2_135m(), attn_backend="triton")
        model = model.init_random_weights(seed=0).to("cuda", torch.bfloat16).eval()
    else:
        model, _ = minillm.load_model(dtype=torch.bfloat16, device="cuda",
                                      attn_backend="triton")
    cases = {"generate eager": lambda: generate_step(model, False),
             "generate graph": lambda: generate_step(model, True),
             f"engine eager, {args.batch}": lambda: engine_step(model, args.batch, True),
             f"engine graph, {args.batch}": lambda: engine_step(model, args.batch, False)}
    if args.compiled:
        cases["generate graph, compiled"] = lambda: generate_step(model, True, compile=True)
    print(f"glue between the weight products: "
          f"{'Triton kernels' if minillm.layers.fused.TRITON_GLUE else 'plain PyTorch ops'}"
          f" (MINILLM_TRITON_GLUE=0 / 1)", flush=True)
    rows = {}
    for name, make in cases.items():
        rows[name] = profiled(make(), args.steps)
        r = rows[name]
        print(f"{name:>20}: {r['wall_ms']:.3f} ms/step, GPU busy {r['gpu_busy_ms']:.3f} ms, "
              f"idle {100 * r['idle_share']:.0f}%, {r['kernels_per_step']:.0f} kernels, "
              f"CUDA API {r['api_calls_per_step']}", flush=True)
        for k in r["top_kernels"][:5]:
            print(f"{'':>22}{k['us_per_step']:8.1f} µs {k['per_step']:5.0f}x  {k['kernel']}",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch":
                                    torch.__version__, "steps": args.steps,
                                    "triton_glue": minillm.layers.fused.TRITON_GLUE,
                                    "random_weights": args.random_weights, "rows": rows},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
