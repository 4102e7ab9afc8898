"""Run the solution notebooks top to bottom on this machine and record how long each took in
``widgets/lab_runtimes.json``, which every lab's first cell prints (``widgets.lab_header``).

    python benchmarks/lab_runtimes.py --record [--note "nothing else running"] [01 09 ...]
    python benchmarks/lab_runtimes.py --inplace [01 09 ...]
    python benchmarks/lab_runtimes.py --from-report labs.json [01 09 ...]

``--record`` times each lab (the executed copy goes to a temporary folder) and writes its
seconds under the kind of device it ran on. Both modes print, for every lab, each kept
prediction marked against the measurement of that run (a line from ``quizzes.show``), so
that a prediction that fails on this machine is seen before anything is committed.
``--inplace`` saves the executed notebook over the solution, so that its outputs are this
run's; it records nothing, because a lab's first cell prints the times recorded before it
ran. Refreshing both is therefore two passes:
``--record`` first, then ``--inplace``, on a quiet machine (every lab measures timings).

``--from-report`` records, without running anything, what a GPU check's labs section
measured (``gpu_check.py --sections labs``; the offline session's part3 writes it as
``labs.json``): each lab that passed gets its ``quick_seconds`` under "GPU", with the GPU's
name, how many labs ran beside it (part3 runs five at a time: then the seconds are those of
a shared GPU, an upper bound of a lab alone, and the name says so) and the report's date. A
lab that failed or was cut is named and not recorded; a CPU report (the dry run) is refused.

Invariants: each lab runs in a fresh kernel with ``QUIZZES_ANSWERS=off`` (no answer is
written into the outputs) and ``MINILLM_QUICK`` unset; a lab that raises stops the script
with its error, and nothing of that lab is recorded or saved.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from minillm import devices  # noqa: E402
from gpu_check_labs import notebooks  # noqa: E402
from widgets.lab_header import RUNTIMES  # noqa: E402


# Appended to the run, then removed: each of the lab's predictions marked in the lab's kernel.
MARK_CELL = """
from quizzes import predictions as _predictions, questions as _questions
for _qid, _q in _questions.load_bank({bank!r}).questions.items():
    if getattr(_q, "predict", False):
        print(f"{bank}.{{_qid}}:", _predictions.mark_prediction(f"{bank}.{{_qid}}").message)
"""


def execute(path: Path, out: Path, timeout_s: int) -> tuple[float, str]:
    """Run ``path`` in a fresh kernel and write the executed notebook to ``out``; return
    (seconds taken, the lines marking its predictions)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(MARK_CELL.format(bank=f"lab{path.stem[:2]}")))
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t0
    marks = "".join(o.get("text", "") for o in nb.cells.pop().outputs)
    nbformat.write(nb, out)
    return seconds, marks


def from_report(report: dict, table: dict, labs: list[str] | None = None) -> list[str]:
    """Put the labs section of a gpu_check report into ``table`` (lab_runtimes.json's
    contents) under "GPU" (``labs``: only these stems); returns one line per lab, recorded
    or why not. Raises ValueError for a report that holds no GPU measurement of labs."""
    env = report.get("environment") or {}
    if not env.get("cuda") or report.get("mode") == "cpu-dry-run":
        raise ValueError(f"the report was not measured on a GPU (device {env.get('device')!r}, "
                         f"mode {report.get('mode')!r}): only a GPU check's labs are recorded")
    section = next((s for s in report.get("sections", []) if s.get("name") == "labs"), None)
    if section is None:
        raise ValueError("the report has no labs section: run gpu_check.py --sections labs "
                         "(the offline session's part3)")
    date, lines = str(env.get("date", ""))[:10], []
    for row in section.get("rows", []):
        lab = row.get("lab")
        if labs and lab not in labs:
            continue
        if row.get("ok") is not True:
            lines.append(f"{lab}: not recorded ({row.get('outcome', 'failed')}"
                         f"{': ' + row['error'] if row.get('error') else ''})")
            continue
        beside = int(row.get("alongside") or 0)
        name = env["device"] + (f", {beside + 1} labs at once" if beside else "")
        entry = {"quick_seconds": round(row["seconds"]), "device_name": name, "date": date}
        old = (table.setdefault(lab, {"CPU": None, "GPU": None}).get("GPU") or {})
        if old.get("device_name") == name and old.get("date") == date and "seconds" in old:
            entry["seconds"] = old["seconds"]  # a full run of the same machine and day stays
        table[lab]["GPU"] = entry
        lines.append(f"{lab}: {entry['quick_seconds']} s with MINILLM_QUICK=1 on {name}")
    for skipped in section.get("skipped", []):  # "<lab> (why)": cut or never started
        lab, _, why = skipped.partition(" ")
        if not labs or lab in labs:
            lines.append(f"{lab}: not recorded {why}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true", help="time each lab; write lab_runtimes.json")
    mode.add_argument("--inplace", action="store_true", help="save the executed notebooks over the solutions")
    mode.add_argument("--from-report", type=Path, metavar="FILE",
                      help="record a GPU check's labs section (part3's labs.json); runs nothing")
    ap.add_argument("--note", default="", help="appended to the device name, e.g. 'nothing else running'")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    ap.add_argument("labs", nargs="*", help="lab numbers or names (default: all)")
    args = ap.parse_args(argv)
    try:
        labs = notebooks(args.labs)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.from_report:
        table = json.loads(RUNTIMES.read_text(encoding="utf-8"))
        try:
            report = json.loads(args.from_report.read_text(encoding="utf-8"))
            lines = from_report(report, table, [p.stem for p in labs] if args.labs else None)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {args.from_report}: {exc}") from None
        RUNTIMES.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print("\n".join(lines))
        return

    os.environ["QUIZZES_ANSWERS"] = "off"
    os.environ.pop("MINILLM_QUICK", None)
    kind = "GPU" if devices.is_cuda(devices.default_device()) else "CPU"
    name = devices.device_name(devices.default_device())
    if kind == "CPU":
        name = f"{name}, {torch.get_num_threads()} threads"
    if args.note:
        name = f"{name}, {args.note}"
    table = json.loads(RUNTIMES.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        for path in labs:
            out = path if args.inplace else Path(tmp) / path.name
            seconds, marks = execute(path, out, args.timeout)
            print(f"{path.stem}: {seconds:.0f} s on {name}\n{marks}", flush=True)
            if args.record:
                table.setdefault(path.stem, {"CPU": None, "GPU": None})[kind] = {
                    "seconds": round(seconds), "device_name": name,
                    "date": datetime.date.today().isoformat()}
                RUNTIMES.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
