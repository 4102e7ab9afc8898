"""``show_mismatch``: yours next to the reference, mismatching cells marked.

Used by checks (``compare(..., show=True)``) and directly in labs where the
picture matters (the Triton lab shows which tiles of an output are wrong).

Layout: values become a 2-D grid. A 1-D vector is wrapped into rows of
``max_cols``; more dimensions are flattened into rows labelled with their
leading indices. Large grids show a window that starts just above the first
mismatching row. Text output marks bad cells with ``*`` and bad rows with
``✗``; HTML output colours them.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from .values import _as_numpy, describe

__all__ = ["show_mismatch", "MismatchView"]


class MismatchView:
    def __init__(self, yours: Any, reference: Any, atol: float, rtol: float, max_rows: int, max_cols: int,
                 title: str):
        self.title = title
        self.atol, self.rtol = atol, rtol
        self.problem = ""
        self.n_bad = 0
        ys = tuple(yours.shape) if hasattr(yours, "shape") else np.shape(yours)
        rs = tuple(reference.shape) if hasattr(reference, "shape") else np.shape(reference)
        if ys != rs:
            self.problem = f"shapes differ: yours {describe(yours)}, reference {describe(reference)}"
            return
        a = _as_numpy(yours).astype(np.float64)
        b = _as_numpy(reference).astype(np.float64)
        self.size = a.size
        bad = ~np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        self.n_bad = int(bad.sum())
        # to a 2-D grid with row labels
        pad_mask = np.zeros(a.shape, dtype=bool)
        if a.ndim == 0:
            a, b, bad = a.reshape(1, 1), b.reshape(1, 1), bad.reshape(1, 1)
            pad_mask = pad_mask.reshape(1, 1)
            labels = ["[]"]
        elif a.ndim == 1:
            n = a.shape[0]
            width = max_cols
            pad = (-n) % width
            a, b = np.pad(a, (0, pad), constant_values=np.nan), np.pad(b, (0, pad), constant_values=np.nan)
            bad = np.pad(bad, (0, pad), constant_values=False)
            pad_mask = np.pad(pad_mask, (0, pad), constant_values=True).reshape(-1, width)
            a, b, bad = a.reshape(-1, width), b.reshape(-1, width), bad.reshape(-1, width)
            labels = [f"[{i * width}:{min(n, (i + 1) * width)}]" for i in range(a.shape[0])]
        else:
            lead = a.shape[:-1]
            labels = ["[" + ", ".join(map(str, idx)) + "]" for idx in np.ndindex(*lead)]
            a, b, bad = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), bad.reshape(-1, bad.shape[-1])
            pad_mask = pad_mask.reshape(a.shape)
        self.nrows, self.ncols = a.shape
        bad_rows = np.flatnonzero(bad.any(axis=1))
        first_row = int(bad_rows[0]) if len(bad_rows) else 0
        r0 = 0 if self.nrows <= max_rows else min(max(0, first_row - 1), self.nrows - max_rows)
        first_col = int(np.flatnonzero(bad[first_row])[0]) if len(bad_rows) else 0
        c0 = 0 if self.ncols <= max_cols else min(max(0, first_col - 1), self.ncols - max_cols)
        self.rows = range(r0, min(self.nrows, r0 + max_rows))
        self.cols = range(c0, min(self.ncols, c0 + max_cols))
        self.a, self.b, self.bad, self.labels, self.pad = a, b, bad, labels, pad_mask
        self.bad_rows = set(int(r) for r in bad_rows)

    def _summary(self) -> str:
        if self.problem:
            return f"{self.title}: {self.problem}"
        if self.n_bad == 0:
            return f"{self.title}: all {self.size} elements match (atol {self.atol:g}, rtol {self.rtol:g})"
        return (f"{self.title}: {self.n_bad} of {self.size} elements differ "
                f"(atol {self.atol:g}, rtol {self.rtol:g}); rows {self.rows.start}-{self.rows.stop - 1} "
                f"of {self.nrows}, cols {self.cols.start}-{self.cols.stop - 1} of {self.ncols}")

    def text(self) -> str:
        lines = [self._summary()]
        if self.problem:
            return lines[0]
        lw = max(len(self.labels[r]) for r in self.rows)
        block = 12 * len(self.cols)
        lines.append(f"  {'':{lw}} {'yours (* = differs)':<{block}}  | reference")
        for r in self.rows:
            mark = "✗" if r in self.bad_rows else " "
            ys = "".join(self._num(r, c, self.a) + ("*" if self.bad[r, c] else " ") for c in self.cols)
            rs = "".join(self._num(r, c, self.b) + " " for c in self.cols)
            lines.append(f"{mark} {self.labels[r]:>{lw}} {ys}  | {rs.rstrip()}")
        return "\n".join(lines)

    def _num(self, r: int, c: int, grid: np.ndarray) -> str:
        if self.pad[r, c]:
            return " " * 11
        return f"{grid[r, c]:>11.4g}"

    __str__ = text

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        if self.problem:
            return f'<div class="quiz-mismatch"><b>{html.escape(self._summary())}</b></div>'
        bad_bg, bad_row = "background:#f8d7da;color:#842029;font-weight:bold", "color:#b3261e;font-weight:bold"
        head = "".join(f"<th>{c}</th>" for c in self.cols)
        out = [f'<div class="quiz-mismatch"><div>{html.escape(self._summary())}</div>',
               '<table style="border-collapse:collapse;font-family:monospace;font-size:12px">',
               f'<tr><th></th><th colspan="{len(self.cols)}">yours</th><th style="width:1em"></th>'
               f'<th colspan="{len(self.cols)}">reference</th></tr>',
               f"<tr><th></th>{head}<th></th>{head}</tr>"]
        for r in self.rows:
            style = bad_row if r in self.bad_rows else ""
            cells = "".join(
                f'<td style="padding:0 4px;{bad_bg if self.bad[r, c] else ""}">{self._num(r, c, self.a).strip()}</td>'
                for c in self.cols)
            refs = "".join(f'<td style="padding:0 4px">{self._num(r, c, self.b).strip()}</td>' for c in self.cols)
            out.append(f'<tr><th style="{style}">{html.escape(self.labels[r])}</th>{cells}<td></td>{refs}</tr>')
        out.append("</table></div>")
        return "".join(out)


def show_mismatch(yours: Any, reference: Any, *, atol: float = 1e-5, rtol: float = 1e-5, max_rows: int = 12,
                  max_cols: int = 8, title: str = "yours vs reference") -> MismatchView:
    """Return a view (text via print/str, HTML when displayed in Jupyter) of yours vs reference."""
    return MismatchView(yours, reference, atol, rtol, max_rows, max_cols, title)
