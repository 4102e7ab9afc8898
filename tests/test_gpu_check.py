"""benchmarks/gpu_check.py: the no-GPU line, section isolation and time boxes, the report
rewritten after every section and kept when a signal cuts the run, imports without the
serving stack, the Markdown table, the JSON schema, and the --cpu-dry-run path at tiny
sizes; and benchmarks/triton_compile_sweep.py, which compiles the kernels' CUDA
configurations here.

The GPU itself is never needed: the no-GPU test hides the devices (CUDA_VISIBLE_DEVICES=""),
and the dry run runs the kernels in Triton's interpreter and a 2-layer random model.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
from gpu_check import RunInterrupted, Section, run_sections  # noqa: E402
from gpu_check_report import SCHEMA, markdown_table, to_markdown, validate_report  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CPU = torch.device("cpu")


def _script(*args, env=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_without_a_gpu_it_prints_one_line_and_exits_0(tmp_path):
    res = _script("--out", str(tmp_path / "r.json"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == [gpu_check.NO_GPU_LINE]
    assert "no CUDA device" in res.stdout and "nothing was checked" in res.stdout
    assert not (tmp_path / "r.json").exists()


# ----------------------------------------------------------------------------- runner


def _sections(calls):
    def good(run):
        calls.append("good")
        run.case("a", lambda: {"x": 1.5, "ok": True})
        run.notes.append("a note")

    def raises(run):
        calls.append("raises")
        raise RuntimeError("kernel failed to compile")

    def bad_row(run):
        calls.append("bad_row")
        run.case("fine", lambda: {"x": 1, "ok": True})
        run.case("broken", lambda: 1 / 0)
        run.case("after", lambda: {"x": 2, "ok": True})

    def slow(run):
        calls.append("slow")
        for i in range(100):
            run.case(f"case {i}", lambda: time.sleep(0.02) or {"i": i})

    def hangs(run):
        calls.append("hangs")
        time.sleep(30)

    budget = {"dry": 5.0}
    return [Section("good", "Good", good, budget), Section("raises", "Raises", raises, budget),
            Section("bad_row", "Bad row", bad_row, budget),
            Section("slow", "Slow", slow, {"dry": 0.1}),
            Section("hangs", "Hangs", hangs, {"dry": 0.1}),
            Section("gpu_only", "GPU only", good, {"full": 5.0}),
            Section("good_again", "Good again", good, budget)]


def test_sections_are_isolated_and_time_boxed():
    calls = []
    t0 = time.monotonic()
    entries = run_sections(_sections(calls), "dry", CPU, {}, grace_s=0.3)
    assert time.monotonic() - t0 < 10, "the hung section was not interrupted"
    by = {e["name"]: e for e in entries}
    assert calls == ["good", "raises", "bad_row", "slow", "hangs", "good"]  # not gpu_only
    assert by["good"]["status"] == by["good_again"]["status"] == "ok"
    assert by["good"]["rows"] == [{"x": 1.5, "ok": True}] and by["good"]["notes"] == ["a note"]
    assert by["raises"]["status"] == "failed"
    assert "RuntimeError: kernel failed to compile" in by["raises"]["error"]
    rows = by["bad_row"]["rows"]  # the failing case fails its row and the section, no more
    assert by["bad_row"]["status"] == "failed" and by["bad_row"]["error"] is None
    assert [r.get("x") for r in rows] == [1, None, 2]
    assert rows[1]["case"] == "broken" and "ZeroDivisionError" in rows[1]["error"]
    slow = by["slow"]  # stops at its deadline and lists what it had no time for
    assert slow["status"] == "ok" and 0 < len(slow["rows"]) < 100
    assert len(slow["rows"]) + len(slow["skipped"]) == 100
    assert slow["skipped"][-1] == "case 99 (time box)"
    hangs = by["hangs"]  # interrupted: incomplete, not a failed check
    assert hangs["status"] == "timeout" and hangs["error"] is None
    assert "interrupted by the time box" in hangs["skipped"][0]
    assert by["gpu_only"]["status"] == "skipped" and by["gpu_only"]["rows"] == []
    assert "not part of this mode" in by["gpu_only"]["notes"][0]


def test_the_total_budget_skips_later_sections():
    calls = []
    entries = run_sections(_sections(calls)[:3], "dry", CPU, {}, total_budget_s=0.0)
    assert calls == [] and {e["status"] for e in entries} == {"skipped"}
    assert "no time left" in entries[0]["notes"][0]


def _progress_reports(entries_seen):
    """on_progress that keeps a validated report of every call."""
    def on_progress(entries):
        report = _report(copy.deepcopy(entries))
        validate_report(report)
        entries_seen.append(report["sections"])
    return on_progress


def test_the_report_is_complete_and_valid_after_every_section():
    seen = []
    sections = _sections([])[:3]
    run_sections(sections, "dry", CPU, {}, on_progress=_progress_reports(seen))
    assert len(seen) == 3
    for i, entries in enumerate(seen):  # done so far, then the rest "not reached"
        assert [e["name"] for e in entries] == ["good", "raises", "bad_row"]
        assert all(e["status"] != "skipped" for e in entries[:i + 1])
        assert all(e["status"] == "skipped" and "not reached" in e["notes"][0]
                   for e in entries[i + 1:])
    assert seen[0][0]["rows"] == [{"x": 1.5, "ok": True}]


def test_a_signal_keeps_the_rows_of_the_section_it_cuts_and_skips_the_rest():
    def cut(run):
        run.case("before", lambda: {"x": 1, "ok": True})
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, as from outside
        run.case("after", lambda: {"x": 2, "ok": True})

    seen = []
    sections = [_sections([])[0], Section("cut", "Cut", cut, {"dry": 5.0}),
                _sections([])[-1]]
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as info:
        run_sections(sections, "dry", CPU, {}, on_progress=_progress_reports(seen))
    assert info.value.signum == signal.SIGTERM and info.value.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    final = seen[-1]
    assert [e["status"] for e in final] == ["ok", "timeout", "skipped"]
    assert final[1]["rows"] == [{"x": 1, "ok": True}]
    assert "interrupted by SIGTERM" in final[1]["skipped"][0]
    assert "interrupted by SIGTERM before it" in final[2]["notes"][0]


# ----------------------------------------------------------------------------- report


def _report(entries) -> dict:
    return {"schema": SCHEMA, "mode": "cuda", "quick": False,
            "command": "python benchmarks/gpu_check.py", "seconds": 12.0,
            "ok": all(e["status"] != "failed" for e in entries),
            "environment": {"device": "NVIDIA H100 80GB HBM3", "driver": "580.65", "cuda": "13.0",
                            "torch": "2.13.0", "triton": "3.7.1", "python": "3.11.7",
                            "date": "2026-11-25 14:00 UTC", "bandwidth_GBps": 3000.0,
                            "matmul_TFLOPs": 700.0},
            "sections": entries}


def test_markdown_table_formats_every_kind_of_value():
    rows = [{"T": 512, "err": 3.2e-4, "TFLOPs": 312.456, "ratio": 1.234, "ok": True},
            {"T": 8192, "err": 0.0, "note": "a|b\nc", "ok": False, "frac": 0.5}]
    assert markdown_table(rows) == [
        "| T | err | TFLOPs | ratio | ok | note | frac |",
        "|---|---|---|---|---|---|---|",
        "| 512 | 3.2e-04 | 312 | 1.23 | yes | – | – |",
        "| 8192 | 0 | – | – | NO | a/b c | 0.500 |"]


def test_to_markdown_has_the_environment_every_section_and_labels_a_dry_run():
    entries = run_sections(_sections([])[:3], "dry", CPU, {})
    report = _report(entries)
    md = to_markdown(report)
    assert "had not finished" not in md
    assert "the run had not finished" in to_markdown(dict(report, finished=False))
    for text in ("NVIDIA H100 80GB HBM3", "driver 580.65", "torch 2.13.0", "triton 3.7.1",
                 "2026-11-25 14:00 UTC", "`python benchmarks/gpu_check.py`", "FAILURES: raises",
                 "**Good** (ok", "**Raises** (failed", "Error: `RuntimeError: kernel failed",
                 "| x | ok |", "- a note"):
        assert text in md, text
    assert "NOT GPU numbers" not in md and "incomplete" not in md and "MINILLM_TUNED" not in md
    tuned = copy.deepcopy(report)  # a process that launched an earlier one's measurements
    tuned["environment"].update(tuned="/tmp/minillm-gpu/kernels.tuned.json", tuned_configs=8)
    assert "(MINILLM_TUNED: 8 from /tmp/minillm-gpu/kernels.tuned.json)" in to_markdown(tuned)
    timed_out = copy.deepcopy(report)
    timed_out["sections"][1].update(status="timeout", error=None)
    timed_out["ok"] = False  # bad_row still failed
    assert "(12 s, FAILURES: bad_row; incomplete (time box): raises, run it again)" \
        in to_markdown(timed_out)
    dry = dict(report, mode="cpu-dry-run")
    assert to_markdown(dry).startswith("CPU dry run (Triton interpreter, tiny sizes): these "
                                       "are NOT GPU numbers")


def test_a_rows_breakdown_prints_as_small_tables_under_its_section_table():
    """step_breakdown's parts: not a column of the row's table, but one line and one table
    each, under the row's name; the kernels outside the top list summed in a last line; a
    part that failed says so."""
    import step_breakdown as sb

    kernels = {"kind": "kernels", "events": "CUDA kernels, copies and memsets",
               **sb.kernel_breakdown([(name, t + a, t + b) for t in (0, 10) for name, a, b in
                                      (("gemv", 0, 6), ("norm", 6, 8), ("copy", 8, 9))],
                                     steps=2, top=2),
               "wall_us_per_step": 12.0, "seconds": 0.5}
    host = {"kind": "host", "events": "host Python and C calls, own time (cProfile)",
            **sb.host_breakdown({("~", 0, "<built-in method torch._C._nn.linear>"):
                                 (6, 6, 3e-3, 3e-3, {})}, steps=2),
            "wall_us_per_step": 2000.0, "seconds": 0.25}
    row = {"engine": "graph", "tok_s": 1155.0,
           "breakdown": {"graph replay, device": kernels, "eager step, host": host,
                         "broken": {"error": "RuntimeError: CUPTI unavailable"}}}
    entry = {"name": "decode", "title": "Decode", "status": "ok", "seconds": 3.0,
             "budget_s": 10.0, "error": None, "rows": [row], "notes": ["n"], "skipped": []}
    report = _report([entry])
    validate_report(report)
    md = to_markdown(report)
    assert "| engine | tok_s |\n|---|---|\n| graph | 1155 |\n" in md  # no breakdown column
    assert ("*graph: graph replay, device* (2 steps, 0.500 s): CUDA kernels, copies and "
            "memsets: 3 per step, busy 9.00 µs of 12.00 µs wall per step\n\n"
            "| kernel | per step | µs/step | of busy |\n|---|---|---|---|\n"
            "| gemv | 1 | 6.00 | 67% |\n| norm | 1 | 2.00 | 22% |\n"
            "| (1 others) | 1 | 1.00 | 11% |\n") in md
    assert ("*graph: eager step, host* (2 steps, 0.250 s): host Python and C calls, own time "
            "(cProfile): 1.50 ms per step (wall 2.00 ms under cProfile)\n\n"
            "| function | calls/step | µs/step | share |\n|---|---|---|---|\n"
            "| {built-in method torch._C._nn.linear} | 3 | 1500 | 100% |\n") in md
    assert "*graph: broken*: not measured: `RuntimeError: CUPTI unavailable`" in md
    assert md.index("| graph | 1155 |") < md.index("*graph: graph replay") < md.index("- n")
    line = gpu_check._row_line(row)
    assert line.startswith("engine=graph, tok_s=1155, breakdown=graph replay, device 0.5 s; "
                           "eager step, host 0.25 s; broken failed"), line
    bad = copy.deepcopy(report)
    bad["sections"][0]["rows"][0]["breakdown"] = {"graph replay, device": [1, 2]}
    with pytest.raises(ValueError, match=r"rows\[0\].breakdown must be"):
        validate_report(bad)


def test_the_schema_accepts_a_real_report_and_names_what_breaks_it():
    report = _report(run_sections(_sections([])[:3], "dry", CPU, {}))
    validate_report(report)
    json.loads(json.dumps(report))  # plain JSON
    breakages = [
        (lambda r: r.update(schema="other/1"), "schema must be"),
        (lambda r: r.update(mode="gpu"), "mode must be"),
        (lambda r: r.pop("environment"), "report.environment"),
        (lambda r: r["environment"].pop("triton"), "environment.triton"),
        (lambda r: r["environment"].update(driver=535), "environment.driver"),
        (lambda r: r["sections"][0].pop("rows"), r"sections\[0\].rows"),
        (lambda r: r["sections"][1].update(status="meh"), "status must be one of"),
        (lambda r: r["sections"][0].update(rows=[1]), "rows must hold dicts"),
        (lambda r: r.update(ok=True), "ok must be true exactly when no section failed"),
        (lambda r: r.update(finished="yes"), "report.finished"),
    ]
    for breaks, message in breakages:
        broken = copy.deepcopy(report)
        breaks(broken)
        with pytest.raises(ValueError, match=message):
            validate_report(broken)


@pytest.mark.slow
def test_cpu_dry_run_exercises_every_section_at_tiny_sizes(tmp_path):
    """Every section and every path a CPU can take (the compiled rows included; about 2
    minutes): only what needs CUDA itself is left out, and the report says so."""
    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    res = _script("--cpu-dry-run", "--out", str(out), "--markdown", str(md))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    validate_report(report)
    assert report["mode"] == "cpu-dry-run" and report["ok"] and report["finished"]
    assert [s["name"] for s in report["sections"]] == [
        "flash_attention", "paged_decode", "varlen", "w4a16", "decode_gemv", "greedy_match",
        "decode",
        "serving", "pytest"]
    for s in report["sections"]:
        assert s["status"] == "ok" and s["rows"], s
        assert all(r.get("ok") is not False for r in s["rows"]), s
    by = {s["name"]: s for s in report["sections"]}
    assert {r["heads"] for r in by["flash_attention"]["rows"]} == {"9:3", "32:8"}
    assert all(r["err_vs_f64"] < 1e-5 for r in by["flash_attention"]["rows"])
    assert [r["attention"] for r in by["greedy_match"]["rows"]] == ["triton", "torch"]
    assert all(r["first_divergence"] is None for r in by["greedy_match"]["rows"])
    engines = [r["engine"] for r in by["decode"]["rows"]]
    assert engines[0] == "transformers" and "minillm eager, triton attention" in engines
    assert "minillm CUDA graph, torch attention" in engines  # torch: the graph row only
    assert "minillm eager, torch attention" not in engines
    assert "minillm CUDA graph, triton attention, GEMV glue off" in engines
    wall = next(r for r in by["decode"]["rows"] if r["engine"].startswith("launch wall"))
    assert wall["eager_step_ms"] > 0 and wall["eager_host_ops"] > 0 and wall["launch_us"] > 0
    assert "cuda_graph_step_ms" not in wall  # its CUDA-graph columns need CUDA
    assert by["decode"]["skipped"] == [  # the compiled step without a graph is no row
        "minillm CUDA graph of the compiled step, triton attention (torch.compile cannot "
        "trace Triton's interpreter)"]
    assert wall["triton_launch_us"] is None and wall["eager_triton_launches"] == 0  # a CPU
    assert wall["kernel_us"] is None and wall["eager_kernel_floor_ms"] == 0  # no kernel floor
    w4 = [r for r in by["decode"]["rows"] if r["engine"].startswith("minillm w4")]
    assert [r["engine"].split(") ")[1] for r in w4] == [
        "eager, triton attention", "CUDA graph, triton attention",
        "CUDA graph, triton attention, GEMV glue off"]
    assert w4[1]["ok"] and all(r["vs_bf16"] > 0 for r in w4)
    assert "ok" not in w4[2]  # the A/B row's tokens are shown, not required to match
    serving_rows = {r["system"]: r for r in by["serving"]["rows"]}
    assert list(serving_rows)[:7] == ["engine continuous, triton",
                                      "engine continuous, triton, 2048-token steps",
                                      "engine continuous, triton, sync scheduling",
                                      "engine continuous, triton, no piecewise graphs",
                                      "engine continuous, triton, eager", "HF one-at-a-time",
                                      "HF static-16"]
    assert list(serving_rows)[-1] == "engine decode step, batch 3, torch (gather)"
    assert serving_rows["engine decode step, batch 3, torch (gather)"]["eager_step_ms"] > 0
    breakdowns = {r["engine"]: r["breakdown"] for r in by["decode"]["rows"] if "breakdown" in r}
    assert list(breakdowns) == ["minillm eager, triton attention",
                                "minillm CUDA graph, triton attention", w4[0]["engine"],
                                w4[1]["engine"],
                                "minillm CUDA graph, triton attention, GEMV glue off",
                                w4[2]["engine"]]
    assert [list(b) for b in breakdowns.values()] == [
        ["eager step, host"], ["graph replay, device"], ["eager step, host"],
        ["graph replay, device"], ["graph replay, device"], ["graph replay, device"]]
    gemv = by["decode_gemv"]["rows"]
    assert {(r["product"], r["weight"]) for r in gemv} == {("qkv", "dense"), ("qkv", "w4")}
    step_row = serving_rows["engine decode step, batch 3"]  # the dry run's largest batch
    assert list(step_row["breakdown"]) == ["graph step, device", "graph step, host",
                                           "eager step, host"]
    parts = [p for b in [*breakdowns.values(), step_row["breakdown"]] for p in b.values()]
    assert all("error" not in p and p["top"] for p in parts), parts
    assert "*minillm CUDA graph, triton attention: graph replay, device* (2 steps" in md.read_text()
    assert "2 of 18 requests" in serving_rows["HF one-at-a-time"]["sampled"]
    assert "1 batch: 16 of 18 requests" in serving_rows["HF static-16"]["sampled"]
    assert "extrapolated" in serving_rows["HF static-16"]["sampled"]
    assert by["pytest"]["rows"][0]["file"] == "tests/test_spec.py"
    assert md.read_text().startswith("CPU dry run") and md.read_text() in res.stdout


@pytest.mark.slow
def test_compile_sweep_compiles_cuda_configurations_without_a_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for only, most, line in (
            ("paged_decode", 2, "sm_80 bf16 paged_decode D=64,H=16,dt=16,lse=1: {'ok': 2} of 2 "
                                "configurations"),
            # 10 W4A16 candidates are 2 programs (SPLIT_K is a run-time argument)
            ("w4a16_gemv", 10, "sm_80 bf16 w4a16_gemv K=1,M=1,N=1,bk=64,dt=16 {'HAS_ZEROS': "
                               "False}: {'ok': 2} of 2 configurations"),
            ("decode_gemv", 2, "sm_80 bf16 decode_gemv K=1,N=0,dt=16,p=2,w=64: {'ok': 2} of 2 "
                               "configurations")):
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_compile_sweep.py"),
                              "--arch", "80", "--only", only, "--most", str(most)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert line in res.stdout, res.stdout


class _Listing(gpu_check.Run):
    """A Run that records the cases a section would run, without running them."""

    def case(self, label, fn):
        self.rows.append(label)


@pytest.mark.parametrize("mode", ["full", "quick"])
def test_the_kernel_grids_cover_what_the_issue_asks(mode):
    import gpu_check_kernels as gk

    def listing(section):
        run = _Listing(mode, torch.device("cuda"), {}, time.monotonic() + 60)
        section.fn(run)
        return run.rows

    flash, paged, varlen, w4, gemv = (listing(s) for s in gk.SECTIONS)
    if mode == "quick":  # a subset: every kernel, one length bucket of FlashAttention
        assert flash and paged and varlen and w4 and gemv and len(flash) <= 4
        return
    for product in ("qkv", "gate_up", "down", "o_proj"):  # each product, both weights
        for weight in ("dense", "w4"):
            assert f"{product} {weight} M=1" in gemv, (product, weight)
    # bf16: both head dims x both GQA shapes x 5 lengths; fp16: each (D, GQA) once
    assert len(flash) == 2 * 2 * 5 + 4
    assert {label.split()[0] for label in flash} == {"bfloat16", "float16"}
    for d in ("D=64", "D=128"):
        for heads in ("9:3", "32:8"):
            for t in ("T=512", "T=1024", "T=2048", "T=4096", "T=8192"):
                assert f"bfloat16 {heads} {d} {t}" in flash, (heads, d, t)
    for labels in (paged, varlen):
        for text in ("B=1 ", "B=256", "context=128", "context=8192"):
            assert any(text in label for label in labels), (text, labels)
    assert "B=1 context=1024" in paged  # the case at 0.59x of gather + SDPA on the H100
    for n, k in ((3072, 576), (49152, 576), (4096, 4096), (14336, 4096)):  # issue 27
        for m in (1, 16):
            assert f"N={n} K={k} M={m} g64" in w4, (n, k, m)
    assert "N=4096 K=4096 M=256 g64" in w4 and "N=4096 K=4096 M=1024 g64" in w4
    for layout in ("N=3072 K=576 M=1 g96 sym", "N=3072 K=576 M=1 g192 sym",
                   "N=4096 K=4096 M=1 g128 sym"):
        assert layout in w4, layout


def test_the_time_boxes_fit_the_plan():
    """Full run (issue 25): every box of a plain run, plus START_UP_S (the machine's start,
    the copies, the processes' start), within 8 minutes; --quick: 3 with ~20 s of start-up
    and one grace period."""
    import gpu_check_kernels
    import gpu_check_model

    sections = gpu_check_kernels.SECTIONS + gpu_check_model.SECTIONS
    full = sum(s.budget_s["full"] for s in sections)  # every section of a plain run has one
    assert full <= gpu_check.TOTAL_BUDGET_S["full"], full
    assert gpu_check.TOTAL_BUDGET_S["full"] + gpu_check.START_UP_S <= 8 * 60
    assert gpu_check.START_UP_S >= 60  # measured: part1 16 s, part2's own start ~40 s
    quick = sum(s.budget_s.get("quick", 0) for s in sections)
    assert quick <= gpu_check.TOTAL_BUDGET_S["quick"], quick
    assert gpu_check.TOTAL_BUDGET_S["quick"] + gpu_check.GRACE_S + 20 <= 3 * 60


def test_the_offline_script_waits_and_limits_within_the_plan():
    """gpu_offline.sh's defaults follow the boxes: part2 waits for the kernel sections no
    longer than their boxes and the process's start, and its outer limit on the model
    sections leaves their boxes, a grace period and a process start."""
    import re

    import gpu_check_kernels
    import gpu_check_model

    text = (ROOT / "benchmarks" / "gpu_offline.sh").read_text()
    kwait = {int(v) for v in re.findall(r"KWAIT:-(\d+)", text)}
    model_s = {int(v) for v in re.findall(r"MODEL_S:-(\d+)", text)}
    assert len(kwait) == 1 and len(model_s) == 1, (kwait, model_s)  # one default each
    kernels = sum(s.budget_s["full"] for s in gpu_check_kernels.SECTIONS)
    models = sum(s.budget_s["full"] for s in gpu_check_model.SECTIONS)
    assert kernels <= kwait.pop() <= kernels + gpu_check.GRACE_S + 20
    assert models + gpu_check.GRACE_S <= model_s.pop() <= models + gpu_check.GRACE_S + 30


def test_every_test_entry_of_the_pytest_section_starts_at_once_and_selects_tests():
    """The pytest box is sized for every entry running at once, and an entry whose -m / -k
    selection matches no test would fail on the GPU (exit 5): collect each one here."""
    import gpu_check_model

    entries = gpu_check_model.TEST_FILES
    dist = [p for p in (ROOT / "tests").glob("test_dist*.py") if "distill" not in p.name]
    assert gpu_check_model.PYTEST_PARALLEL >= len(entries) + len(dist)
    assert len(set(entries)) == len(entries)
    code = """
import json, sys, pytest
out = []
for path, marks, select in json.loads(sys.argv[1]):
    marks = " and ".join(m for m in ("not browser", marks) if m)
    args = [path, "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marks]
    out.append(int(pytest.main(args + (["-k", select] if select else []))))
print("EXIT CODES", json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code, json.dumps(entries)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=600)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("EXIT CODES")]
    assert line, res.stdout[-3000:] + res.stderr[-3000:]
    codes = json.loads(line[0].split(" ", 2)[2])
    assert codes == [0] * len(entries), [e for e, c in zip(entries, codes) if c]


def test_a_pytest_entry_that_selects_nothing_fails_its_row():
    import gpu_check_model

    row = gpu_check_model.pytest_row("tests/test_x.py", "", "nothing", 5,
                                     "5 deselected in 0.1s", 1.0)
    assert row["ok"] is False and "matches none" in row["outcome"]
    row = gpu_check_model.pytest_row("tests/test_x.py", "not slow", "", 5,
                                     "5 deselected in 0.1s", 1.0)  # all slow, on a CPU
    assert row["ok"] is True and row["outcome"] == "no test selected by -m"
    row = gpu_check_model.pytest_row("tests/test_x.py", "", "", 0,
                                     "3 passed, 1 skipped in 2.0s", 2.0)
    assert row["ok"] is True and (row["passed"], row["skipped"], row["failed"]) == (3, 1, 0)


def test_graph_timing_off_cuda_falls_back_to_eager_calls():
    """On a CPU (the dry run) there is no graph: every callable runs, in order, and the time
    is per call and positive; the kernel section's helpers keep to one copy there."""
    import gpu_check_kernels as gk

    from minillm.timing import time_graph

    calls = []
    fns = [lambda i=i: calls.append(i) or time.sleep(1e-3) for i in range(3)]
    per_call = time_graph(fns, replays=2)
    assert calls == [0, 1, 2] * 3  # one untimed pass, then 2 timed ones
    assert per_call > 0
    with pytest.raises(ValueError, match="non-empty sequence of callables"):
        time_graph([])
    with pytest.raises(ValueError, match="replays must be an integer >= 1"):
        time_graph(fns, replays=0)
    run = gpu_check.Run("dry", CPU, {}, time.monotonic() + 60)
    assert gk.input_copies(run, 10) == 1
    seen = []
    assert gk.bench_graph(run, [lambda: seen.append("a"), lambda: seen.append("b")]) > 0
    assert set(seen) == {"a"}  # the dry run times one call, not the copies


# ----------------------------------------------------------------------------- imports


def test_the_check_imports_without_the_serving_stack():
    """A GPU image without FastAPI / uvicorn / prometheus_client runs the whole check: no
    module of it imports them (nor does the serving benchmark's workload)."""
    code = """
import sys
for name in ("fastapi", "uvicorn", "starlette", "prometheus_client"):
    sys.modules[name] = None  # `import fastapi` now raises ImportError
sys.path.insert(0, "benchmarks")
import gpu_check, gpu_check_kernels, gpu_check_model, gpu_check_report, serving, workload
import minillm.serve.workload
assert workload.make_workload is minillm.serve.workload.make_workload
print("imported", len(gpu_check_kernels.SECTIONS + gpu_check_model.SECTIONS), "sections")
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "imported 9 sections" in res.stdout


def test_serve_package_names_load_on_first_use():
    from minillm import serve
    from minillm.serve import ServeConfig, sse

    assert serve.ServeConfig is ServeConfig and serve.sse is sse
    assert callable(serve.create_app) and "ServerProcess" in dir(serve)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        serve.nope  # noqa: B018


# ----------------------------------------------------------------------------- signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_cut_by_a_signal_leaves_a_valid_report_of_its_first_section(tmp_path, signum):
    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu-dry-run", "--sections",
                             "w4a16,pytest", "--out", str(out), "--markdown", str(md)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and json.loads(out.read_text())["sections"][0]["status"] == "ok":
                break  # the first section is done and on disk (rows alone: in progress)
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        proc.send_signal(signum)
        log = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, log[-3000:]
    report = json.loads(out.read_text())
    validate_report(report)
    assert report["finished"] is False and report["ok"]
    first, second = report["sections"]
    assert first["name"] == "w4a16" and first["status"] == "ok" and len(first["rows"]) == 2
    assert second["status"] in ("timeout", "skipped")  # cut in it, or before it
    assert signal.Signals(signum).name in json.dumps(second)
    assert md.read_text().startswith("CPU dry run") and "had not finished" in md.read_text()


# ----------------------------------------------------------------------------- labs


def _notebook(path: Path, *cells: str) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_the_labs_section_is_never_in_quick_and_budgets_a_box_per_lab():
    import gpu_check_labs

    s = gpu_check_labs.section(["01", "05"], 300.0)
    assert s.name == "labs" and "quick" not in s.budget_s
    assert s.budget_s["full"] == 2 * 300 + 30
    assert [p.stem for p in gpu_check_labs.notebooks(["05", "01-roofline"])] == [
        "05-continuous-batching", "01-roofline"]
    assert len(gpu_check_labs.notebooks()) == len(list((ROOT / "solutions").glob("[0-9][0-9]-*.ipynb")))
    with pytest.raises(ValueError, match="no solution notebook '42'"):
        gpu_check_labs.notebooks(["42"])


@pytest.mark.slow
def test_labs_section_dry_run_reports_pass_fail_and_seconds(tmp_path):
    """Through the command line, as the lead runs it on a GPU: one notebook that keeps to its
    device, one that fails; the report has a row each, with seconds and the failing line."""
    good = _notebook(tmp_path / "good.ipynb", "import widgets\nDEVICE, DTYPE = widgets.lab_header('04-paged-attention')",
                     "import os\nassert DEVICE.type == 'cpu' and os.environ['MINILLM_QUICK'] == '1'")
    bad = _notebook(tmp_path / "bad.ipynb", "raise ValueError('this lab broke on the device')")
    out = tmp_path / "labs.json"
    res = _script("--cpu-dry-run", "--sections", "labs", "--labs", f"{good},{bad}", "--out", str(out))
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]  # a lab failed
    report = json.loads(out.read_text())
    validate_report(report)
    (labs,) = report["sections"]
    assert labs["name"] == "labs" and labs["status"] == "failed"
    rows = {r["lab"]: r for r in labs["rows"]}
    assert rows["good"]["ok"] is True and rows["good"]["cells_passed"] == 2
    assert rows["good"]["seconds"] > 0 and rows["good"]["device"] == "cpu"
    assert rows["bad"]["ok"] is False and "this lab broke on the device" in rows["bad"]["error"]
    assert "2 labs run on cpu" in labs["notes"][0] or "of 2 labs run on cpu" in labs["notes"][0]


def assert_gone(pid: int, what: str, outlived: str, wait_s: float = 10.0) -> None:
    """Fail unless process ``pid`` has exited within ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"{what} (pid {pid}) outlived {outlived}")


