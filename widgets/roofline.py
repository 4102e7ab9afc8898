"""The roofline (Lab 01): this machine's measured ceilings and real minillm operations on it.

    attainable FLOP/s = min(peak, intensity · bandwidth);   ridge = peak / bandwidth

Points are ``minillm.measure.OpMeasurement`` objects measured once (decode steps at batch
1..64, a prefill, a matmul, a matvec, decode attention) and placed at (intensity, achieved
FLOP/s). A catalog GPU can be drawn beside the machine: the same operations are then placed
*on its roof* at the intensity they would have in the chosen dtype (a roofline prediction,
not a measurement, and drawn hollow to say so).

    view = widgets.roofline.view(profile, measurements)   # display(view) in a notebook
    view.controls["batch"].value = 16                      # what the slider does

Pure functions: ``attainable_flops``, ``decode_crossover_batch``, ``roofline_data``;
figure: ``draw_roofline``; view: ``RooflineView`` (CSS class ``minillm-roofline``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from minillm import calc, hardware

from ._format import fmt_bandwidth, fmt_flops
from ._hardware import Limits, check_same_device, gpu_limits, machine_limits, measured_footnote
from ._models import display_name
from ._view import COLORS, FigureView, new_figure

__all__ = ["Roof", "RooflinePoint", "RooflineData", "attainable_flops", "decode_crossover_batch",
           "roofline_data", "draw_roofline", "RooflineView", "view", "NO_GPU"]

NO_GPU = "none"
_MARKERS = {"decode": "o", "prefill": "s", "matmul": "^", "matvec": "v", "attention": "D"}
_KIND_COLORS = {"decode": "#4C72B0", "prefill": "#55A868", "matmul": "#8172B3",
                "matvec": "#937860", "attention": "#DD8452"}


@dataclasses.dataclass
class Roof:
    label: str
    peak_flops: float
    bandwidth: float
    ridge: float
    intensity: np.ndarray   # x samples, FLOPs/byte
    attainable: np.ndarray  # min(peak, x · bandwidth), FLOP/s
    measured: bool
    note: str = ""


@dataclasses.dataclass
class RooflinePoint:
    name: str
    kind: str
    batch: int
    intensity: float        # FLOPs/byte
    flops_per_s: float      # achieved (measured) or attainable (predicted)
    attainable: float       # the roof above this intensity
    fraction: float         # flops_per_s / attainable
    bound: str              # "memory" or "compute": which side of the ridge
    seconds: float | None   # measured time, None for predictions


@dataclasses.dataclass
class RooflineData:
    machine: Roof
    points: list            # RooflinePoint, measured on this machine
    gpu: Roof | None
    predicted: list         # RooflinePoint, the same ops on the GPU's roof (not measured)
    highlight: RooflinePoint | None
    decode_crossover: float | None      # batch where decode meets this machine's ridge
    gpu_decode_crossover: float | None  # ... and the GPU's ridge in its dtype
    dtype: str                          # dtype of the measurements (roof of this machine)
    gpu_dtype: str | None
    xlim: tuple
    ylim: tuple
    title: str
    xlabel: str = "arithmetic intensity (FLOPs / byte moved)"
    ylabel: str = "FLOP/s"
    summary: list = dataclasses.field(default_factory=list)
    footnote: str = ""


def attainable_flops(intensity, peak_flops: float, bandwidth: float):
    """``min(peak, intensity · bandwidth)``, elementwise over an array (``calc.roofline_flops``
    for one number)."""
    return np.minimum(peak_flops, np.asarray(intensity, dtype=float) * bandwidth)


def decode_crossover_batch(flops_per_seq: float, weight_bytes: float, kv_bytes_per_seq: float,
                           ridge: float) -> float:
    """Batch B where a decode step's intensity ``B·f / (W + B·k)`` reaches ``ridge``
    (``calc.decode_crossover_batch``; ``math.inf`` if it never does)."""
    return calc.decode_crossover_batch(flops_per_seq, weight_bytes, kv_bytes_per_seq, ridge)


def _roof(limits: Limits, xs: np.ndarray) -> Roof:
    return Roof(limits.label, limits.peak_flops, limits.bandwidth,
                calc.ridge_point(limits.peak_flops, limits.bandwidth), xs,
                attainable_flops(xs, limits.peak_flops, limits.bandwidth), limits.measured,
                limits.note)


def _point(name, kind, batch, intensity, flops, roof: Roof, seconds) -> RooflinePoint:
    att = float(attainable_flops(intensity, roof.peak_flops, roof.bandwidth))
    return RooflinePoint(name, kind, batch, intensity, flops, att, flops / att,
                         "memory" if intensity < roof.ridge else "compute", seconds)


def _decode_crossover(decodes, ridge: float, scale: float = 1.0) -> float | None:
    """Crossover batch from a decode measurement's byte breakdown, bytes scaled by ``scale``."""
    for op in decodes:
        d = op.details
        if {"flops_per_seq", "weight_bytes", "kv_bytes_per_seq"} <= set(d):
            return decode_crossover_batch(d["flops_per_seq"], d["weight_bytes"] * scale,
                                          d["kv_bytes_per_seq"] * scale, ridge)
    return None


