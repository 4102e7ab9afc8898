"""The open issues' numeric GPU goals, read off the reports of one benchmarks/gpu_check.py run:
one row per goal, with what the run measured and whether that meets it. A GPU session runs
the check in parts (kernels, model, labs), each writing its own report; this puts the
numbers the issues ask for side by side, so that a session ends knowing which goals moved.

    python benchmarks/gpu_goals.py kernels.json model.json labs.json   # a Markdown table
    python benchmarks/gpu_goals.py --json kernels.json model.json      # the rows as JSON

A row is ``{"issue": int, "goal": str, "measured": str, "met": True | False | None}``;
``met`` is None ("not measured") when the row the goal reads is absent (its section was
not run, was skipped, or its time box cut it first) or its value is None, and ``measured``
then says which. It is a summary, not a gate: the exit code is 0 whenever the reports
parse, 2 for a file that is not a gpu_check report of a GPU run (a CPU dry run's numbers
are the Triton interpreter's, not a GPU's: refused). ``goals(reports)`` is the pure
function behind it (tested on the H100 reports of 2026-11-27 and on small made-up ones).

When several reports hold a section of the same name (a section run again), the last
report given wins. The sections that run only when asked are outside issue 25's check and
its eight minutes, each with its own budget: the labs and compiled_wall (issue 28's: Lab
01's q9 on the GPU), gemv_tiles and w4a16_tiles (tuning runs of the decode GEMV's and the
W4A16 GEMV's tiles, like --autotune; the goals of 27 read what they kept).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpu_check_report import START_UP_S, fmt, markdown_table, validate_report

GEMV_OFF = ", GEMV glue off"  # gpu_check_model.GEMV_OFF (not imported here: it loads torch)

CHECK_LIMIT_S = 480.0   # issue 25: the full check in 8 minutes on one GPU, start-up included
TIME_BOX = "time box"   # in a section's `skipped` entry: what its time box cut
LABS = "labs"
# gpu_check's sections that run only when asked (gpu_check_kernels.ASKED_ONLY,
# gpu_check_model.ASKED_ONLY and the labs; not imported here: they load torch): not part of
# issue 25's check.
ASKED_ONLY = (LABS, "gemv_tiles", "w4a16_tiles", "compiled_wall")
# Issue 26: the engine's rows in the decode and serving sections.
GRAPH_DECODE = "minillm CUDA graph, triton attention"
ENGINE = "engine continuous, triton"
HF_ONE, HF_STATIC = "HF one-at-a-time", "HF static-16"
# Issue 27: (N, K, the M = 1 goal against dense bf16) of the W4A16 rows of layout g64 asym.
W4_LAYOUT = "g64 asym"
W4_SHAPES = ((4096, 4096, 2.5), (14336, 4096, 2.5), (3072, 576, 1.3), (49152, 576, 3.0))
W4_M16_GOAL = 2.0
# The candidates for the M = 1 product: (row key of their speed-up over dense, name).
W4_CANDIDATES = (("vs_dense", "W4A16 kernel"), ("decode_gemv_vs_dense", "decode GEMV"))
W4_MEASURED_TILES = "W4A16 kernel, measured tiles"  # w4a16_tiles' fastest row of the shape
# Issue 28: Lab 01's q13 (eager) and q9 (compiled), predictions marked within 20%
# (quizzes.questions.MAX_PREDICT_RTOL), from a launch wall row's `<variant>_predicted_ms`.
LAUNCH_WALL = "launch wall"
Q13_RTOL = 0.2


def _row(issue: int, goal: str, measured: str, met: bool | None) -> dict:
    return {"issue": issue, "goal": goal, "measured": measured, "met": met}


def refuse_dry_run(report: dict) -> None:
    """Raise ValueError for a CPU dry run's report: its numbers are no GPU's."""
    if report.get("mode") == "cpu-dry-run":
        raise ValueError(f"a CPU dry run's report (`{report.get('command')}`): its numbers "
                         f"are the Triton interpreter's at tiny sizes, not a GPU's; give the "
                         f"reports of a run on a GPU (mode 'cuda')")


class Sections:
    """The reports' sections by name (the last report wins), and the rows the goals read."""

    def __init__(self, reports: list[dict]):
        self.by_name = {s["name"]: s for r in reports for s in r["sections"]}
        self.report_of = {s["name"]: r for r in reports for s in r["sections"]}

    def tiles_of(self, name: str) -> str:
        """Which tile configs section ``name``'s process launched: those an earlier process
        of the run measured (MINILLM_TUNED, with configs in it: gemv_tiles' or --autotune's),
        those gemv_tiles kept before it in the same process (a row marked ``kept``), or the
        pinned ones."""
        r = self.report_of.get(name)
        if r is None:
            return ""
        if r["environment"].get("tuned") and r["environment"].get("tuned_configs"):
            return "tiles measured earlier in the run"
        names = [s["name"] for s in r["sections"]]
        tiles = self.by_name.get("gemv_tiles")
        if (tiles is not None and self.report_of["gemv_tiles"] is r
                and names.index("gemv_tiles") < names.index(name)
                and any(row.get("kept") for row in tiles["rows"])):
            return "decode GEMV tiles measured earlier in the run"
        return "pinned tiles"

    def find(self, name: str, want) -> tuple[list[dict], str]:
        """The rows of section ``name`` that ``want(row)`` accepts, and, when there are
        none, why: the section absent, or how it ended."""
        section = self.by_name.get(name)
        if section is None:
            return [], f"no {name} section in the reports"
        rows = [r for r in section["rows"] if want(r)]
        cut = sum(TIME_BOX in s for s in section["skipped"])
        return rows, ("" if rows else f"no such row: {name} section {section['status']}"
                      + (f", {cut} cut by its time box" if cut else ""))

    def one(self, name: str, want) -> tuple[dict | None, str]:
        rows, why = self.find(name, want)
        return (rows[0] if rows else None), why