@pytest.mark.slow
def test_a_lab_past_its_box_is_a_failed_row_and_leaves_no_kernel(tmp_path):
    import gpu_check_labs

    slow = _notebook(tmp_path / "slow.ipynb",
                     "import os, time\nopen(os.environ['PIDFILE'], 'w').write(str(os.getpid()))\ntime.sleep(120)")
    pidfile = tmp_path / "kernel.pid"
    row = gpu_check_labs.run_lab(slow, "cpu", 20.0, {"PIDFILE": str(pidfile)})
    assert row["ok"] is False and row["outcome"].startswith("time box")
    assert row["seconds"] < 40
    if pidfile.exists():  # the kernel got as far as the cell: it must be gone now
        assert_gone(int(pidfile.read_text()), "the notebook's kernel", "its time box")


def test_the_labs_budget_counts_waves_of_parallel_labs():
    import gpu_check_labs

    s = gpu_check_labs.section(["01", "05", "06"], 300.0, parallel=2)
    assert s.budget_s["full"] == 2 * 300 + 30  # two waves: 01 and 05, then 06
    assert gpu_check_labs.section(None, 300.0, parallel=5).budget_s["full"] == 2 * 300 + 30
    assert gpu_check_labs.section(["01"], 300.0, parallel=4, budget_s=200.0).budget_s == {
        "full": 200.0, "dry": 200.0}
    # side by side, the longest (by lab_runtimes.json) start first; unrecorded ones lead
    order = gpu_check_labs.start_order(gpu_check_labs.notebooks(["04", "09", "03"])
                                       + [Path("/x/new-lab.ipynb")])
    assert [p.stem[:2] for p in order] == ["ne", "09", "03", "04"]