def roofline_data(profile, measurements: Sequence, hardware_name: str | None = NO_GPU,
                  gpu_dtype: str = "bf16", highlight_batch: int | None = None) -> RooflineData:
    """Everything the roofline figure shows, from a ``MachineProfile`` and measured ops.

    ``hardware_name``: a ``minillm.hardware.CATALOG`` name to draw beside this machine, or
    ``"none"``. ``gpu_dtype``: the dtype the GPU would run in ("bf16", "fp16", "fp8").
    ``highlight_batch``: a measured decode batch size to single out.
    """
    ops = list(measurements)
    check_same_device(profile, ops)
    dtype = ops[0].dtype if ops else "float32"
    mlim = machine_limits(profile, dtype)

    gl = None
    if hardware_name not in (None, NO_GPU):
        gl = gpu_limits(hardware_name, gpu_dtype)
    intensities = [op.intensity for op in ops] or [1.0]
    ridges = [mlim.peak_flops / mlim.bandwidth] + ([gl.peak_flops / gl.bandwidth] if gl else [])
    gpu_db = None
    if gl is not None:
        gpu_db = calc.DTYPE_BYTES.get(str(gpu_dtype).lower(), 2)
        if gl.note and "fp8" in gl.note:
            gpu_db = 2  # fell back to bf16
        intensities += [op.intensity * op.dtype_bytes / gpu_db for op in ops]
    lo = 10 ** math.floor(math.log10(min(intensities + ridges) / 2))
    hi = 10 ** math.ceil(math.log10(max(intensities + ridges) * 3))
    xs = np.logspace(math.log10(lo), math.log10(hi), 256)

    machine = _roof(mlim, xs)
    points = [_point(op.name, op.kind, op.batch, op.intensity, op.flops_per_s, machine,
                     op.seconds) for op in ops]
    decodes = sorted((op for op in ops if op.kind == "decode"), key=lambda o: o.batch)
    crossover = _decode_crossover(decodes, machine.ridge)

    gpu, predicted, gpu_cross = None, [], None
    if gl is not None:
        gpu = _roof(gl, xs)
        for op in ops:
            scale = gpu_db / op.dtype_bytes
            x = op.intensity / scale
            att = float(attainable_flops(x, gpu.peak_flops, gpu.bandwidth))
            predicted.append(_point(op.name, op.kind, op.batch, x, att, gpu, None))
        if decodes:
            gpu_cross = _decode_crossover(decodes, gpu.ridge, gpu_db / decodes[0].dtype_bytes)

    highlight = None
    if highlight_batch is not None:
        for p in points:
            if p.kind == "decode" and p.batch == highlight_batch:
                highlight = p
        if highlight is None:
            raise ValueError(f"highlight_batch must be a measured decode batch size "
                             f"({sorted(p.batch for p in points if p.kind == 'decode')}); "
                             f"got {highlight_batch!r}.")

    ys = [p.flops_per_s for p in points] + [machine.peak_flops] + [machine.attainable[0]]
    if gpu is not None:
        ys += [gpu.peak_flops] + [p.flops_per_s for p in predicted]
    ylim = (10 ** math.floor(math.log10(min(ys) / 2)), 10 ** math.ceil(math.log10(max(ys) * 2)))

    summary = [f"This machine: {mlim.label}: {fmt_bandwidth(mlim.bandwidth)} and "
               f"{fmt_flops(mlim.peak_flops)} {dtype} matmul, measured; ridge point "
               f"{machine.ridge:.3g} FLOP/byte."]
    if crossover is not None:
        model = display_name(decodes[0].details.get("model", "the model"),
                             decodes[0].details.get("num_params"))
        ctx = decodes[0].details.get("context_len")
        where = ("never: the KV cache alone keeps decode below the ridge" if crossover == math.inf
                 else f"at batch ≈ {crossover:.3g}")
        summary.append(f"Decode of {model} ({dtype}, {ctx}-token context) stops being "
                       f"bandwidth-bound {where} on this machine.")
    if highlight is not None:
        summary.append(f"{highlight.name}: {highlight.seconds * 1e3:.1f} ms per step, "
                       f"{highlight.intensity:.3g} FLOP/byte, {fmt_flops(highlight.flops_per_s)} "
                       f"= {100 * highlight.fraction:.0f}% of the roof above it "
                       f"({highlight.bound}-bound side of the ridge).")
    if gpu is not None:
        summary.append(f"{gpu.label} in {gpu_dtype}: {fmt_bandwidth(gpu.bandwidth)}, "
                       f"{fmt_flops(gpu.peak_flops)} (datasheet), ridge {gpu.ridge:.3g} FLOP/byte"
                       + (f"; decode would turn compute-bound at batch ≈ {gpu_cross:.3g}"
                          if gpu_cross not in (None, math.inf) else "")
                       + ". Hollow markers: the same operations on its roof (predicted, not measured).")
        if gpu.note:
            summary.append(f"Note: {gpu.note}.")
    above = [p.name for p in points if p.fraction > 1.1]
    if above:
        summary.append(f"Above the measured roof: {', '.join(above)}. Either the ceiling was "
                       f"measured while the machine was busy, or the operands fit in cache "
                       f"(faster than main memory): measure again to tell which.")
    if mlim.note:
        summary.append(f"Note: {mlim.note}.")
    title = f"Roofline of {mlim.label}" + (f" vs {gpu.label} ({gpu_dtype})" if gpu else "")
    return RooflineData(machine, points, gpu, predicted, highlight, crossover, gpu_cross,
                        dtype, gpu_dtype if gpu else None, (lo, hi), ylim, title,
                        summary=summary, footnote=measured_footnote(profile))


