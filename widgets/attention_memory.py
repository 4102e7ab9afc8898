"""Naive-vs-tiled attention memory on CPU (Lab 03): ``measure_memory_row(t)`` measures one
row on this machine (``minillm.measure.attention_peak_growth``, a fresh process per call),
``load_memory_benchmark`` reads the rows ``benchmarks/attention.py`` committed to
``benchmarks/results/attention.json``, and ``format_memory_table`` prints either as a table.

The numbers are measurements, not formulas: each row records the growth of peak RSS during
one attention call, in a fresh process.
"""
from __future__ import annotations

import json
from pathlib import Path

from ._format import fmt_bytes

__all__ = ["MEMORY_RESULTS", "load_memory_benchmark", "format_memory_table", "measure_memory_row"]

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


def measure_memory_row(t: int, device=None) -> dict:
    """One table row measured here: naive and tiled attention at sequence length ``t``
    (SmolLM2's heads, fp32, causal) on ``device`` (None: the default device), each in a
    fresh process on a CPU, by the allocator's peak on CUDA; a few seconds each."""
    from minillm.measure import attention_peak_growth

    return dict(t=t, naive_extra_peak_bytes=attention_peak_growth("naive_attention", t, device=device),
                tiled_extra_peak_bytes=attention_peak_growth("tiled_attention", t, device=device),
                score_matrix_bytes=9 * t * t * 4)


def format_memory_table(rows: list[dict]) -> str:
    """A text table: T, naive and tiled peak growth, their ratio, one score matrix's size."""
    lines = [f"{'T':>6} | {'naive':>10} | {'tiled':>10} | {'naive / tiled':>13} | one [9, T, T] fp32 matrix",
             "-" * 72]
    for r in rows:
        naive, tiled = r["naive_extra_peak_bytes"], r["tiled_extra_peak_bytes"]
        ratio = f"{naive / tiled:>12.1f}×" if tiled > 0 else f"{'—':>13}"  # RSS growth can round to 0
        lines.append(f"{r['t']:>6} | {fmt_bytes(naive):>10} | {fmt_bytes(tiled):>10} | "
                     f"{ratio} | {fmt_bytes(r['score_matrix_bytes'])}")
    return "\n".join(lines)
