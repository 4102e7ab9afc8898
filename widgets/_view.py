"""The figures and the view every widget is built on: ``new_figure``/``figure_png`` and the
``FigureView`` base class that ties controls, a pure data function and a matplotlib figure.
``COLORS`` is the palette the figures share.

Invariants:
- Data functions are pure (no display, no global state); views only call them and draw.
- Figures are built with ``matplotlib.figure.Figure`` (never ``pyplot``), rendered to PNG by
  the Agg canvas and placed into an ``ipywidgets.Output`` by replacing its ``outputs`` in one
  assignment, so a re-render neither flickers nor depends on the notebook's backend, and
  works the same outside a kernel (tests).
- Every control has a stable ``description`` and the CSS class ``minillm-<widget>-<name>``;
  the whole view's box has ``minillm-<widget>``, the plot ``minillm-<widget>-plot`` and the
  text summary ``minillm-<widget>-summary``.
"""
from __future__ import annotations

import base64
import html
import io

__all__ = ["COLORS", "new_figure", "figure_png", "figure_image", "FigureView"]

COLORS = {"weights": "#4C72B0", "kv": "#DD8452", "compute": "#55A868", "bound": "#C44E52",
          "measured": "#222222", "machine": "#4C72B0", "gpu": "#C44E52", "grey": "#999999"}


def new_figure(width: float = 10.0, height: float = 5.0):
    """A pyplot-free figure with an Agg canvas (safe in tests and in any notebook backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def figure_image(fig, dpi: int = 100):
    """A figure as an ``IPython.display.Image`` (PNG), for ``display(...)`` in a notebook: a
    pyplot-free figure has no inline display of its own."""
    from IPython.display import Image

    return Image(figure_png(fig, dpi))


class FigureView:
    """Controls + pure data function + figure, shown in an ``Output`` that re-renders on change.

    Subclasses set ``css`` and implement ``compute() -> data`` (reading ``self.controls``)
    and ``draw(data) -> Figure``. For tests and scripts:

    - ``controls``: dict of the ipywidgets controls by name; set ``.value`` to drive the view;
    - ``data``: the last computed data; ``figure``: the last Figure; ``png``: its bytes;
    - ``renders``: how many times it re-rendered; ``error``: the last error message or None;
    - ``output`` (the plot), ``summary`` (an HTML line of key numbers), ``box`` (everything).
    """

    css = "minillm-view"

    def __init__(self, controls: dict, layout_rows: list | None = None):
        import ipywidgets as w

        self.controls = controls
        for name, control in controls.items():
            control.add_class(f"{self.css}-{name.replace('_', '-')}")
            control.style.description_width = "initial"
            if hasattr(control, "continuous_update"):
                control.continuous_update = False
        self.output = w.Output(layout=w.Layout(min_height="300px"))
        self.output.add_class(f"{self.css}-plot")
        self.summary = w.HTML()
        self.summary.add_class(f"{self.css}-summary")
        rows = layout_rows or [list(controls.values())]
        self.box = w.VBox([w.HBox(row, layout=w.Layout(flex_flow="row wrap")) for row in rows]
                          + [self.output, self.summary])
        self.box.add_class(self.css)
        self.data = None
        self.figure = None
        self.png = b""
        self.renders = 0
        self.error = None
        for control in controls.values():
            control.observe(self._on_change, names="value")
        self.update()

    # hooks ------------------------------------------------------------------
    def compute(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def draw(self, data):  # pragma: no cover - abstract
        raise NotImplementedError

    def summary_lines(self, data) -> list[str]:
        return list(getattr(data, "summary", []))

    # machinery --------------------------------------------------------------
    def _on_change(self, change) -> None:
        self.update()

    def update(self) -> None:
        """Recompute the data, redraw the figure and put it in the output."""
        try:
            data = self.compute()
        except ValueError as err:  # a combination the formulas reject: say so, keep the plot
            self.error = str(err)
            self.summary.value = f'<span style="color:#b3261e">{html.escape(self.error)}</span>'
            return
        self.error = None
        self.data = data
        fig = self.draw(data)
        self.figure = fig
        self.png = figure_png(fig)
        title = getattr(data, "title", "figure")
        self.output.outputs = ({
            "output_type": "display_data",
            "data": {"image/png": base64.b64encode(self.png).decode("ascii"),
                     "text/plain": f"<figure: {title}>"},
            "metadata": {},
        },)
        self.summary.value = "<br>".join(html.escape(line) for line in self.summary_lines(data))
        self.renders += 1

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)