def test_a_row_rewrites_the_report_with_the_section_in_progress():
    """rows_too: after every row the report holds the section as it stands ("timeout", or
    "failed" once a row failed), so a run killed mid-section keeps its finished cases."""
    def two_rows(run):
        run.case("first", lambda: {"x": 1, "ok": True})
        run.case("second", lambda: {"x": 2, "ok": False})

    seen = []
    sections = [Section("two", "Two", two_rows, {"dry": 5.0}), _sections([])[0]]
    run_sections(sections, "dry", CPU, {}, on_progress=_progress_reports(seen), rows_too=True)
    first_row, second_row, after = seen[0], seen[1], seen[2]
    assert first_row[0]["status"] == "timeout" and first_row[0]["rows"] == [{"x": 1, "ok": True}]
    assert gpu_check.IN_PROGRESS in first_row[0]["skipped"]
    assert first_row[1]["status"] == "skipped" and "not reached" in first_row[1]["notes"][0]
    assert second_row[0]["status"] == "failed" and len(second_row[0]["rows"]) == 2
    assert after[0]["status"] == "failed" and gpu_check.IN_PROGRESS not in after[0]["skipped"]
    assert len(seen) == 2 + 1 + 1 + 1  # two rows, the section, the next one's row, its end


def _rendezvous(path: Path, mine: str, theirs: str) -> Path:
    """A notebook that marks its start and passes only if its partner starts while it runs
    (waits up to 5 minutes): two of them pass together only when run concurrently."""
    return _notebook(path, f"""import os, pathlib, time
folder = pathlib.Path(os.environ['RENDEZVOUS'])
(folder / '{mine}').touch()
end = time.monotonic() + 300
while not (folder / '{theirs}').exists():
    assert time.monotonic() < end, 'the other lab never started while this one ran'
    time.sleep(0.1)""")


