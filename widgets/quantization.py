"""The quantization explorer, and the figures of Lab 06.

Pick a method, a bit width and a group size; the explorer quantizes the real model (through
``widgets.quant_runs.QuantRuns``, so every setting is measured once and then comes from the
cache), and shows what it costs and what it buys:

    error   KL from the fp32 model, perplexity, top-1 agreement (a few held-out windows)
    memory  weight bytes a batch-1 decode step reads (packed weights + group scales)
    speed   measured batch-1 decode tok/s, beside the ceiling bandwidth ÷ bytes

    runs = quant_runs.QuantRuns(model, tok)
    widgets.quantization.view(runs, bandwidth=bw)   # controls: method, bits, group_size, lm_head

Pure functions: ``explorer_data`` (the points measured so far and the selected one),
``outlier_data`` (per-layer channel maxima); figures: ``draw_tradeoff`` (KL and tok/s
against bytes per token), ``draw_outliers``. View: ``QuantizationView`` (CSS class
``minillm-quantization``). Nothing here runs a model except through the ``runs`` object.

Invariants: the numbers shown are the QuantResults as measured (or cached), never rescaled;
a setting the package rejects (e.g. group size 128 on SmolLM2) shows the package's own
error message and keeps the last plot.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._view import COLORS, FigureView, figure_image, new_figure

__all__ = ["ExplorerData", "explorer_data", "draw_tradeoff", "OutlierData", "outlier_data",
           "draw_outliers", "figure_image", "QuantizationView", "view", "METHOD_COLORS"]

METHOD_COLORS = {"fp32": COLORS["measured"], "rtn": COLORS["weights"], "gptq": COLORS["kv"],
                 "awq": COLORS["compute"]}
GROUPS = (("per-channel", None), ("g32", 32), ("g64", 64), ("g128", 128))


@dataclasses.dataclass
class ExplorerData:
    points: list            # QuantResults measured so far (fp32 included)
    current: object         # the selected QuantResult
    fp32: object
    bandwidth: float | None  # bytes/s, for the ceiling line
    title: str
    summary: list = dataclasses.field(default_factory=list)


def explorer_data(current, points, fp32, bandwidth: float | None = None) -> ExplorerData:
    """The explorer's state: `current` against fp32, and every point measured so far."""
    pts = {(p.label, p.source): p for p in [fp32, *points]}
    pts.pop((current.label, current.source), None)
    pts[(current.label, current.source)] = current
    mb = current.bytes_per_token / 1e6
    shrink = fp32.bytes_per_token / current.bytes_per_token
    dppl = (current.ppl / fp32.ppl - 1) * 100
    summary = [
        f"{current.label}: KL {current.kl:.4f} nats per token, perplexity {current.ppl:.2f} "
        f"(fp32 {fp32.ppl:.2f}, {dppl:+.1f}%), top-1 agreement {current.top1 * 100:.1f}% "
        f"on {current.tokens} held-out tokens",
        f"memory: {mb:.1f} MB of weights read per token ({shrink:.2f}× less than fp32's "
        f"{fp32.bytes_per_token / 1e6:.1f} MB)",
    ]
    if current.tok_s:
        line = f"speed: {current.tok_s:.1f} tok/s batch-1 decode"
        if fp32.tok_s:
            line += f" ({current.tok_s / fp32.tok_s:.2f}× fp32's {fp32.tok_s:.1f} tok/s)"
        if bandwidth:
            ceiling = bandwidth / current.bytes_per_token
            line += f"; ceiling bandwidth ÷ bytes = {ceiling:.0f} tok/s, reached {current.tok_s / ceiling * 100:.0f}%"
        summary.append(line)
    if current.source != "measured":
        summary.append(f"({current.source}: measured earlier with the same settings)")
    title = f"{current.label}: error, memory and speed"
    return ExplorerData(list(pts.values()), current, fp32, bandwidth, title, summary)