def threshold(issue: int, goal: str, row: dict | None, why: str, key: str, limit: float,
              at_least: bool = True, unit: str = "") -> dict:
    """The goal ``row[key] >= limit`` (or ``<=``); not measured without the row or value."""
    value = None if row is None else row.get(key)
    if value is None:
        return _row(issue, goal, why or f"{key} not recorded", None)
    return _row(issue, goal, f"{fmt(value)}{unit}", value >= limit if at_least else value <= limit)


def issue_25(reports: list[dict], sections: Sections) -> list[dict]:
    """Every section of the check ok and uncut; its seconds plus start-up within 8 minutes."""
    check = [s for s in sections.by_name.values() if s["name"] not in ASKED_ONLY]
    ok_goal = "every section of the check ok, nothing cut by a time box"
    time_goal = f"check + {START_UP_S:.0f} s start-up ≤ {CHECK_LIMIT_S:.0f} s (8 minutes)"
    if not check:
        why = "no section of the check in the reports"
        return [_row(25, ok_goal, why, None), _row(25, time_goal, why, None)]
    bad = []
    for s in check:
        cut = sum(TIME_BOX in entry for entry in s["skipped"])
        if s["status"] != "ok":
            bad.append(f"{s['name']} {s['status']}")
        elif cut:
            bad.append(f"{s['name']}: {cut} cut by its time box")
    measured = ("not ok: " + "; ".join(bad)) if bad else f"all sections ok ({len(check)})"
    # A report's seconds are its whole run's (environment included), less the sections in
    # it that run only when asked.
    seconds = sum(r["seconds"] - sum(s["seconds"] for s in r["sections"]
                                     if s["name"] in ASKED_ONLY)
                  for r in reports if any(s["name"] not in ASKED_ONLY for s in r["sections"]))
    total = seconds + START_UP_S
    return [_row(25, ok_goal, measured, not bad),
            _row(25, time_goal, f"{fmt(total)} s ({fmt(seconds)} s of runs, {len(check)} sections)",
                 total <= CHECK_LIMIT_S)]


