"""One command that proves the GPU paths: every CUDA path against its reference, measured.

    python benchmarks/gpu_check.py                 # on a CUDA machine (or: make gpu-check)
    python benchmarks/gpu_check.py --quick         # a subset, under 3 minutes
    python benchmarks/gpu_check.py --cpu-dry-run   # no GPU: every path at tiny sizes on CPU
    python benchmarks/gpu_check.py --autotune      # re-measure the kernels' tile configs:
                                                   #   <out>.tuned.json, for pin_configs.py
    python benchmarks/gpu_check.py --sections gemv_tiles,decode  # the decode GEMV's tiles
                                                   #   measured, then decode with the fastest
                                                   #   (<out>.tuned.json as well)
    python benchmarks/gpu_check.py --sections w4a16_tiles  # the W4A16 GEMV's, likewise
    python benchmarks/gpu_check.py --random-weights  # model sections without the GGUF

Sections (each isolated: one that raises is reported with its error and the rest still
run; each has a time box, and what it had no time for is listed as skipped):

    flash_attention   gpu_check_kernels: causal, bf16, D 64/128 x GQA 9:3/32:8 x T 512..8192,
                      and fp16 at T 2048, against SDPA and float64 (max error, TFLOP/s, ratio)
    paged_decode      gpu_check_kernels: batch 1..256, context 128..8192, against the
                      PyTorch paged reference; GB/s against the measured bandwidth
    varlen            gpu_check_kernels: flash_attention_varlen, batch 1..256, same reference
    w4a16             gpu_check_kernels: the W4A16 matmul against a dense bf16 matmul,
                      SmolLM2's and an 8B model's shapes at M = 1 and 16 (int4 GB/s), the
                      GEMM at M = 256 / 1024 against dequantize-then-matmul, larger groups
    greedy_match      gpu_check_model: SmolLM2 bf16 on CUDA (Triton backend), 64 greedy
                      tokens against the fp32 CPU model (first divergence, logit error)
    decode            gpu_check_model: batch-1 decode eager / compiled against the weights'
                      bandwidth ceiling and transformers on the same GPU; where a step's time
                      goes (the graph rows' kernels, the eager row's host functions)
    serving           gpu_check_model: benchmarks/serving.py's workload, engine continuous
                      against HF one-at-a-time and HF static-16 (both sampled), and against
                      itself with 2048-token steps (the old budget); the engine's decode step,
                      graph and eager, and where the batch-64 step's time goes
    decode_gemv       gpu_check_kernels: the decode GEMV (glue fused into the product)
                      against glue + cuBLAS / the W4A16 kernel, SmolLM2's products
    gemv_tiles        gpu_check_kernels: the decode GEMV's tiles, 107 candidates at M = 1
                      against the pinned ones, w4 first; each product's fastest is kept for
                      the sections after it (run before the model sections) and written to
                      <out>.tuned.json. Only when asked (--sections gemv_tiles), outside the
                      8 minutes
    w4a16_tiles       gpu_check_kernels: the W4A16 kernel's tiles at M = 1 and 16, its 40
                      and 31 candidates at each of the w4a16 section's four shapes, timed
                      over weights larger than L2; kept and written like gemv_tiles'. Only
                      when asked
    pytest            gpu_check_model: the test files of the kernels (Lab 03's scaffold kernel
                      included), speculative decoding and tensor parallelism, with the CUDA
                      device visible, all at once (not in --quick)
    compiled_wall     gpu_check_model: Lab 01's q9 on the device, the compiled step (no
                      graph) counted, priced and timed against its launch wall, launches
                      from the compiled code at their own measured cost. Only when asked
                      (--sections compiled_wall): compiling SmolLM2 takes ~25 s
    labs              gpu_check_labs: every solution notebook under nbval on the device,
                      MINILLM_QUICK=1, one process and a 5-minute box each (--lab-parallel
                      N runs N at once); pass/fail and seconds per lab. Only when asked
                      (--sections labs, or --labs 01,05): not in --quick, nor in a plain
                      full run (its budget is its own, or --lab-budget)

Time: the full run fits in 8 minutes on one GPU, models included: the sections' time boxes
sum to TOTAL_BUDGET_S (420 s: kernels 111, models 309, each box sized from what that section
took on an H100 on a fresh machine, with nothing cut), and START_UP_S (60 s) is left for the
machine's start, the copies and each process's start and environment measurement;
--quick in 3 minutes. The plan assumes the kernels' pinned tile configurations (a first
call of a new shape compiles one configuration); a first run with --autotune measures
every configuration instead and may hit the time boxes. The log gives every row's seconds,
and a section cut by its box names the case it cut and how long that had run.

Without a CUDA device (and without --cpu-dry-run) it prints one line saying so and exits 0.
Exit code otherwise: 1 if any section failed (an error, or a check that did not pass), else
0; a section interrupted by its time box is "timeout" (incomplete: the report says so, and a
second run, with Triton's compiled kernels cached, gets further). SIGTERM or SIGINT stops
the run: the section in progress keeps its rows ("timeout"), the report is written, and the
exit code is 128 + the signal's number.

Report (``benchmarks/results/gpu.json``; the dry run writes ``gpu_cpu_dry_run.json``),
schema ``gpu_check_report.SCHEMA`` (checked by ``validate_report`` there), rewritten
atomically after every section and every row (with ``--markdown``, the Markdown too), so a
run cut from outside, even by SIGKILL, leaves a valid report of what it measured (a section
cut in the middle is "timeout", with the rows it finished)::

    {"schema": "minillm-gpu-check/1", "mode": "cuda" | "cpu-dry-run", "quick": bool,
     "command": str, "ok": bool, "finished": bool, "seconds": float,
     "environment": {"device": str, "driver": str | None, "cuda": str | None,
                     "torch": str, "triton": str, "python": str, "date": str, ...},
     "sections": [{"name": str, "title": str,
                   "status": "ok" | "failed" | "timeout" | "skipped",
                   "seconds": float, "budget_s": float, "error": str | None,
                   "rows": [{column: value, ...}, ...],   # a row with "ok": false failed
                   # a row may carry "breakdown": {part name: part} (step_breakdown.py)
                   "notes": [str, ...], "skipped": [str, ...]}, ...]}

``finished`` is false until the last section is done; until then the sections not yet run
are listed as skipped, "not reached". The Markdown (``gpu_check_report.to_markdown``) goes
under "Measured on a GPU" in BENCHMARKS.md.

Nothing here imports the serving stack (FastAPI, uvicorn, prometheus_client): a GPU image
with torch and triton needs only the packages listed in the README's "Running on a GPU".
"""
from __future__ import annotations