@pytest.mark.slow
def test_labs_run_side_by_side_and_each_row_is_recorded(tmp_path):
    """--lab-parallel 2 in the dry run: two labs that each wait for the other to start both
    pass (so they ran at once), then Lab 04 in the freed slot; a row each, with `alongside`,
    and the note that says they shared the machine."""
    a = _rendezvous(tmp_path / "meet-a.ipynb", "a", "b")
    b = _rendezvous(tmp_path / "meet-b.ipynb", "b", "a")
    out = tmp_path / "labs.json"
    res = _script("--cpu-dry-run", "--sections", "labs", "--labs", f"{a},{b},04",
                  "--lab-parallel", "2", "--out", str(out), env={"RENDEZVOUS": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    validate_report(report)
    (labs,) = report["sections"]
    assert labs["status"] == "ok" and labs["skipped"] == []
    rows = {r["lab"]: r for r in labs["rows"]}
    assert set(rows) == {"meet-a", "meet-b", "04-paged-attention"}
    assert all(r["ok"] is True and r["device"] == "cpu" for r in rows.values())
    assert rows["meet-a"]["alongside"] == rows["meet-b"]["alongside"] == 1
    assert "2 at a time" in labs["notes"][0] and "3 passed" in labs["notes"][0]
    assert "ran concurrently" in labs["notes"][1] and "re-run alone" in labs["notes"][1]


@pytest.mark.slow
def test_labs_the_section_cuts_are_skipped_and_their_kernels_ended(tmp_path):
    """At the section's deadline the labs still running are stopped (process group and
    notebook kernel) and listed as cut, the ones not started as skipped; the rows that
    finished stay. No lab row for them: the section is incomplete, not failed."""
    import gpu_check_labs

    quick, later = (_notebook(tmp_path / f"{name}.ipynb", "x = 1") for name in ("quick", "later"))
    slow = [_notebook(tmp_path / f"slow{i}.ipynb",
                      f"import os, time\nopen(os.environ['PIDS'] + '/{i}', 'w').write(str(os.getpid()))"
                      "\ntime.sleep(300)") for i in (1, 2)]
    pids = tmp_path / "pids"
    pids.mkdir()
    rows = []
    deadline = [None]

    def time_left():  # the section's deadline: once both slow labs' kernels have started
        if deadline[0] is None and len(list(pids.iterdir())) == 2:
            deadline[0] = time.monotonic() + 1
        return 60.0 if deadline[0] is None else deadline[0] - time.monotonic()

    # Two slots: quick and slow1, then slow2 once quick ends; both slots are then held by
    # the slow ones until the deadline, so `later` never starts.
    cut, unstarted = gpu_check_labs.run_labs(
        [quick, *slow, later], "cpu", 200.0, 2, time_left,
        lambda row, s: rows.append(row), {"PIDS": str(pids)})
    assert [r["lab"] for r in rows] == ["quick"] and rows[0]["ok"] is True
    assert sorted(c.split()[0] for c in cut) == ["slow1", "slow2"]
    assert all("cut by the section's time box" in c for c in cut)
    assert unstarted == ["later"]
    for pidfile in pids.iterdir():  # the kernels are gone
        assert_gone(int(pidfile.read_text()), "a cut lab's kernel", "the section")


# ----------------------------------------------------------------------------- offline run


def _pyproject_dependencies() -> list[str]:
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(d).name for d in deps]


def _distribution_of(module: str) -> str:
    import importlib.metadata

    from packaging.utils import canonicalize_name

    dists = importlib.metadata.packages_distributions().get(module)
    assert dists, f"no installed distribution provides the module {module!r}"
    return canonicalize_name(dists[0])


def test_the_lab_wheels_are_what_the_labs_need_beyond_the_gpu_image():
    """gpu_env.LAB_WHEELS (what gpu_offline.sh packs into .gpu/c) is exactly the closure, on
    the image's Python, of what the labs section needs (gpu_check_labs.NEEDED, SERVING and
    minillm's own dependencies) less what the GPU image has: a new dependency after an
    upgrade fails here, not on the GPU; and no wheel shadows an image package."""
    import gpu_check_labs
    import gpu_env

    from packaging.utils import canonicalize_name

    roots = [_distribution_of(m) for m in gpu_check_labs.NEEDED + gpu_check_labs.SERVING]
    closure = gpu_env.dependency_closure(roots + _pyproject_dependencies())
    wheels = {canonicalize_name(n) for n in gpu_env.LAB_WHEELS}
    assert len(wheels) == len(gpu_env.LAB_WHEELS)
    assert sorted(set(closure) - wheels) == [], "needed, neither in the image nor packed"
    assert sorted(wheels - set(closure)) == [], "packed, but nothing needs it"
    assert sorted(wheels & gpu_env.GPU_IMAGE) == [], "would shadow the image's own copy"
    assert len(gpu_env.lab_pins()) == len(wheels)  # each is installed here: a pin


def test_every_module_the_solutions_import_is_in_the_image_or_packed():
    """The imports of every solution notebook (and of the project's own packages, which the
    notebooks import): the standard library, the project, the GPU image, or LAB_WHEELS."""
    import ast

    import gpu_env

    files = [json.loads(nb.read_text()) for nb in (ROOT / "solutions").glob("*.ipynb")]
    sources = ["\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
               for nb in files]
    for package in ("minillm", "widgets", "quizzes"):
        sources += [p.read_text() for p in (ROOT / package).rglob("*.py")]
    modules = set()
    for src in sources:
        lines = [ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))]
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    ours = {"minillm", "widgets", "quizzes"}
    # Optional imports the labs never reach on the GPU: llama.cpp (benchmarks/quant.py's
    # side-by-side, an extra) and the OpenAI client (the server's tests).
    optional = {"llama_cpp", "openai"}
    packed = {n.replace("-", "_") for n in gpu_env.LAB_WHEELS}
    image = {n.replace("-", "_") for n in gpu_env.GPU_IMAGE}
    lacking = []
    for m in sorted(modules - set(sys.stdlib_module_names) - ours - optional):
        dist = _distribution_of(m).replace("-", "_")
        if dist not in packed and dist not in image:
            lacking.append((m, dist))
    assert lacking == [], "imported by the labs, neither in the GPU image nor in LAB_WHEELS"


