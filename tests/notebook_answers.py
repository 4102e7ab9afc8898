"""Which quiz answers a solution notebook prints: a question that is not a prediction must not
be answerable by copying a value from the lab's saved outputs (issue 29)."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

from quizzes.questions import expected, load_bank

ROOT = Path(__file__).resolve().parents[1]
# A number followed by a unit of time, rate or ratio (as tests/nbval_sanitize.cfg masks them).
MEASURED = re.compile(r"[-+]?\d+(?:[.,]\d+)*\s*(?:[kKMGTP]?(?:B|FLOP|tok|tokens|req|requests)/s|"
                      r"(?:ms|us|µs|ns|s|min)\b|×|x\b)")


def printed_answers(notebook: str, bank_name: str) -> dict:
    """{question id: the printed numbers close to its answer (within 0.2%)} for the bank's
    computed answers, against every number with 3 or more significant digits the notebook's
    saved outputs print. Round answers and short numbers (two significant figures or fewer:
    0.5, 26, 2.3) are left out, and so are measured quantities (a number with a unit of time,
    rate or ratio): such numbers appear in any text, or in any run, by chance."""
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    printed = " ".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    printed = MEASURED.sub(" ", printed)  # timings differ run to run: a collision with one is chance
    numbers = {float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?:\.\d+)?", printed)
               if len(x.replace(",", "").replace(".", "").lstrip("0")) >= 3}  # 3+ significant digits
    found = {}
    for qid, q in load_bank(bank_name).questions.items():
        if getattr(q, "needs", ()) or not hasattr(q, "unit"):
            continue
        value = float(expected(f"{bank_name}.{qid}"))
        if value == 0 or float(f"{value:.2g}") == round(value, 12):
            continue
        close = sorted(x for x in numbers if abs(x - value) <= 0.002 * abs(value))
        if close:
            found[qid] = close
    return found