def issue_26(sections: Sections) -> list[dict]:
    """Batch-1 decode through the CUDA graph, and the serving workload against HF."""
    graph, why = sections.one("decode", lambda r: r.get("engine") == GRAPH_DECODE)
    same = None if graph is None else graph.get("same_tokens_as_eager")
    rows = [threshold(26, "batch-1 bf16 decode, CUDA graph + Triton attention ≥ 1,500 tok/s",
                      graph, why, "decode_tok_s", 1500.0, unit=" tok/s"),
            _row(26, "its greedy tokens identical to eager's",
                 (why or "same_tokens_as_eager not recorded") if same is None else
                 "identical" if same else f"differ from token {graph.get('first_divergence')}",
                 same)]
    engine, why = sections.one("serving", lambda r: r.get("system") == ENGINE)
    rows += [threshold(26, "serving workload ≥ 12,000 output tok/s", engine, why, "tok_s",
                       12000.0, unit=" tok/s"),
             threshold(26, "p50 inter-token latency ≤ 3 ms at 64 sequences", engine, why,
                       "itl_p50_ms", 3.0, at_least=False, unit=" ms")]
    for hf_name, limit in ((HF_ONE, 14.0), (HF_STATIC, 3.0)):
        hf, hf_why = sections.one("serving", lambda r, n=hf_name: r.get("system") == n)
        goal = f"engine ≥ {limit:g}× {hf_name} (tok/s)"
        mine, theirs = (None if r is None else r.get("tok_s") for r in (engine, hf))
        if not (mine and theirs):
            rows.append(_row(26, goal, why or hf_why or "tok_s not recorded", None))
        else:
            rows.append(_row(26, goal, f"{fmt(mine / theirs)}×", mine / theirs >= limit))
    return rows


def issue_27(sections: Sections) -> list[dict]:
    """W4A16 against dense bf16 at M = 1 and 16, and SmolLM2's w4 decode against bf16."""
    rows = []

    def w4(n, k, m):
        return sections.one("w4a16", lambda r: (r.get("N"), r.get("K"), r.get("M"),
                                                r.get("layout")) == (n, k, m, W4_LAYOUT))

    def best_candidate(goal, row, n, k, m, limit) -> None:
        """The goal's row for the best of the W4A16 kernel, the decode GEMV (M = 1) and
        w4a16_tiles' fastest correct candidate of this class (a later section of the run,
        against the w4a16 row's dense matmul; all timed from CUDA graphs), where there are
        two or more."""
        found = [] if row is None else [
            (row[key], name) for key, name in W4_CANDIDATES if row.get(key) is not None]
        tiles, _ = sections.find("w4a16_tiles", lambda r: (
            r.get("N"), r.get("K"), r.get("M")) == (n, k, m) and r.get("ok") and r.get("us"))
        if tiles and row is not None and row.get("dense_us"):
            found.append((row["dense_us"] / min(r["us"] for r in tiles), W4_MEASURED_TILES))
        if len(found) > 1:
            best, name = max(found)
            rows.append(_row(27, goal + " (best candidate)",
                             f"{fmt(best)}×, {name} (of " + ", ".join(
                                 f"{cand} {fmt(v)}×" for v, cand in found) + ")",
                             best >= limit))

    for n, k, limit in W4_SHAPES:
        row, why = w4(n, k, 1)
        goal = f"W4A16 M = 1, {n}×{k}: ≥ {limit:g}× dense bf16"
        rows.append(threshold(27, goal + " (W4A16 kernel)", row, why, "vs_dense", limit,
                              unit="×"))
        best_candidate(goal, row, n, k, 1, limit)
    for n, k, _ in W4_SHAPES:
        row, why = w4(n, k, 16)
        goal = f"W4A16 M = 16, {n}×{k}: ≥ {W4_M16_GOAL:g}× dense bf16"
        rows.append(threshold(27, goal, row, why, "vs_dense", W4_M16_GOAL, unit="×"))
        best_candidate(goal, row, n, k, 16, W4_M16_GOAL)
    goal = "SmolLM2 w4 batch-1 decode (CUDA graph) faster than bf16"
    found, why = sections.find("decode", lambda r: str(r.get("engine", "")).startswith(
        "minillm w4") and "CUDA graph" in r["engine"] and r.get("vs_bf16") is not None)
    if not found:
        rows.append(_row(27, goal, why.replace("no such row", "no w4 CUDA graph row with "
                                               "vs_bf16"), None))
    else:
        best = max(found, key=lambda r: r["vs_bf16"])
        of = f", best of {len(found)}" if len(found) > 1 else ""
        tiles = ("decode GEMV off" if GEMV_OFF in best["engine"]
                 else sections.tiles_of("decode"))
        rows.append(_row(27, goal, f"{fmt(best['vs_bf16'])}× bf16 ({best['engine']}{of}; "
                                   f"{tiles})", best["vs_bf16"] > 1.0))
    return rows