def draw_tradeoff(data: ExplorerData, fig=None):
    """Left: KL to fp32 against MB read per token (log KL). Right: decode tok/s against the
    same bytes, with the ceiling bandwidth ÷ bytes. The selected setting is ringed."""
    fig = fig or new_figure(11, 4.2)
    ax, ax2 = fig.subplots(1, 2)
    floor = min([p.kl for p in data.points if p.kl > 0] or [1e-4]) / 3
    for p in data.points:
        color = METHOD_COLORS.get(p.method, COLORS["grey"])
        x = p.bytes_per_token / 1e6
        ax.scatter(x, max(p.kl, floor), color=color, s=40, zorder=3)
        ax.annotate(p.label.replace(f"{p.method} ", "") if p.method != "fp32" else "fp32",
                    (x, max(p.kl, floor)), fontsize=7, xytext=(4, 3), textcoords="offset points")
        if p.tok_s:
            ax2.scatter(x, p.tok_s, color=color, s=40, zorder=3)
    cur = data.current
    for a, y in ((ax, max(cur.kl, floor)), (ax2, cur.tok_s)):
        if y:
            a.scatter(cur.bytes_per_token / 1e6, y, s=180, facecolors="none",
                      edgecolors=COLORS["bound"], linewidths=2, zorder=4)
    for m, color in METHOD_COLORS.items():
        if any(p.method == m for p in data.points):
            ax.scatter([], [], color=color, label=m)
    ax.set_yscale("log")
    ax.set_xlabel("weight MB read per token")
    ax.set_ylabel("KL(fp32 ‖ quantized), nats per token (fp32 drawn at the bottom)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3, which="both")
    xs = np.linspace(min(p.bytes_per_token for p in data.points) * 0.8,
                     max(p.bytes_per_token for p in data.points) * 1.1, 100)
    if data.bandwidth:
        ax2.plot(xs / 1e6, data.bandwidth / xs, "--", color=COLORS["bound"],
                 label="ceiling: bandwidth ÷ bytes")
        ax2.legend(fontsize=8)
    ax2.set_xlabel("weight MB read per token")
    ax2.set_ylabel("batch-1 decode tok/s (measured)")
    ax2.grid(True, alpha=0.3)
    return fig


# --------------------------------------------------------------------------- outliers


@dataclasses.dataclass
class OutlierData:
    name: str
    maxima: np.ndarray        # [layers, channels] max |x|
    ratio: np.ndarray         # per layer: the largest channel ÷ the median channel
    outliers: np.ndarray      # per layer: channels above `factor` × the layer's median
    factor: float
    summary: list


def outlier_data(maxima, name: str = "qkv_proj", factor: float = 20.0) -> OutlierData:
    """Per-layer statistics of `maxima[name]` ([layers, channels] from
    ``quant_runs.activation_maxima``): how far the largest channel sits above the median."""
    m = np.asarray(maxima[name], dtype=np.float64)
    med = np.median(m, axis=1)
    ratio = m.max(1) / med
    outliers = (m > factor * med[:, None]).sum(1)
    channels = m.shape[1]
    top = np.argsort(-m.max(0))[:3]
    summary = [
        f"input of {name}: {m.shape[0]} layers × {channels} channels; the largest channel is "
        f"{np.median(ratio):.0f}× the median channel in a typical layer, up to {ratio.max():.0f}× "
        f"(layer {int(ratio.argmax())})",
        f"channels above {factor:.0f}× their layer's median: {int(outliers.sum())} of "
        f"{m.size} ({outliers.sum() / m.size * 100:.2f}%); the loudest channels overall: "
        + ", ".join(f"{int(c)} (max {m[:, c].max():.1f})" for c in top),
    ]
    return OutlierData(name, m, ratio, outliers, factor, summary)


def draw_outliers(data: OutlierData, fig=None):
    """Left: heatmap of max |x| per layer and channel (log colour). Right: per layer, the
    largest channel over the median channel."""
    from matplotlib.colors import LogNorm

    fig = fig or new_figure(12, 4.2)
    ax, ax2 = fig.subplots(1, 2, width_ratios=(3, 1))
    img = ax.imshow(np.maximum(data.maxima, 1e-3), aspect="auto", interpolation="nearest",
                    norm=LogNorm(), cmap="magma")
    ax.set_xlabel(f"input channel of {data.name}")
    ax.set_ylabel("layer")
    fig.colorbar(img, ax=ax, label="max |x| over the window")
    layers = np.arange(len(data.ratio))
    ax2.barh(layers, data.ratio, color=COLORS["bound"])
    ax2.set_xscale("log")
    ax2.invert_yaxis()
    ax2.set_xlabel("largest ÷ median channel")
    ax2.set_ylabel("layer")
    ax2.grid(True, alpha=0.3, axis="x")
    return fig


# --------------------------------------------------------------------------- the view


class QuantizationView(FigureView):
    """Controls: ``method`` (rtn, gptq, awq), ``bits``, ``group_size`` and ``lm_head`` (keep
    the head float, or quantize it like the layers). ``runs`` measures: anything with
    ``measure(method, bits, group_size, lm_head) -> QuantResult`` and ``fp32()``."""

    css = "minillm-quantization"

    def __init__(self, runs, method: str = "rtn", bits: int = 4, group_size=64,
                 lm_head: bool = False, bandwidth: float | None = None):
        import ipywidgets as w

        self.runs, self.bandwidth = runs, bandwidth
        self.points: dict[str, object] = {}
        controls = {
            "method": w.Dropdown(options=["rtn", "gptq", "awq"], value=method, description="method"),
            "bits": w.Dropdown(options=[8, 6, 4, 3, 2], value=bits, description="bits"),
            "group_size": w.Dropdown(options=list(GROUPS), value=group_size, description="group size"),
            "lm_head": w.Checkbox(value=lm_head, description="quantize the LM head too"),
        }
        super().__init__(controls)

    def compute(self) -> ExplorerData:
        c = self.controls
        fp32 = self.runs.fp32()
        current = self.runs.measure(c["method"].value, c["bits"].value, c["group_size"].value,
                                    bool(c["lm_head"].value))
        self.points[current.label] = current
        return explorer_data(current, list(self.points.values()), fp32, self.bandwidth)

    def draw(self, data):
        return draw_tradeoff(data)


def view(runs, **kwargs) -> QuantizationView:
    """``display(widgets.quantization.view(runs, bandwidth=bw))``."""
    return QuantizationView(runs, **kwargs)
