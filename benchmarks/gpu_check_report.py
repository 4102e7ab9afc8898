"""The report of benchmarks/gpu_check.py: its JSON schema (``SCHEMA``, checked by
``validate_report``; the fields are listed in gpu_check's docstring) and its Markdown
(``to_markdown``: the environment line, then one table per section over the union of its
rows' keys, a small table per part of a row's ``breakdown`` (where a step's time goes,
benchmarks/step_breakdown.py), its notes and what it skipped), which is what BENCHMARKS.md
shows under "Measured on a GPU". Plain functions of plain dicts: tested without a GPU.

    python benchmarks/gpu_check_report.py REPORT.json ...   # the Markdown of saved reports

(a file that holds only ``{section name: rows}``, as a run cut before it could write its
report was saved by hand, prints one table per section).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEMA = "minillm-gpu-check/1"
STATUSES = ("ok", "failed", "timeout", "skipped")
# What a full run needs besides its sections' time boxes (gpu_check.TOTAL_BUDGET_S): the GPU
# machine's start, the copies, processes starting, environment(). Here, not in gpu_check,
# so that reading a report (gpu_goals.py) needs no torch.
START_UP_S = 60.0
# A row's {part name: part} of step_breakdown's parts: tables of their own, not a column.
BREAKDOWN = "breakdown"


def fmt(v) -> str:
    """A table cell: floats to 3 significant-ish digits, booleans yes/NO, None a dash."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        a = abs(v)
        return (f"{v:.0f}" if a >= 100 else f"{v:.2f}" if a >= 1 else
                "0" if a == 0 else f"{v:.3f}" if a >= 0.01 else f"{v:.1e}")
    text = str(v).replace("|", "/").replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def markdown_table(rows: list[dict]) -> list[str]:
    """One Markdown table over the union of the rows' keys (but ``breakdown``), in
    first-seen order."""
    cols = list(dict.fromkeys(k for r in rows for k in r if k != BREAKDOWN))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def _count(v) -> str:
    """A count per step: whole numbers as such, others as ``fmt`` writes them."""
    return str(int(v)) if isinstance(v, (int, float)) and v == int(v) else fmt(v)


def _share(v) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def breakdown_lines(label: str, breakdown: dict) -> list[str]:
    """A row's breakdown: per part, one line (what was profiled, over how many steps, the
    totals per step) and a small table: the kernels by time ("kernels" parts, the others
    summed in a last line) or the functions by own time ("host" parts)."""
    lines = []
    for name, part in breakdown.items():
        head = f"*{label}: {name}*"
        if part.get("error"):
            lines += [f"{head}: not measured: `{fmt(part['error'])}`", ""]
            continue
        steps = (f"{part['steps']} step{'s' if part['steps'] != 1 else ''}, "
                 f"{fmt(part.get('seconds'))} s")
        if part.get("kind") == "kernels":
            lines.append(f"{head} ({steps}): {part['events']}: {_count(part['kernels_per_step'])}"
                         f" per step, busy {fmt(part['busy_us_per_step'])} µs of "
                         f"{fmt(part['wall_us_per_step'])} µs wall per step")
            rows = [{"kernel": k["kernel"], "per step": _count(k["per_step"]),
                     "µs/step": fmt(k["us_per_step"]), "of busy": _share(k["share"])}
                    for k in part["top"]]
            other = part["others"]
            if other["kernels"]:
                busy = part["busy_us_per_step"]
                rows.append({"kernel": f"({other['kernels']} others)",
                             "per step": _count(other["per_step"]),
                             "µs/step": fmt(other["us_per_step"]),
                             "of busy": _share(other["us_per_step"] / busy if busy else None)})
        else:
            lines.append(f"{head} ({steps}): {part['events']}: "
                         f"{fmt(part['host_us_per_step'] / 1e3)} ms per step (wall "
                         f"{fmt(part['wall_us_per_step'] / 1e3)} ms under cProfile)")
            rows = [{"function": f["function"], "calls/step": _count(f["calls_per_step"]),
                     "µs/step": fmt(f["us_per_step"]), "share": _share(f["share"])}
                    for f in part["top"]]
        lines += [""] + markdown_table(rows) + [""]
    return lines


def rows_markdown(rows: list[dict]) -> list[str]:
    """The rows' table, then the breakdowns of the rows that have one, each under the
    row's first value (its name)."""
    lines = markdown_table(rows) + [""]
    for r in rows:
        if r.get(BREAKDOWN):
            lines += breakdown_lines(str(next(iter(r.values()))), r[BREAKDOWN])
    return lines