def launch_wall_goal(sections: Sections, quiz: str, variant: str, section: str) -> dict:
    """Lab 01's ``quiz`` marks a GPU fairly: the ``variant`` step within 20% of its
    predicted floor (the launch wall row of ``section``: Lab 01 section 8 on the model's
    GPU)."""
    goal = f"Lab 01 {quiz}: {variant} step within 20% of its predicted floor"
    pred_key, step_key = f"{variant}_predicted_ms", f"{variant}_step_ms"
    row, why = sections.one(section, lambda r: str(r.get("engine", "")).startswith(LAUNCH_WALL))
    pred, step = (None, None) if row is None else (row.get(pred_key), row.get(step_key))
    if not (pred and step):
        return _row(28, goal, why or f"{pred_key} / {step_key} not recorded", None)
    off = pred / step - 1
    if variant == "compiled":
        how = (f"operator calls and {fmt(row['compiled_compiled_launches'])} launches from "
               f"compiled code at {fmt(row['compiled_launch_us'])} µs"
               if row.get("compiled_launch_us") else "operator calls only")
    else:
        how = ("operator calls and Triton launches" if row.get("triton_launch_us") else
               "launches only: a report from before Triton launches were counted")
    return _row(28, goal, f"predicted {fmt(pred)} ms, measured {fmt(step)} ms ({off:+.0%}; "
                          f"{how})", abs(off) <= Q13_RTOL)


def labs_goal(sections: Sections) -> dict:
    goal = "every lab passes under nbval on the GPU"
    section = sections.by_name.get(LABS)
    if section is None:
        return _row(28, goal, "no labs section in the reports", None)
    labs = [r for r in section["rows"] if "lab" in r]
    failed = [str(r["lab"]).split("-")[0] for r in labs if r.get("ok") is not True]
    cut = len(section["skipped"])
    text = f"{len(labs) - len(failed)} of {len(labs) + cut} passed"
    text += f"; failed: {', '.join(failed)}" if failed else ""
    text += f"; {cut} cut or not started" if cut else ""
    text += f"; error: {section['error']}" if section["error"] else ""
    return _row(28, goal, text, bool(labs) and not failed and not cut
                and section["status"] == "ok")


def issue_28(sections: Sections) -> list[dict]:
    """Every lab passed under nbval on the GPU, none cut; Lab 01's q13 and q9 fair on a GPU."""
    return [labs_goal(sections), launch_wall_goal(sections, "q13", "eager", "decode"),
            launch_wall_goal(sections, "q9", "compiled", "compiled_wall")]


def goals(reports: list[dict]) -> list[dict]:
    """The goals of issues 25-28 against the reports of one GPU run (module docstring);
    ValueError for a CPU dry run's report."""
    for report in reports:
        refuse_dry_run(report)
    sections = Sections(reports)
    return (issue_25(reports, sections) + issue_26(sections) + issue_27(sections)
            + issue_28(sections))


def load_report(path: Path) -> dict:
    """A gpu_check report of a GPU run, or ValueError naming the file and what is wanted."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a JSON report: {e}") from None
    if not isinstance(report, dict):
        raise ValueError(f"{path}: not a gpu_check report (a JSON object with schema "
                         f"'minillm-gpu-check/1' expected)")
    try:
        validate_report(report)
        refuse_dry_run(report)
    except ValueError as e:
        raise ValueError(f"{path}: not a gpu_check report of a GPU run: {e}") from None
    return report


def to_markdown(rows: list[dict]) -> str:
    """The table, then one line counting the goals met, not met and not measured."""
    table = markdown_table([{**r, "met": "not measured" if r["met"] is None else r["met"]}
                            for r in rows])
    count = {m: sum(r["met"] is m for r in rows) for m in (True, False, None)}
    return "\n".join(table + ["", f"{count[True]} of {len(rows)} goals met, {count[False]} "
                                  f"not met, {count[None]} not measured."]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="gpu_check reports (JSON) of one run")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    try:
        rows = goals([load_report(p) for p in args.reports])
    except ValueError as e:
        ap.error(str(e))  # exit 2
    print(json.dumps(rows, indent=1, ensure_ascii=False) if args.json else to_markdown(rows),
          end="\n" if args.json else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
