"""One command that proves the GPU paths: every CUDA path against its reference, measured.

    python benchmarks/gpu_check.py                 # on a CUDA machine (or: make gpu-check)
    python benchmarks/gpu_check.py --quick         # a ~2-minute subset
    python benchmarks/gpu_check.py --cpu-dry-run   # no GPU: every path at tiny sizes on CPU

Sections (each isolated: one that raises is reported with its error and the rest still
run; each has a time box, and what it had no time for is listed as skipped):

    flash_attention   gpu_check_kernels: causal GQA 9:3 and 32:8, D 64/128, T 512..8192,
                      bf16/fp16, against SDPA and float64 (max error, TFLOP/s, ratio)
    paged_decode      gpu_check_kernels: batch 1..256, context 128..8192, against the
                      PyTorch paged reference; GB/s against the measured bandwidth
    varlen            gpu_check_kernels: flash_attention_varlen, same grid, same reference
    w4a16             gpu_check_kernels: the W4A16 matmul against dequantize-then-matmul
    greedy_match      gpu_check_model: SmolLM2 bf16 on CUDA (Triton backend), 64 greedy
                      tokens against the fp32 CPU model (first divergence, logit error)
    decode            gpu_check_model: batch-1 decode eager / compiled against the weights'
                      bandwidth ceiling and transformers on the same GPU
    serving           gpu_check_model: benchmarks/serving.py's workload, engine continuous
                      against HF one-at-a-time and HF static-16 (both sampled)
    pytest            gpu_check_model: the test files of the kernels (Lab 03's scaffold kernel
                      included), speculative decoding and tensor parallelism, with the CUDA
                      device visible (not in --quick)

Without a CUDA device (and without --cpu-dry-run) it prints one line saying so and exits 0.
Exit code otherwise: 1 if any section failed (an error, or a check that did not pass), else
0; a section interrupted by its time box is "timeout" (incomplete: the report says so, and a
second run, with Triton's compiled kernels cached, gets further).

Report (``benchmarks/results/gpu.json``; the dry run writes ``gpu_cpu_dry_run.json``),
schema ``gpu_check_report.SCHEMA`` (checked by ``validate_report`` there)::

    {"schema": "minillm-gpu-check/1", "mode": "cuda" | "cpu-dry-run", "quick": bool,
     "command": str, "ok": bool, "seconds": float,
     "environment": {"device": str, "driver": str | None, "cuda": str | None,
                     "torch": str, "triton": str, "python": str, "date": str, ...},
     "sections": [{"name": str, "title": str,
                   "status": "ok" | "failed" | "timeout" | "skipped",
                   "seconds": float, "budget_s": float, "error": str | None,
                   "rows": [{column: value, ...}, ...],   # a row with "ok": false failed
                   "notes": [str, ...], "skipped": [str, ...]}, ...]}

The Markdown (``gpu_check_report.to_markdown``) goes under "Measured on a GPU" in
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gpu_check_report import SCHEMA, fmt, summary, to_markdown, validate_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NO_GPU_LINE = ("gpu_check: no CUDA device (torch.cuda.is_available() is False), so nothing "
               "was checked; run it on a GPU machine (make gpu-check), or add --cpu-dry-run "
               "to exercise the script on CPU at tiny sizes")
TOTAL_BUDGET_S = {"full": 550.0, "quick": 115.0, "dry": 600.0}
GRACE_S = 30.0  # past its budget a section is interrupted (SIGALRM), not just told to stop


@dataclass
class Section:
    name: str
    title: str
    fn: Callable[["Run"], None]
    budget_s: dict  # {"full": s, "quick": s, "dry": s}; a missing mode skips the section


class SectionTimeout(Exception):
    pass


@dataclass
class Run:
    """What a section sees: the mode, its device and sizes, its time box, and its output."""
    mode: str                      # "full", "quick" or "dry"
    device: torch.device
    env: dict
    deadline: float                # time.monotonic() by which the section must stop
    options: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    @property
    def dry(self) -> bool:
        return self.mode == "dry"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, full, quick, dry):
        """The size for this mode."""
        return {"full": full, "quick": quick, "dry": dry}[self.mode]

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def case(self, label: str, fn: Callable[[], dict]) -> None:
        """Run one case into a row (its columns say what the case was; `label` names it only
        in a skip or an error): an error fails the row, not the section. A case that would
        start with no time left is recorded as skipped instead."""
        if self.time_left() <= 0:
            self.skipped.append(f"{label} (time box)")
            return
        try:
            row = fn()
        except SectionTimeout:
            raise
        except Exception as e:  # noqa: BLE001  (reported in the row, the run goes on)
            row = {"case": label, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
        print("   ", _row_line(row), flush=True)
        self.rows.append(row)
        if self.cuda:
            torch.cuda.empty_cache()


def _row_line(row: dict) -> str:
    return ", ".join(f"{k}={fmt(v)}" for k, v in row.items())


def _alarm(signum, frame):
    raise SectionTimeout("the section ran past its time box")


def run_sections(sections: list[Section], mode: str, device: torch.device, env: dict,
                 options: dict | None = None, total_budget_s: float | None = None,
                 grace_s: float = GRACE_S) -> list[dict]:
    """Run each section in turn, isolated and time-boxed; return their report entries.

    A section is told its deadline (``Run.case`` skips what would start after it) and is
    interrupted by SIGALRM ``grace_s`` after it (a runaway case: on a first GPU run, most
    often Triton autotuning, which compiles every tile configuration). Status: "failed" if
    the section raised or a row has ``ok: false``; else "timeout" if it was interrupted
    (incomplete, not a failed check: run again); else "ok"."""
    end = time.monotonic() + (TOTAL_BUDGET_S[mode] if total_budget_s is None else total_budget_s)
    out = []
    for s in sections:
        budget = min(s.budget_s.get(mode, 0.0), max(0.0, end - time.monotonic()))
        entry = {"name": s.name, "title": s.title, "status": "ok", "seconds": 0.0,
                 "budget_s": round(budget, 1), "error": None, "rows": [], "notes": [],
                 "skipped": []}
        if budget <= 0:
            why = "not part of this mode" if mode not in s.budget_s else "no time left"
            entry.update(status="skipped", notes=[f"skipped: {why}"])
            out.append(entry)
            continue
        print(f"\n== {s.title} (time box {budget:.0f} s)", flush=True)
        run = Run(mode, device, env, time.monotonic() + budget, dict(options or {}))
        t0 = time.monotonic()
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, budget + grace_s)
        timed_out = False
        try:
            s.fn(run)
        except SectionTimeout:  # rows so far stand; the case in progress is lost
            timed_out = True
            run.skipped.append(f"the case in progress at {budget + grace_s:.0f} s and every "
                               "later one (interrupted by the time box)")
        except Exception as e:  # noqa: BLE001  (a failing section must not stop the others)
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(entry["traceback"], file=sys.stderr, flush=True)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        entry.update(seconds=round(time.monotonic() - t0, 1), rows=run.rows, notes=run.notes,
                     skipped=run.skipped)
        if entry["error"] or any(r.get("ok") is False for r in run.rows):
            entry["status"] = "failed"
        elif timed_out:
            entry["status"] = "timeout"
        print(f"== {s.name}: {entry['status']} in {entry['seconds']} s"
              + (f", skipped {len(run.skipped)}" if run.skipped else ""), flush=True)
        out.append(entry)
    return out


# ----------------------------------------------------------------------------- environment


def _nvidia_smi(query: str) -> str | None:
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(device: torch.device, mode: str) -> dict:
    """Versions, the device, and its measured bandwidth and bf16 matmul rate."""
    import triton

    from minillm.devices import device_name
    from minillm.perf import measure_bandwidth, measure_matmul_flops

    env = {"device": device_name(device), "driver": None, "cuda": torch.version.cuda,
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                      time.gmtime())}
    if device.type == "cuda":
        from attention import gpu_peaks  # noqa: PLC0415  (the spec-sheet table lives there)

        props = torch.cuda.get_device_properties(device)
        peak_tflops, peak_gbs = gpu_peaks()
        env.update(driver=_nvidia_smi("driver_version"), gpu_count=torch.cuda.device_count(),
                   capability=f"{props.major}.{props.minor}", memory_GiB=round(
                       props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                   spec_peak_bf16_TFLOPs=peak_tflops, spec_peak_GBps=peak_gbs)
        bw = max(measure_bandwidth(device).values())
        flops = measure_matmul_flops(device, torch.bfloat16)
    else:
        env.update(threads=torch.get_num_threads())
        bw = max(measure_bandwidth(device, num_bytes=32 * 2**20, repeats=3).values())
        flops = measure_matmul_flops(device, torch.float32, n=512, repeats=3)
    env.update(bandwidth_GBps=round(bw / 1e9, 1), matmul_TFLOPs=round(flops / 1e12, 3))
    return env


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~2-minute subset")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU needed: run every path on CPU at tiny sizes (not GPU numbers)")
    ap.add_argument("--sections", help="comma-separated section names to run (default: all)")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the torch.compile rows (their first call compiles for minutes)")
    ap.add_argument("--out", type=Path, help="the JSON report (default: benchmarks/results/"
                    "gpu.json, or gpu_cpu_dry_run.json for a dry run)")
    ap.add_argument("--markdown", type=Path, help="also write the Markdown table here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(NO_GPU_LINE)
        return 0

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import minillm.kernels  # noqa: F401  (before transformers: sets TRITON_INTERPRET on CPU)
    # The section modules import Section from `gpu_check`: run as a script this module is
    # `__main__`, and must not be imported a second time under its own name.
    sys.modules.setdefault("gpu_check", sys.modules[__name__])
    import gpu_check_kernels
    import gpu_check_model

    sections = gpu_check_kernels.SECTIONS + gpu_check_model.SECTIONS
    if args.sections:
        wanted = args.sections.split(",")
        unknown = sorted(set(wanted) - {s.name for s in sections})
        if unknown:
            ap.error(f"unknown section(s) {unknown}; choose from {[s.name for s in sections]}")
        sections = [s for s in sections if s.name in wanted]
    dry = args.cpu_dry_run
    device = torch.device("cpu" if dry else "cuda")
    mode = "dry" if dry else ("quick" if args.quick else "full")
    t0 = time.monotonic()
    env = environment(device, mode)
    print("environment:", json.dumps(env), flush=True)
    entries = run_sections(sections, mode, device, env, {"compile": not args.no_compile})
    report = {"schema": SCHEMA, "mode": "cpu-dry-run" if dry else "cuda", "quick": mode == "quick",
              "command": shlex.join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
              "ok": all(e["status"] != "failed" for e in entries),
              "seconds": round(time.monotonic() - t0, 1), "environment": env, "sections": entries}
    validate_report(report)
    out = args.out or RESULTS / ("gpu_cpu_dry_run.json" if dry else "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = to_markdown(report)
    if args.markdown:
        args.markdown.write_text(md)
    print("\n" + md)
    print(f"wrote {out}; {summary(report)}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