def draw_roofline(data: RooflineData, fig=None):
    """Log-log roofline figure of ``data``; returns the matplotlib Figure."""
    fig = fig or new_figure(10, 6.4)
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_yscale("log")
    m = data.machine
    ax.plot(m.intensity, m.attainable, color=COLORS["machine"], lw=2.5,
            label=f"this machine, measured: {fmt_bandwidth(m.bandwidth)}, "
                  f"{fmt_flops(m.peak_flops)} ({data.dtype})")
    ax.axvspan(data.xlim[0], m.ridge, color=COLORS["machine"], alpha=0.06)
    ax.axvline(m.ridge, color=COLORS["machine"], ls=":", lw=1)
    ax.annotate(f"ridge {m.ridge:.3g} FLOP/B", (m.ridge, m.peak_flops), xytext=(4, 6),
                textcoords="offset points", color=COLORS["machine"], fontsize=9)
    ax.text(data.xlim[0] * 1.15, data.ylim[1] / 1.6, "memory-bound (left of the ridge)",
            fontsize=8, color="#555555", va="top")
    if data.gpu is not None:
        g = data.gpu
        ax.plot(g.intensity, g.attainable, color=COLORS["gpu"], lw=2, ls="--",
                label=f"{g.label} ({data.gpu_dtype}), datasheet: {fmt_bandwidth(g.bandwidth)}, "
                      f"{fmt_flops(g.peak_flops)}")
        ax.axvline(g.ridge, color=COLORS["gpu"], ls=":", lw=1)
        ax.annotate(f"ridge {g.ridge:.3g}", (g.ridge, g.peak_flops), xytext=(4, 6),
                    textcoords="offset points", color=COLORS["gpu"], fontsize=9)
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="#555555",
                   label=f"hollow: the same ops on {g.label}'s roof (predicted)")
        for p in data.predicted:
            ax.scatter(p.intensity, p.flops_per_s, marker=_MARKERS.get(p.kind, "o"),
                       facecolors="none", edgecolors=_KIND_COLORS.get(p.kind, "k"), s=40, zorder=3)

    decodes = [p for p in data.points if p.kind == "decode"]
    if decodes:
        ax.plot([p.intensity for p in decodes], [p.flops_per_s for p in decodes], "-",
                color=_KIND_COLORS["decode"], alpha=0.5, lw=1)
        for p in decodes:
            ax.annotate(f"B={p.batch}", (p.intensity, p.flops_per_s), xytext=(-6, 7),
                        textcoords="offset points", fontsize=8, ha="right",
                        color=_KIND_COLORS["decode"])
    seen, placed = set(), {}
    for p in data.points:
        label = None if p.kind in seen else {
            "decode": "decode step (whole model)", "prefill": "prefill (whole model)",
            "matmul": "matmul (prefill-like GEMM)", "matvec": "matvec (LM head, batch 1)",
            "attention": "decode attention (1 layer)"}.get(p.kind, p.kind)
        seen.add(p.kind)
        ax.scatter(p.intensity, p.flops_per_s, marker=_MARKERS.get(p.kind, "o"),
                   color=_KIND_COLORS.get(p.kind, "k"), s=45, zorder=4, label=label)
        if p.kind != "decode":  # same-kind labels stack downwards so they do not collide
            k = placed[p.kind] = placed.get(p.kind, -1) + 1
            ax.annotate(p.name, (p.intensity, p.flops_per_s), xytext=(7, -11 - 10 * k),
                        textcoords="offset points", fontsize=7.5, color="#333333")
    if data.decode_crossover not in (None, math.inf):
        ax.annotate(f"decode turns compute-bound\nat batch ≈ {data.decode_crossover:.3g}",
                    (m.ridge, m.peak_flops), xytext=(m.ridge * 1.6, m.peak_flops * 4),
                    fontsize=8.5, arrowprops=dict(arrowstyle="->", color="#444444"),
                    color="#222222")
    h = data.highlight
    if h is not None:
        ax.scatter(h.intensity, h.flops_per_s, s=260, facecolors="none", edgecolors="#C44E52",
                   lw=2, zorder=5)
        ax.annotate(f"{h.name}: {h.seconds * 1e3:.1f} ms\n{h.intensity:.3g} FLOP/B, "
                    f"{fmt_flops(h.flops_per_s)}\n{100 * h.fraction:.0f}% of the roof",
                    (h.intensity, h.flops_per_s), xytext=(18, -42), textcoords="offset points",
                    fontsize=8.5, color="#C44E52",
                    bbox=dict(boxstyle="round", fc="white", ec="#C44E52", alpha=0.9))
    ax.set_xlim(*data.xlim)
    ax.set_ylim(*data.ylim)
    ax.set_xlabel(data.xlabel)
    ax.set_ylabel("attainable / achieved FLOP/s (log scale)")
    fig.suptitle(data.title, fontsize=11)
    if data.footnote:
        ax.set_title(data.footnote, fontsize=7.5, color="#666666")
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8)
    return fig


