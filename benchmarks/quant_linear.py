"""Quantized weight products for decode on the CPU: the W4 / W8 kernels against the others.

A decode step multiplies M rows (1 for plain decode, k + 1 for a speculative verify) by every
weight, so it costs what streaming the weights costs; quantized weights only pay off if the
product reads them packed. This script times, in one run and interleaved round by round,
SmolLM2-135M's 120 layer products (30 layers x qkv, o, gate_up, down; each a distinct matrix,
so nothing stays in cache) for M = 1 and M = 5 rows through:

    fp32 small-M      minillm.layers.cpu_linear, fp32 W (the unquantized decode path)
    w8 kernel         minillm.quant.cpu_kernels, 8-bit W, fp32 x
    w4 kernel         minillm.quant.cpu_kernels, 4-bit W, fp32 x
    dequant+linear    packing.dequantize_packed then F.linear (the reference path), 4-bit W
    C++ dequant+lin   cpu_kernels.dequantize (one pass, the same bits) then F.linear: what
                      QuantLinear does for more than 16 rows (prefill, large engine steps)
    torch int8 bf16   torch._weight_int8pack_mm: int8 W, per-channel bf16 scales, bf16 x
    torch int4 bf16   torch._weight_int4pack_mm_for_cpu: 4-bit W, bf16 scales and zeros,
                      bf16 x (bf16 activations are not exact enough for minillm's contract;
                      here as the speed PyTorch reaches)

and prints each one's median, the weight bytes it reads per pass (packed values, scales and
zeros as each stores them; dequant+linear also writes and re-reads the fp32 matrix) and the
GB/s that makes, next to this machine's measured memory bandwidth (the roofline).

    python benchmarks/quant_linear.py [--repeats 7] [--group-size 64] [--rows 1 5 64]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import ModelConfig  # noqa: E402
from minillm.layers import cpu_linear  # noqa: E402
from minillm.perf import measure_bandwidth  # noqa: E402
from minillm.quant import cpu_kernels, packing, rtn  # noqa: E402


def layer_shapes() -> list[tuple[int, int]]:
    """(N, K) of every layer product of SmolLM2-135M, in model order."""
    c = ModelConfig.smollm2_135m()
    layer = [(c.q_size + 2 * c.kv_size, c.hidden_size), (c.hidden_size, c.q_size),
             (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    return layer * c.num_layers


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def build_paths(shapes, group_size: int, seed: int = 0):
    """{name: (fn(x, weight), [weight per shape], bytes read per pass)}."""
    gen = torch.Generator().manual_seed(seed)
    fp32, w8, w4, i8, i4 = [], [], [], [], []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        fp32.append(w)
        w8.append(packing.pack(rtn(w, bits=8, group_size=group_size)))
        w4.append(packing.pack(rtn(w, bits=4, group_size=group_size)))
        # PyTorch's int8 product: symmetric, one bf16 scale per output channel.
        s = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        i8.append((torch.round(w / s[:, None]).to(torch.int8), s.bfloat16()))
        # PyTorch's int4 product: u in [0, 15] packed by its own converter, and per group a
        # bf16 (scale, zero) pair [G, N, 2], with W = (u - 8) * scale + zero.
        qw, sc, zs = w4[-1]
        u = packing.unpack(qw, 4).to(torch.int32)
        s4 = sc.t().contiguous()
        z4 = ((8 - zs) * sc).t().contiguous()
        i4.append((torch._convert_weight_to_int4pack_for_cpu(u, 1),
                   torch.stack([s4, z4], dim=-1).bfloat16().contiguous()))

    def w4k(x, p):
        return cpu_kernels.quant_linear(x, *p, group_size, 4)

    def w8k(x, p):
        return cpu_kernels.quant_linear(x, *p, group_size, 8)

    def dequant(x, p):
        return F.linear(x, packing.dequantize_packed(*p, 4))

    def dequant_cpp(x, p):
        return F.linear(x, cpu_kernels.dequantize(*p, 4))

    return {
        "fp32 small-M": (cpu_linear.small_m_linear, fp32, nbytes(*fp32)),
        "w8 kernel": (w8k, w8, sum(nbytes(*p) for p in w8)),
        "w4 kernel": (w4k, w4, sum(nbytes(*p) for p in w4)),
        "dequant+linear": (dequant, w4, sum(nbytes(*p) for p in w4) + 2 * nbytes(*fp32)),
        "C++ dequant+lin": (dequant_cpp, w4, sum(nbytes(*p) for p in w4) + 2 * nbytes(*fp32)),
        "torch int8 bf16": (lambda x, p: torch._weight_int8pack_mm(x, *p), i8,
                            sum(nbytes(*p) for p in i8)),
        "torch int4 bf16": (lambda x, p: torch._weight_int4pack_mm_for_cpu(
            x, p[0], group_size, p[1]), i4, sum(nbytes(*p) for p in i4)),
    }


FEW_ROW_KERNELS = ("fp32 small-M", "w8 kernel", "w4 kernel")


def bf16_input(name: str) -> bool:
    return name.startswith("torch")


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (plus one warm-up)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    args = ap.parse_args()
    torch.set_num_threads(2)
    if cpu_linear.load_kernel() is None or cpu_kernels.load_kernel() is None:
        sys.exit("a C++ kernel is not available here (see the warning above)")
    shapes = layer_shapes()
    paths = build_paths(shapes, args.group_size)
    # 512 MB arrays: larger than any cache, as the 120 weights are.
    bandwidth = measure_bandwidth("cpu", num_bytes=512 * 2**20)["sum"]
    print(f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
          f"{len(shapes)} distinct layer products per pass, group size {args.group_size}; "
          f"median of {args.repeats} rounds; memory bandwidth (fp32 sum) "
          f"{bandwidth / 1e9:.1f} GB/s\n")
    gen = torch.Generator().manual_seed(1)
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}
        xs_bf16 = {k: x.bfloat16() for k, x in xs.items()}
        # the three few-row kernels take at most MAX_ROWS rows; above that only the GEMMs run
        run = {name: v for name, v in paths.items()
               if m <= cpu_kernels.MAX_ROWS or name not in FEW_ROW_KERNELS}
        times = {name: [] for name in run}
        for _ in range(args.repeats + 1):  # interleaved, so drift hits all alike; 1st warms up
            for name, (fn, ws, _) in run.items():
                x = xs_bf16 if bf16_input(name) else xs
                t0 = time.perf_counter()
                for (_, k), w in zip(shapes, ws):
                    fn(x[k], w)
                times[name].append(time.perf_counter() - t0)
        print(f"M = {m}: {'ms':>9s}{'MB read':>10s}{'GB/s':>8s}{'of roofline':>13s}")
        for name, (_, _, moved) in run.items():
            sec = statistics.median(times[name][1:])
            print(f"  {name:16s}{sec * 1e3:9.2f}{moved / 1e6:10.0f}{moved / sec / 1e9:8.1f}"
                  f"{moved / sec / bandwidth:12.0%}")
        print()


if __name__ == "__main__":
    main()