import argparse
import json
import os
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

from gpu_check_report import (BREAKDOWN, SCHEMA, START_UP_S, fmt, summary, to_markdown,
                              validate_report)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NO_GPU_LINE = ("gpu_check: no CUDA device (torch.cuda.is_available() is False), so nothing "
               "was checked; run it on a GPU machine (make gpu-check), or add --cpu-dry-run "
               "to exercise the script on CPU at tiny sizes")
# The sections' time boxes sum to these (full: kernels 111 s, models 309 s; quick: 41 + 102).
# With START_UP_S the full run is 8 minutes (issue 25), the quick one 3 with GRACE_S too.
TOTAL_BUDGET_S = {"full": 420.0, "quick": 145.0, "dry": 600.0}
# --autotune times every candidate of each new bucket (a compile of ~1 s each): its time
# boxes are this many times the planned ones.
AUTOTUNE_BUDGET_SCALE = 4.0
GRACE_S = 15.0  # past its budget a section is interrupted (SIGALRM), not just told to stop


@dataclass
class Section:
    name: str
    title: str
    fn: Callable[["Run"], None]
    budget_s: dict  # {"full": s, "quick": s, "dry": s}; a missing mode skips the section


class SectionTimeout(BaseException):
    """A section's time box ran out (SIGALRM). A BaseException: code under test that turns
    an Exception into a fallback (piecewise graphs, the decode GEMV) or rewraps it
    (Dynamo) must not swallow the cut; `Run.case` re-raises it."""


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
    # (label, time.monotonic() at its start) of the case in progress: a section cut by its
    # time box names it, and how long it had run, so that the next plan can size the box.
    current: tuple | None = None
    # Set by a section that stopped cases itself at its deadline (concurrent cases, cut and
    # listed as skipped): its status is then "timeout" (incomplete), as if interrupted.
    incomplete: bool = False
    # Called after every row (run_sections sets it): rewrites the report with the rows so
    # far, so that a run killed in the middle of a long section (SIGKILL: no handler runs)
    # still has every case that finished.
    on_row: Callable[[], None] | None = None

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
        self.current = (label, time.monotonic())
        try:
            row = fn()
        except SectionTimeout:
            raise
        except Exception as e:  # noqa: BLE001  (reported in the row, the run goes on)
            row = {"case": label, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
        seconds, self.current = time.monotonic() - self.current[1], None
        self.add_row(row, seconds)
        if self.cuda:
            torch.cuda.empty_cache()

    def add_row(self, row: dict, seconds: float) -> None:
        """Record a finished case's row (``case`` does; a section that runs its cases
        concurrently calls it as each one ends) and rewrite the report with it."""
        # The log (not the report) says how long each case took: what a box is planned from.
        print(f"    [{seconds:5.1f} s]", _row_line(row), flush=True)
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row()


def _in_progress(run: Run) -> str:
    """' (<label>, running for N s)' for the case a cut fell in, or '' between cases."""
    if run.current is None:
        return ""
    label, start = run.current
    return f" ({label}, running for {time.monotonic() - start:.0f} s)"


def _row_line(row: dict) -> str:
    """A row in the log: its columns; of a breakdown, its parts' seconds (the tables are in
    the report)."""
    return ", ".join(f"{k}={_breakdown_seconds(v) if k == BREAKDOWN else fmt(v)}"
                     for k, v in row.items())


def _breakdown_seconds(parts: dict) -> str:
    return "; ".join(f"{name} " + ("failed" if p.get("error") else f"{p.get('seconds')} s")
                     for name, p in parts.items())


def _alarm(signum, frame):
    raise SectionTimeout("the section ran past its time box")


class RunInterrupted(BaseException):
    """SIGTERM or SIGINT arrived: the run stops, keeping what it measured. A BaseException,
    so that no section's ``except Exception`` swallows it. ``entry``: the section it cut."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name, self.entry = signum, signal.Signals(signum).name, None


def _interrupt(signum, frame):
    raise RunInterrupted(signum)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _skipped_entry(s: Section, why: str) -> dict:
    return {"name": s.name, "title": s.title, "status": "skipped", "seconds": 0.0,
            "budget_s": 0.0, "error": None, "rows": [],
            "notes": [f"skipped: {why}"], "skipped": []}


NOT_REACHED = ("not reached: the run was still going when this report was written, or was "
               "cut from outside before this section")


def _with_signals_blocked(fn, *args) -> None:
    """Run fn with SIGTERM / SIGINT held back (a report being written is not cut half-way);
    one that arrived meanwhile is delivered right after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        fn(*args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


IN_PROGRESS = ("in progress when this report was written: the run was still going, or was "
               "cut from outside (the rows are the cases that had finished)")


def _entry_so_far(s: Section, run: Run, budget: float, t0: float) -> dict:
    """The entry of a section still running: its rows so far, "failed" if one failed, else
    "timeout" (incomplete)."""
    failed = any(r.get("ok") is False for r in run.rows)
    return {"name": s.name, "title": s.title, "status": "failed" if failed else "timeout",
            "seconds": round(time.monotonic() - t0, 1), "budget_s": round(budget, 1),
            "error": None, "rows": list(run.rows), "notes": list(run.notes),
            "skipped": [*run.skipped, IN_PROGRESS]}


def run_section(s: Section, mode: str, device: torch.device, env: dict, options: dict,
                budget: float, grace_s: float, on_partial=None) -> dict:
    """One section, isolated and time-boxed (see ``run_sections``): its report entry. On
    RunInterrupted the entry, with the rows so far, rides on the exception.
    ``on_partial(entry)``, if given, gets the entry so far after every row."""
    entry = {"name": s.name, "title": s.title, "status": "ok", "seconds": 0.0,
             "budget_s": round(budget, 1), "error": None, "rows": [], "notes": [],
             "skipped": []}
    print(f"\n== {s.title} (time box {budget:.0f} s)", flush=True)
    run = Run(mode, device, env, time.monotonic() + budget, dict(options))
    t0 = time.monotonic()
    if on_partial is not None:
        run.on_row = lambda: on_partial(_entry_so_far(s, run, budget, t0))
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, budget + grace_s)
    timed_out, interrupted = False, None
    try:
        s.fn(run)
    except SectionTimeout:  # rows so far stand; the case in progress is lost
        timed_out = True
        run.skipped.append(f"the case in progress at {budget + grace_s:.0f} s{_in_progress(run)}"
                           " and every later one (interrupted by the time box)")
    except RunInterrupted as e:  # the same, cut from outside
        interrupted = e
        run.skipped.append(f"the case in progress at {time.monotonic() - t0:.0f} s"
                           f"{_in_progress(run)} and every later one (the run was interrupted "
                           f"by {e.name})")
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
    elif timed_out or interrupted or run.incomplete:
        entry["status"] = "timeout"
    print(f"== {s.name}: {entry['status']} in {entry['seconds']} s"
          + (f", skipped {len(run.skipped)}" if run.skipped else ""), flush=True)
    if interrupted:
        interrupted.entry = entry
        raise interrupted
    return entry


def run_sections(sections: list[Section], mode: str, device: torch.device, env: dict,
                 options: dict | None = None, total_budget_s: float | None = None,
                 grace_s: float = GRACE_S, on_progress=None,
                 budget_scale: float = 1.0, rows_too: bool = False) -> list[dict]:
    """Run each section in turn, isolated and time-boxed; return their report entries.

    A section is told its deadline (``Run.case`` skips what would start after it) and is
    interrupted by SIGALRM ``grace_s`` after it (a runaway case: on a first GPU run, most
    often Triton compiling a kernel). Status: "failed" if the section raised or a row has
    ``ok: false``; else "timeout" if it was interrupted (incomplete, not a failed check: run
    again); else "ok".

    ``on_progress(entries)`` is called after every section with the entries so far plus one
    "skipped" entry (``NOT_REACHED``) per section still to come, so a report written there is
    complete and valid at every point; with ``rows_too``, also after every row, with the
    section in progress as it stands (``IN_PROGRESS``: "timeout", or "failed" if a row
    failed). SIGTERM and SIGINT stop the run: the section in
    progress keeps its rows (status "timeout"), the rest are skipped, ``on_progress`` gets
    the final entries, and ``RunInterrupted`` is raised to the caller."""
    total = TOTAL_BUDGET_S[mode] if total_budget_s is None else total_budget_s
    end = time.monotonic() + total * budget_scale
    out: list[dict] = []
    handlers = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        for i, s in enumerate(sections):
            budget = min(s.budget_s.get(mode, 0.0) * budget_scale,
                         max(0.0, end - time.monotonic()))
            rest = [_skipped_entry(t, NOT_REACHED) for t in sections[i + 1:]]
            if budget <= 0:
                why = "not part of this mode" if mode not in s.budget_s else "no time left"
                out.append(_skipped_entry(s, why))
            else:
                partial = None if on_progress is None or not rows_too else (
                    lambda entry, rest=rest: _with_signals_blocked(on_progress,
                                                                   out + [entry] + rest))
                out.append(run_section(s, mode, device, env, options or {}, budget, grace_s,
                                       on_partial=partial))
            if on_progress is not None:
                _with_signals_blocked(on_progress, out + rest)
    except RunInterrupted as e:
        if e.entry is not None:
            out.append(e.entry)
        out += [_skipped_entry(t, f"the run was interrupted by {e.name} before it")
                for t in sections[len(out):]]
        if on_progress is not None:
            _with_signals_blocked(on_progress, out)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
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
    from minillm.kernels import tuning  # configs an earlier process measured, if given

    if os.environ.get("MINILLM_TUNED"):
        env.update(tuned=os.environ["MINILLM_TUNED"], tuned_configs=len(tuning.measured()))
    return env


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset, under 3 minutes")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU needed: run every path on CPU at tiny sizes (not GPU numbers)")
    ap.add_argument("--sections", help="comma-separated section names to run (default: all)")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the torch.compile rows (their first call compiles for minutes)")
    ap.add_argument("--out", type=Path, help="the JSON report (default: benchmarks/results/"
                    "gpu.json, or gpu_cpu_dry_run.json for a dry run)")
    ap.add_argument("--markdown", type=Path, help="also write the Markdown table here")
    ap.add_argument("--autotune", action="store_true",
                    help="time every tile config of each new kernel bucket (instead of the "
                    "pinned ones) and write the best to <out>.tuned.json, for "
                    "benchmarks/pin_configs.py --merge")
    ap.add_argument("--decode-rows", help="only these rows of the decode section, comma-"
                    "separated labels (eager, CUDA graph, CUDA graph of the compiled step, "
                    "compiled, w4 eager, w4 CUDA graph); default: all")
    ap.add_argument("--backends", default="triton,torch",
                    help="attention backends of the decode section's rows (default: both)")
    ap.add_argument("--labs", help="the labs section's notebooks, e.g. 01,05 or 'all' (this "
                    "also adds the section; default with --sections labs: all)")
    ap.add_argument("--lab-timeout", type=float, default=None,
                    help="seconds per lab in the labs section (default 300)")
    ap.add_argument("--lab-parallel", type=int, default=1,
                    help="labs run at once in the labs section (default 1: one at a time, "
                    "so that their seconds are clean; more share the GPU and the cores)")
    ap.add_argument("--lab-budget", type=float, default=None,
                    help="the labs section's time box in seconds (default: a --lab-timeout "
                    "box per wave of --lab-parallel labs, plus 30 s); labs it cuts are "
                    "listed as skipped")
    ap.add_argument("--random-weights", action="store_true",
                    help="model sections on SmolLM2's shapes with random weights (no GGUF "
                    "needed; speeds and graph-vs-eager checks hold, quality rows mean nothing)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(NO_GPU_LINE)
        return 0

    if not args.cpu_dry_run:
        # greedy_match's fp32 CPU reference takes PyTorch's path: building the C++ CPU
        # kernels on a fresh machine would spend minutes of the time boxes (set
        # MINILLM_CPU_KERNEL=1 to use them anyway; the results agree to rounding).
        os.environ.setdefault("MINILLM_CPU_KERNEL", "0")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import minillm.kernels  # noqa: F401  (before transformers: sets TRITON_INTERPRET on CPU)
    from minillm.kernels import tuning
    if args.autotune:
        tuning.set_autotune(True)
    # The section modules import Section from `gpu_check`: run as a script this module is
    # `__main__`, and must not be imported a second time under its own name.
    sys.modules.setdefault("gpu_check", sys.modules[__name__])
    import gpu_check_kernels
    import gpu_check_labs
    import gpu_check_model

    labs = None if args.labs in (None, "all") else args.labs.split(",")
    lab_box = args.lab_timeout or gpu_check_labs.LAB_BOX_S
    if args.lab_parallel < 1:
        ap.error(f"--lab-parallel must be at least 1 (labs at once), got {args.lab_parallel}")
    try:
        labs_section = gpu_check_labs.section(labs, lab_box, parallel=args.lab_parallel,
                                              budget_s=args.lab_budget)
    except ValueError as e:
        ap.error(str(e))
    asked_only = gpu_check_kernels.ASKED_ONLY + gpu_check_model.ASKED_ONLY + [labs_section]
    sections = all_sections(labs_section)
    if not args.sections:  # these run only when asked (the labs: by --labs too)
        sections = [s for s in sections if s not in asked_only
                    or (s is labs_section and args.labs is not None)]
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
    if not dry:  # before any CUDA graph is captured: the model sections profile theirs
        import step_breakdown
        step_breakdown.init_profiler_for_cuda_graphs()
    env = environment(device, mode)
    print("environment:", json.dumps(env), flush=True)
    out = args.out or RESULTS / ("gpu_cpu_dry_run.json" if dry else "gpu.json")
    command = shlex.join(["python", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])])

    def report_of(entries: list[dict], finished: bool) -> dict:
        return {"schema": SCHEMA, "mode": "cpu-dry-run" if dry else "cuda",
                "quick": mode == "quick", "command": command,
                "ok": all(e["status"] != "failed" for e in entries), "finished": finished,
                "seconds": round(time.monotonic() - t0, 1), "environment": env,
                "sections": entries}

    tuned = out.with_name(out.stem + ".tuned.json")

    def wants_tuned() -> bool:  # autotuning, or configs measured otherwise (the *_tiles)
        return bool(args.autotune or tuning.autotune_requested() or tuning.measured())

    def progress(entries: list[dict]) -> None:
        write_report(report_of(entries, False), out, args.markdown)
        if wants_tuned():  # a cut run keeps them too
            write_tuned(tuned, env)

    write_report(report_of([_skipped_entry(s, NOT_REACHED) for s in sections], False), out,
                 args.markdown)
    options = {"compile": not args.no_compile, "random_weights": args.random_weights,
               "decode_rows": args.decode_rows.split(",") if args.decode_rows else None,
               "backends": args.backends.split(","), "labs": labs, "lab_timeout_s": lab_box,
               "lab_parallel": args.lab_parallel}
    # The sections run only when asked (the labs, the *_tiles) bring their own budgets on top
    # of the other sections'.
    total = TOTAL_BUDGET_S[mode] + sum(s.budget_s.get(mode, 0.0) for s in asked_only
                                       if s in sections)
    try:
        entries = run_sections(sections, mode, device, env, options, total_budget_s=total,
                               on_progress=progress, rows_too=True,
                               budget_scale=AUTOTUNE_BUDGET_SCALE if args.autotune else 1.0)
    except RunInterrupted as e:  # run_sections wrote what was measured
        print(f"\ninterrupted by {e.name}: wrote {out}", flush=True)
        return 128 + e.signum
    report = report_of(entries, True)
    md = write_report(report, out, args.markdown)
    if wants_tuned():
        print(f"wrote {write_tuned(tuned, env)} ({len(tuning.measured())} tuned buckets)")
    print("\n" + md)
    print(f"wrote {out}; {summary(report)}")
    return 0 if report["ok"] else 1


def all_sections(labs_section: Section) -> list[Section]:
    """Every section in the order a run takes them: the kernels', gemv_tiles (before the
    model sections, so that decode launches the tiles it measured), the models', the labs."""
    import gpu_check_kernels
    import gpu_check_model

    return (gpu_check_kernels.SECTIONS + gpu_check_kernels.ASKED_ONLY
            + gpu_check_model.SECTIONS + gpu_check_model.ASKED_ONLY + [labs_section])


def write_tuned(path: Path, env: dict) -> Path:
    """The tile configs this run's autotuning chose, for benchmarks/pin_configs.py --merge."""
    from minillm.kernels import tuning

    source = (f"{env['device']}, {env['date'][:10]}, torch {env['torch']}, "
              f"triton {env['triton']}")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"source": source, "measured": tuning.measured()}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def write_report(report: dict, out: Path, markdown: Path | None) -> str:
    """Validate the report and write it (and its Markdown) atomically: a reader, or a run
    cut at any moment, sees the previous complete file or the new one. Returns the Markdown."""
    validate_report(report)
    md = to_markdown(report)
    for path, text in ((out, json.dumps(report, indent=1, default=str) + "\n"), (markdown, md)):
        if path is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return md

if __name__ == "__main__":
    sys.exit(main())
