"""The naive-vs-tiled attention memory that ``benchmarks/attention.py`` measured (Lab 03):
``load_memory_benchmark`` reads its rows from ``benchmarks/results/attention.json`` and
``format_memory_table`` prints them as a table.

The numbers are measurements, not formulas: each row ran in a fresh process and records
the growth of peak RSS during one attention call, on CPU. Re-measure with
``python benchmarks/attention.py``; nothing here measures anything.
"""
from __future__ import annotations

import json
from pathlib import Path

from ._format import fmt_bytes

__all__ = ["MEMORY_RESULTS", "load_memory_benchmark", "format_memory_table"]

MEMORY_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "attention.json"


def load_memory_benchmark(path=None) -> tuple[list[dict], dict]:
    """(rows, hardware) of the naive-vs-tiled memory measurement in ``benchmarks/attention.py``'s
    results: each row has ``t``, ``naive_extra_peak_bytes``, ``tiled_extra_peak_bytes`` and
    ``score_matrix_bytes`` (one fp32 [9, T, T] matrix), measured on CPU with B=1, Hq=9, Hkv=3,
    D=64, causal. Re-measure with ``python benchmarks/attention.py``."""
    path = Path(path) if path else MEMORY_RESULTS
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `python benchmarks/attention.py` "
                                "(from the repository root) to measure it.")
    report = json.loads(path.read_text(encoding="utf-8"))
    rows = [r for r in report.get("memory", []) if "naive_extra_peak_bytes" in r]
    if not rows:
        raise ValueError(f"{path} holds no CPU naive-vs-tiled memory rows (mode "
                         f"{report.get('mode')!r}); run `python benchmarks/attention.py` on a CPU.")
    return rows, report.get("hardware", {})


def format_memory_table(rows: list[dict]) -> str:
    """A text table: T, naive and tiled peak growth, their ratio, one score matrix's size."""
    lines = [f"{'T':>6} | {'naive':>10} | {'tiled':>10} | {'naive / tiled':>13} | one [9, T, T] fp32 matrix",
             "-" * 72]
    for r in rows:
        naive, tiled = r["naive_extra_peak_bytes"], r["tiled_extra_peak_bytes"]
        lines.append(f"{r['t']:>6} | {fmt_bytes(naive):>10} | {fmt_bytes(tiled):>10} | "
                     f"{naive / tiled:>12.1f}× | {fmt_bytes(r['score_matrix_bytes'])}")
    return "\n".join(lines)