def test_part3_fits_the_session_after_parts_1_and_2():
    """A session has 15 minutes of device time: a machine start (up to 2), parts 1 and 2
    (gpu_check's 8-minute plan), then part3's outer limit; and the labs run side by side."""
    import re

    text = (ROOT / "benchmarks" / "gpu_offline.sh").read_text()
    labs_s = {int(v) for v in re.findall(r"LABS_S:-(\d+)", text)}
    parallel = {int(v) for v in re.findall(r"LAB_PARALLEL:-(\d+)", text)}
    assert len(labs_s) == 1 and len(parallel) == 1, (labs_s, parallel)
    plan = gpu_check.TOTAL_BUDGET_S["full"] + gpu_check.START_UP_S
    assert 2 * 60 + plan + labs_s.pop() <= 15 * 60
    assert parallel.pop() > 1


@pytest.mark.slow
def test_pack_fills_copy_c_with_the_lab_wheels_the_corpus_and_part3(tmp_path):
    """`gpu_offline.sh pack` (it downloads the wheels from the package index): copy c holds
    one wheel per LAB_WHEELS package, at the installed version, built for the image's Python
    3.12 on x86-64 Linux where binary, the Lee corpus and part3.sh, within 64 MiB with the
    checkout."""
    import gpu_env

    from minillm.data import lee_corpus_path

    env = {**os.environ, "GPU_DIR": str(tmp_path), "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_offline.sh"), "pack"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "copy c: checkout" in res.stdout
    c = tmp_path / "c"
    assert os.access(c / "part3.sh", os.X_OK)
    assert (c / "lee_background.cor").read_bytes() == lee_corpus_path().read_bytes()
    wheels = sorted((c / "whl").glob("*.whl"))
    pins = {p.split("==")[0].replace("-", "_").lower(): p.split("==")[1] for p in gpu_env.lab_pins()}
    got = {w.name.split("-")[0].lower(): w.name.split("-")[1] for w in wheels}
    assert got == pins
    for w in wheels:
        tags = w.name[:-4].split("-")[-3:]  # python, abi, platform
        if tags[2] != "any":
            assert tags[0] in ("cp312", "cp310", "cp311") and "x86_64" in tags[2], w.name
            assert tags[1] in ("cp312", "abi3"), w.name
    checkout = subprocess.run("git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1",
                              shell=True, cwd=ROOT, capture_output=True, text=True).stdout
    size = int(checkout.split()[0]) + sum(f.stat().st_size for f in c.rglob("*") if f.is_file())
    assert size <= 64 * 2**20, size
    script = (c / "part3.sh").read_text()
    for text in ("--lab-parallel", "--lab-budget", "--no-index --no-deps", "MINILLM_CACHE_DIR",
                 "MINILLM_GGUF", "labs.json", "labs.md", "labs.log"):
        assert text in script, text


