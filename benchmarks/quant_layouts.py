"""Int4 layouts for the GPU kernel: g64 asymmetric (quantize_model's default) against
symmetric layouts with larger groups, in bytes and in quality on SmolLM2.

A 4-bit layer reads its nibbles (0.5 byte a weight) plus, per group of g weights, a scale
and (asymmetric only) a zero point. Larger groups and no zeros read fewer bytes, which is
the whole speed of batch-1 decode; they also round coarser. 128 does not divide SmolLM2's
hidden size 576 (``rtn`` refuses it), but 96 and 192 divide 576 and 1536 (every
projection's input). For each layout this measures, RTN on every projection, LM head kept
float (quantize_model's default):

* bytes: bits per weight as stored (fp16 scales, 8-bit zeros: ``packing.packed_bytes``)
  and as the CUDA kernel reads them (fp32 scales and zeros as held in memory, no zeros
  for a symmetric layer), and the MB a batch-1 step reads as stored (``weight_bytes``);
* quality: the Lab 06 evaluation (``quant.evaluate_many``) on the held-out windows against
  the fp32 model: KL(fp32 ‖ w4), perplexity, top-1 agreement.

    python benchmarks/quant_layouts.py [--eval-windows 12]

CPU work (quantize + evaluate, a few minutes on 2 cores). No timing is recorded here: the
machine is shared, and the layout's *kernel* speed belongs to the GPU (gpu_check's w4a16
rows for g96 / g128 / g192 symmetric). Writes benchmarks/results/quant_layouts.json.
"""
from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minillm  # noqa: E402
from minillm import quant  # noqa: E402
from minillm.devices import device_name  # noqa: E402
from minillm.quant.packing import packed_bytes  # noqa: E402
from minillm.quant.quantize import PROJECTIONS, projections  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

RESULTS = Path(__file__).with_name("results") / "quant_layouts.json"
# (group size, symmetric): today's default first, then the symmetric candidates; g64 sym
# tells the symmetric grid's cost from the group size's, g192 asym the zeros' gain.
LAYOUTS = [(64, False), (64, True), (96, True), (192, True), (192, False)]


def layer_bytes(model, group_size: int, sym: bool) -> dict:
    """Bytes of every projection (the layers' body, LM head excluded) in this layout: as
    stored, and as the CUDA kernel reads them (fp32 scales, fp32 zeros if asymmetric)."""
    weights = params = 0
    for layer in model.layers:
        for name in PROJECTIONS:
            linear = getattr(*projections(layer)[name])
            n, k = linear.out_features, linear.in_features
            weights += packed_bytes(n, k, 4, group_size, sym)
            groups = n * (k // group_size)
            params += n * k // 2 + 4 * groups * (1 if sym else 2)
    numel = sum(getattr(*projections(layer)[name]).weight.numel()
                for layer in model.layers for name in PROJECTIONS)
    return {"stored_bits_per_weight": 8 * weights / numel, "stored_MB": weights / 1e6,
            "gpu_read_bits_per_weight": 8 * params / numel, "gpu_read_MB": params / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-windows", type=int, default=12,
                    help="held-out windows of 512 tokens (the benchmark's full text: 29)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = minillm.load_model(dtype=torch.float32, device="cpu")
    models = {}
    for g, sym in LAYOUTS:
        models[f"w4 g{g} {'sym' if sym else 'asym'}"] = quant.quantize_model(
            model, "rtn", 4, g, sym=sym, progress=False)
    quality = quant.evaluate_many(models, tok, ref_model=model, max_windows=args.eval_windows)
    rows = []
    for (g, sym), (name, qmodel) in zip(LAYOUTS, models.items()):
        q = quality[name]
        rows.append({"layout": name, "group_size": g, "sym": sym, **layer_bytes(model, g, sym),
                     "MB_per_token": quant.weight_bytes(qmodel)["per_token"] / 1e6,
                     "kl": q["kl"], "ppl": q["ppl"], "top1": q["top1"]})
    fp32 = quant.evaluate(model, tok, max_windows=args.eval_windows)
    result = {
        "description": "RTN 4-bit SmolLM2-135M, every projection, LM head float, per layout; "
                       "quality against the fp32 model on the held-out text (Lab 06's "
                       "evaluation); bytes as stored and as the CUDA W4A16 kernel reads them",
        "command": " ".join(["python benchmarks/quant_layouts.py", *(argv or sys.argv[1:])]),
        "machine": {"cpu": device_name("cpu"), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "date": date.today().isoformat()},
        "timings": "not recorded: CPU work on a shared 2-core machine; the layouts' kernel "
                   "speed is measured on the GPU (gpu_check.py --sections w4a16: the g96 / "
                   "g128 / g192 symmetric rows against g64 asymmetric)",
        "eval_windows": args.eval_windows, "eval_tokens": quality[next(iter(quality))]["tokens"],
        "fp32_ppl": fp32["ppl"], "rows": rows}
    write_result(RESULTS, result, argv=None if argv is None else [__file__, *argv])
    print(f"{'layout':14} {'bits/w stored':>13} {'bits/w GPU':>10} {'MB/token':>9} {'KL':>7} "
          f"{'ppl':>7} {'top-1':>6}")
    for r in rows:
        print(f"{r['layout']:14} {r['stored_bits_per_weight']:13.3f} "
              f"{r['gpu_read_bits_per_weight']:10.3f} {r['MB_per_token']:9.1f} {r['kl']:7.4f} "
              f"{r['ppl']:7.2f} {100 * r['top1']:5.1f}%")
    print(f"fp32 ppl {fp32['ppl']:.2f}; {result['eval_tokens']} tokens; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
