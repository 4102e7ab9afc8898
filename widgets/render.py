"""Render the Lab 01-03 widget figures with real measurements of this machine, as PNGs.

    python -m widgets.render                    # measure, then write docs/*.png + JSON
    python -m widgets.render --from-json docs/lab01-measurements.json   # redraw only

Measures the machine (``minillm.perf.measure_machine``), loads SmolLM2-135M, runs
``minillm.measure.measure_operations`` (decode steps at batch 1..64 with a 128-token
context, a prefill, kernels), prints the table with the fraction of the roofline reached,
saves the numbers as JSON next to the figures, and draws each widget's figure once.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from minillm import measure, perf  # noqa: E402

from . import kv_growth, memory_wall, roofline  # noqa: E402
from ._hardware import THIS_MACHINE  # noqa: E402
from ._view import figure_png  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _measure(args):
    import torch

    import minillm

    if args.threads:
        torch.set_num_threads(args.threads)
    profile = perf.measure_machine(refresh=args.refresh)
    t0 = time.perf_counter()
    model, _ = minillm.load_model(dtype=torch.float32)
    print(f"model loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ops = measure.measure_operations(model, context_len=args.context, repeats=args.repeats,
                                     progress=True)
    return profile, ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    ap.add_argument("--from-json", type=Path, help="redraw from saved measurements")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--refresh", action="store_true", help="re-measure the machine profile")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    if args.from_json:
        saved = json.loads(args.from_json.read_text(encoding="utf-8"))
        profile = perf.MachineProfile.from_dict(saved["profile"])
        ops = [measure.OpMeasurement.from_dict(d) for d in saved["operations"]]
        if saved.get("note"):
            print(f"note: {saved['note']}")
    else:
        profile, ops = _measure(args)
        path = args.out / "lab01-measurements.json"
        path.write_text(json.dumps({"profile": profile.to_dict(),
                                    "operations": [op.to_dict() for op in ops]}, indent=1),
                        encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    print(profile)
    print(measure.format_table(ops, profile))

    figures = {
        "roofline.png": roofline.draw_roofline(
            roofline.roofline_data(profile, ops, "H100-SXM", "bf16", highlight_batch=16)),
        "memory_wall.png": memory_wall.draw_memory_wall(
            memory_wall.memory_wall_data("SmolLM2-135M", "fp32", args.context, THIS_MACHINE,
                                         profile, measured=ops, highlight_batch=1)),
        "kv_growth.png": kv_growth.draw_kv_growth(
            kv_growth.kv_growth_data("Llama-3-8B", 8192, 16, "GQA", "fp16", "fp16", "H100-SXM")),
    }
    for name, fig in figures.items():
        (args.out / name).write_bytes(figure_png(fig))
        print(f"wrote {args.out / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