class RooflineView(FigureView):
    """Controls: ``batch`` (SelectionSlider over the measured decode batch sizes; highlights
    one), ``hardware`` (Dropdown: "none" or a catalog GPU), ``gpu_dtype`` (Dropdown)."""

    css = "minillm-roofline"

    def __init__(self, profile, measurements, hardware_name: str = "H100-SXM",
                 gpu_dtype: str = "bf16", batch: int | None = None):
        import ipywidgets as w

        self.profile = profile
        self.measurements = list(measurements)
        batches = sorted({op.batch for op in self.measurements if op.kind == "decode"})
        controls = {}
        if batches:
            controls["batch"] = w.SelectionSlider(
                options=batches, value=batch if batch in batches else batches[0],
                description="decode batch")
        controls["hardware"] = w.Dropdown(options=[NO_GPU, *hardware.CATALOG],
                                          value=hardware_name, description="compare with")
        controls["gpu_dtype"] = w.Dropdown(options=["bf16", "fp16", "fp8"], value=gpu_dtype,
                                           description="GPU dtype")
        super().__init__(controls)

    def compute(self) -> RooflineData:
        c = self.controls
        return roofline_data(self.profile, self.measurements, c["hardware"].value,
                             c["gpu_dtype"].value, c["batch"].value if "batch" in c else None)

    def draw(self, data):
        return draw_roofline(data)


def view(profile, measurements, hardware_name: str = "H100-SXM", gpu_dtype: str = "bf16",
         batch: int | None = None) -> RooflineView:
    """The interactive roofline: ``display(view(profile, measurements))``."""
    return RooflineView(profile, measurements, hardware_name, gpu_dtype, batch)