def _dry_run_section(tmp_path, name: str) -> dict:
    """The one section of `gpu_check.py --cpu-dry-run --sections name`, checked ok."""
    out = tmp_path / f"{name}.json"
    res = _script("--cpu-dry-run", "--sections", name, "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    validate_report(report)
    (section,) = report["sections"]
    assert section["name"] == name and section["status"] == "ok"
    return section


def test_the_gemv_tiles_section_runs_only_when_asked_and_marks_the_shapes_own(tmp_path):
    """`--sections gemv_tiles` times decode GEMV candidates (here in the interpreter, tiny),
    each row with the tiles that ran; a plain run leaves it out (it is outside the 8
    minutes); on a GPU every candidate list holds the shape's own tiles once, w4 first."""
    import gpu_check_kernels
    from minillm.kernels import decode_gemv as dg
    from minillm.kernels import tuning

    tiles = _dry_run_section(tmp_path, "gemv_tiles")
    assert [(r["product"], r["weight"]) for r in tiles["rows"]] == [
        ("down", "w4"), ("o_proj", "w4"), ("down", "dense")]
    assert all(r["ok"] and r["BLOCK_N"] == 2 and "default" in r for r in tiles["rows"])
    assert any(n.startswith("down w4: fastest BLOCK_N=2") for n in tiles["notes"])
    assert "gemv_tiles" not in {s.name for s in gpu_check_kernels.SECTIONS}
    # What a launch on an H100 would get (the interpreter's tiles are its own); every
    # candidate is one the pinned files accept (pin_configs.py --merge then checks it)
    allowed = {repr(tuning.config_to_dict(c)) for c in dg.DECODE_GEMV.configs}
    for weight in ("w4", "dense"):
        for name, n, k, prologue in gpu_check_kernels.GEMV_PRODUCTS:
            cands = gpu_check_kernels.gemv_tile_candidates(weight, k)
            hits = [c for c in cands if gpu_check_kernels.tiles_are_default(
                dg, n, k, prologue, weight, c, torch.bfloat16, arch=90)]
            assert len(hits) == 1, (name, weight)
            assert all(repr(tuning.config_to_dict(dg._config(
                c["block_n"], c["warps"], c.get("unroll", 1), c.get("split", 1)))) in allowed
                for c in cands)


def test_the_w4a16_tiles_section_times_every_candidate_pinned_first(tmp_path):
    """`--sections w4a16_tiles` times W4A16 candidates through w4a16_linear (here in the
    interpreter, tiny: two at M = 1 and two at M = 16, every pinned one first); on an H100
    each of its four shapes gets all 40 candidates at M = 1 and 31 at M = 16, the pinned
    one first and once."""
    import gpu_check_kernels
    from minillm.kernels import w4a16 as wk

    tiles = _dry_run_section(tmp_path, "w4a16_tiles")
    assert [(r["M"], r["default"]) for r in tiles["rows"]] == [
        (1, True), (16, True), (1, False), (16, False)]
    assert all(r["ok"] for r in tiles["rows"])
    assert any(n.startswith("96 x 128, M = 16: fastest ") for n in tiles["notes"])
    assert "w4a16_tiles" not in {s.name for s in gpu_check_kernels.SECTIONS}
    for (n, k), m in itertools.product(gpu_check_kernels.W4A16_TILE_SHAPES, (1, 16)):
        tunable, bucket = wk.bucket_for(m, n, k, 64, torch.bfloat16)
        # the class a call of that shape launches in: what `trying` overrides
        x, qw = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k // 2, dtype=torch.uint8)
        assert wk.bucket_of_call(x, qw, 64) == (tunable, bucket)
        pinned = tunable.config_on(bucket, 90)
        cands = gpu_check_kernels.w4a16_tile_candidates(tunable, pinned)
        assert cands[0] is pinned and len(cands) == len(tunable.configs) == {1: 40, 16: 31}[m]
        assert len({gpu_check_kernels._config_str(c) for c in cands}) == len(cands)


def test_the_compiled_wall_section_counts_and_prices_lab01s_compiled_step(tmp_path):
    """`--sections compiled_wall` (Lab 01's q9 on the device, asked for by name: compiling
    SmolLM2 takes ~25 s on a GPU) measures the compiled step against its floors; here on a
    CPU, where the compiled code launches nothing and no launch from it is priced."""
    import gpu_check_model

    wall = _dry_run_section(tmp_path, "compiled_wall")
    (row,) = wall["rows"]
    assert row["engine"].endswith("torch attention, compiled step")
    assert row["compiled_step_ms"] > 0 and row["compiled_host_ops"] > 0
    assert row["compiled_compiled_launches"] == 0 and row["compiled_launch_us"] is None
    assert row["compiled_predicted_ms"] == pytest.approx(  # a CPU: the two floors added
        row["bytes_floor_ms"] + row["compiled_launch_floor_ms"], rel=1e-3, abs=2e-3)
    assert "eager_step_ms" not in row  # q13's row is the decode section's
    assert "compiled_wall" not in {s.name for s in gpu_check_model.SECTIONS}


def test_gemv_tiles_runs_before_the_model_sections_so_decode_launches_what_it_kept():
    names = [s.name for s in gpu_check.all_sections(Section("labs", "Labs", None, {}))]
    assert names.index("decode_gemv") < names.index("gemv_tiles") < names.index("greedy_match")
    assert names.index("gemv_tiles") < names.index("decode") and names[-1] == "labs"


def test_the_fastest_correct_tiles_of_each_product_are_kept_for_its_class():
    """gemv_tiles keeps, per product and weight, the fastest row that computed the right
    result, as a config of the decode GEMV's class, and keeps it (tuning.record_measured)
    only where the pinned tiles were timed too."""
    import gpu_check_kernels
    from minillm.kernels import decode_gemv as dg

    def row(product, weight, n, k, bn, warps, unroll, us, ok=True, default=False):
        return dict(product=product, weight=weight, N=n, K=k, BLOCK_N=bn, warps=warps,
                    UNROLL=unroll, us=us, ok=ok, default=default)

    rows = [row("down", "w4", 576, 1536, 4, 1, 8, 8.6, default=True),
            row("down", "w4", 576, 1536, 2, 1, 24, 3.9, ok=False),  # wrong: never kept
            row("down", "w4", 576, 1536, 8, 2, 24, 4.4),
            {"product": "down", "weight": "w4", "error": "does not fit"},
            row("o_proj", "dense", 576, 576, 8, 4, 1, 2.5)]
    (b1, c1, best1, own1), (b2, c2, best2, own2) = \
        gpu_check_kernels.fastest_tiles(rows, torch.bfloat16)
    assert b1 == dict(w=64, p=dg.PROLOGUES["silu"], N=0, K=1, dt=16) and best1["us"] == 4.4
    assert (c1.kwargs, c1.num_warps, c1.num_stages) == ({"BLOCK_N": 8, "UNROLL": 24}, 2, 1)
    assert own1["us"] == 8.6
    assert b2 == dict(w=0, p=dg.PROLOGUES["none"], N=0, K=0, dt=16) and own2 is None
    assert (c2.kwargs, c2.num_warps) == ({"BLOCK_N": 8, "UNROLL": 1}, 4)
    # only a product timed against its pinned tiles is kept (o_proj's pinned row is missing)
    assert [b for b, *_ in gpu_check_kernels.kept_tiles(
        gpu_check_kernels.fastest_tiles(rows, torch.bfloat16))] == [b1]