def summary(report: dict) -> str:
    """"all passed", "FAILURES: ...", plus the sections cut by their time box."""
    by = {st: [s["name"] for s in report["sections"] if s["status"] == st] for st in STATUSES}
    text = f"FAILURES: {', '.join(by['failed'])}" if by["failed"] else "all passed"
    if by["timeout"]:
        text += f"; incomplete (time box): {', '.join(by['timeout'])}, run it again"
    if not report.get("finished", True):
        text += "; the run had not finished (cut, or still going): what it reached"
    return text


def to_markdown(report: dict) -> str:
    env = report["environment"]
    dry = report["mode"] == "cpu-dry-run"
    head = ("CPU dry run (Triton interpreter, tiny sizes): these are NOT GPU numbers; they "
            "show that every path of the script runs." if dry else
            f"{env['device']}, driver {env.get('driver') or '?'}, CUDA {env.get('cuda')}")
    lines = [f"{head}", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}, "
             f"{env['date']}; measured bandwidth {env.get('bandwidth_GBps')} GB/s, matmul "
             f"{env.get('matmul_TFLOPs')} TFLOP/s. Command: `{report['command']}` "
             f"({report['seconds']:.0f} s, {summary(report)})." + (
                 f" Tile configs measured by an earlier process of the session were launched "
                 f"(MINILLM_TUNED: {env['tuned_configs']} from {env['tuned']})."
                 if env.get("tuned") else ""), ""]
    for s in report["sections"]:
        lines.append(f"**{s['title']}** ({s['status']}, {s['seconds']:.0f} s)")
        lines.append("")
        if s["error"]:
            lines += [f"Error: `{fmt(s['error'])[:300]}`", ""]
        if s["rows"]:
            lines += rows_markdown(s["rows"])
        lines += [f"- {n}" for n in s["notes"]]
        if s["skipped"]:
            lines.append(f"- skipped: {'; '.join(s['skipped'])}")
        if s["notes"] or s["skipped"]:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def validate_report(report: dict) -> None:
    """Raise ValueError naming the first field that breaks ``SCHEMA`` (module docstring)."""
    def need(obj, key, types, where):
        if key not in obj or not isinstance(obj[key], types):
            raise ValueError(f"{where}.{key} must be {types}, got {obj.get(key)!r}")
    if report.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA!r}, got {report.get('schema')!r}")
    if report.get("mode") not in ("cuda", "cpu-dry-run"):
        raise ValueError(f"mode must be 'cuda' or 'cpu-dry-run', got {report.get('mode')!r}")
    for key, types in (("quick", bool), ("command", str), ("ok", bool), ("seconds", (int, float)),
                       ("environment", dict), ("sections", list)):
        need(report, key, types, "report")
    if "finished" in report:  # absent in reports written before it existed
        need(report, "finished", bool, "report")
    for key in ("device", "torch", "triton", "python", "date"):
        need(report["environment"], key, str, "environment")
    for key in ("driver", "cuda"):
        need(report["environment"], key, (str, type(None)), "environment")
    for i, s in enumerate(report["sections"]):
        where = f"sections[{i}]"
        for key, types in (("name", str), ("title", str), ("status", str),
                           ("seconds", (int, float)), ("budget_s", (int, float)),
                           ("error", (str, type(None))), ("rows", list), ("notes", list),
                           ("skipped", list)):
            need(s, key, types, where)
        if s["status"] not in STATUSES:
            raise ValueError(f"{where}.status must be one of {STATUSES}, got {s['status']!r}")
        if not all(isinstance(r, dict) for r in s["rows"]):
            raise ValueError(f"{where}.rows must hold dicts")
        for j, r in enumerate(s["rows"]):
            parts = r.get(BREAKDOWN, {})
            if not (isinstance(parts, dict) and all(isinstance(p, dict) for p in parts.values())):
                raise ValueError(f"{where}.rows[{j}].{BREAKDOWN} must be {{part name: dict}}")
    if report["ok"] != all(s["status"] != "failed" for s in report["sections"]):
        raise ValueError("report.ok must be true exactly when no section failed")


def file_markdown(path: Path) -> str:
    """The Markdown of a saved report, or of a bare ``{section name: rows}`` file."""
    data = json.loads(Path(path).read_text())
    if "schema" in data:
        return to_markdown(data)
    lines = []
    for name, rows in data.items():
        if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
            lines += [f"**{name}**", "", *rows_markdown(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: python {sys.argv[0]} REPORT.json ...")
    print("\n".join(file_markdown(Path(a)) for a in sys.argv[1:]))
