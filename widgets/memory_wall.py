"""The memory wall (Lab 01): where the time of one decode step goes, as the batch grows.

Per step, on the roofline (``minillm.calc.decode_step_time_s``):

    weight reads = N · dtype_bytes / bandwidth                 (once per step, shared by the batch)
    KV reads     = B · kv_cache_bytes(context) / bandwidth     (every sequence reads its own)
    compute      = 2 · N · B / peak FLOP/s                     (attention FLOPs left out)
    step time    = max(weight reads + KV reads, compute)

At batch 1 the weight reads dominate; batching shares them, so the time *per token* falls
until compute or the KV reads take over. The measured minillm decode step on this machine
(``minillm.measure.measure_decode_steps``) is drawn over the bars when the hardware is
this machine.

    view = widgets.memory_wall.view(profile, measured=decode_measurements)

Pure function: ``memory_wall_data``; figure: ``draw_memory_wall``; view: ``MemoryWallView``
(CSS class ``minillm-memory-wall``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from minillm import calc, hardware

from ._format import fmt_bandwidth, fmt_bytes, fmt_flops, fmt_params, fmt_time
from ._hardware import THIS_MACHINE, check_same_device, measured_footnote, resolve_limits
from ._models import MODEL_PRESETS, display_name, dtype_bytes, model_spec
from ._view import COLORS, FigureView, new_figure

__all__ = ["MemoryWallData", "memory_wall_data", "draw_memory_wall", "MemoryWallView", "view",
           "BATCH_SIZES", "DTYPES"]

BATCH_SIZES = tuple(2 ** i for i in range(9))  # 1 .. 256
DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")
CONTEXTS = tuple(2 ** i for i in range(7, 18))  # 128 .. 131072
_SAME = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclasses.dataclass
class MemoryWallData:
    batch_sizes: np.ndarray
    weight_time_s: np.ndarray   # per step
    kv_time_s: np.ndarray
    compute_time_s: np.ndarray
    memory_time_s: np.ndarray   # weights + KV
    step_time_s: np.ndarray     # max(memory, compute)
    per_token_s: np.ndarray     # step / batch
    tokens_per_s: np.ndarray    # batch / step
    fits: np.ndarray            # weights + batch · KV within memory (all True if unknown)
    weight_bytes: float
    kv_bytes_per_seq: float
    bandwidth: float
    peak_flops: float
    memory_bytes: float | None
    hardware: str
    model: str
    num_params: float
    dtype: str
    context_len: int
    highlight_batch: int | None
    measured_batches: np.ndarray
    measured_step_s: np.ndarray
    measured_label: str
    title: str
    summary: list = dataclasses.field(default_factory=list)
    footnote: str = ""


def memory_wall_data(model="SmolLM2-135M", dtype: str = "fp32", context_len: int = 128,
                     hardware_name=THIS_MACHINE, profile=None, num_params: float | None = None,
                     batch_sizes: Sequence[int] = BATCH_SIZES, measured: Sequence | None = None,
                     highlight_batch: int | None = 1) -> MemoryWallData:
    """Time per decode step and per token, split into weight reads, KV reads and compute.

    ``model``: a preset name, ``ModelSpec`` or ``ModelConfig`` (gives the KV shape and, unless
    ``num_params`` overrides it, the parameter count). ``hardware_name``: ``THIS_MACHINE``
    (needs ``profile``), or a catalog name. ``measured``: decode ``OpMeasurement``s, drawn
    only when the hardware is this machine.
    """
    spec = model_spec(model)
    n = float(spec.num_params if num_params is None else num_params)
    db = dtype_bytes(dtype)
    ctx = int(context_len)
    lim = resolve_limits(hardware_name, dtype, profile)
    batches = np.array(sorted({int(b) for b in batch_sizes}), dtype=int)
    if batches.size == 0 or batches[0] < 1:
        raise ValueError(f"batch_sizes must be integers >= 1; got {list(batch_sizes)!r}.")

    w_bytes = calc.weight_bytes(n, db)
    kv_seq = calc.kv_cache_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, ctx, db)
    weight_t = np.full(batches.shape, w_bytes / lim.bandwidth)
    kv_t = batches * kv_seq / lim.bandwidth
    compute_t = 2 * n * batches / lim.peak_flops
    memory_t = weight_t + kv_t
    step = np.array([calc.decode_step_time_s(n, db, lim.bandwidth, lim.peak_flops, int(b), kv_seq)
                     for b in batches])
    fits = (np.ones(batches.shape, bool) if lim.memory_bytes is None
            else w_bytes + batches * kv_seq <= lim.memory_bytes)

    mb, ms, mlabel = np.array([], int), np.array([]), ""
    notes, same = [], False
    decodes = sorted((op for op in (measured or []) if op.kind == "decode"), key=lambda o: o.batch)
    if decodes and hardware_name == THIS_MACHINE:
        check_same_device(profile, decodes)
        d0 = decodes[0].details
        mb = np.array([op.batch for op in decodes])
        ms = np.array([op.seconds for op in decodes])
        mdtype = _SAME.get(decodes[0].dtype, decodes[0].dtype)
        mctx = d0.get("context_len", "?")
        mname = display_name(d0.get("model", "minillm"), d0.get("num_params"))
        mlabel = f"measured minillm step ({mname}, {mdtype}, context {mctx})"
        mparams = d0.get("num_params")
        same = not ((mparams and abs(mparams - n) > 0.02 * n) or mdtype != dtype or mctx != ctx)
        if not same:
            notes.append(f"The measured points are {mname} in {mdtype} at context {mctx}; "
                         f"the bars are for the settings chosen above.")

    if highlight_batch is not None and highlight_batch not in batches:
        raise ValueError(f"highlight_batch must be one of {batches.tolist()}; got {highlight_batch!r}.")
    where = ("measured" if lim.measured else "datasheet")
    summary = [f"{spec.name if num_params is None else fmt_params(n) + ' params'} in {dtype}: "
               f"weights {fmt_bytes(w_bytes)}, KV {fmt_bytes(kv_seq)} per sequence at "
               f"{ctx} tokens. {lim.label}: {fmt_bandwidth(lim.bandwidth)}, "
               f"{fmt_flops(lim.peak_flops)} ({where}).",
               f"Batch-1 ceiling: bandwidth ÷ bytes per step = "
               f"{calc.decode_tokens_per_s(n, db, lim.bandwidth, kv_seq):.3g} tok/s."]
    if highlight_batch is not None:
        i = int(np.nonzero(batches == highlight_batch)[0][0])
        bound = "compute" if compute_t[i] > memory_t[i] else "memory"
        line = (f"Batch {highlight_batch}: step {fmt_time(step[i])} ({bound}-bound; weights "
                f"{fmt_time(weight_t[i])}, KV {fmt_time(kv_t[i])}, compute {fmt_time(compute_t[i])}), "
                f"{fmt_time(step[i] / highlight_batch)} per token, "
                f"{highlight_batch / step[i]:.4g} tok/s in total.")
        if not fits[i]:
            line += f" Does not fit: needs {fmt_bytes(w_bytes + highlight_batch * kv_seq)} of {fmt_bytes(lim.memory_bytes)}."
        j = np.nonzero(mb == highlight_batch)[0]
        if j.size and same:
            line += (f" Measured here: {fmt_time(ms[j[0]])} per step "
                     f"({step[i] / ms[j[0]] * 100:.0f}% of the roofline speed).")
        summary.append(line)
    for note in ([lim.note] if lim.note else []) + notes:
        summary.append(f"Note: {note}.".replace("..", "."))
    title = (f"Memory wall: {spec.name if num_params is None else fmt_params(n) + ' params'}, "
             f"{dtype}, context {ctx}, on {lim.label}")
    return MemoryWallData(batches, weight_t, kv_t, compute_t, memory_t, step, step / batches,
                          batches / step, fits, w_bytes, kv_seq, lim.bandwidth, lim.peak_flops,
                          lim.memory_bytes, lim.label, spec.name, n, dtype, ctx, highlight_batch,
                          mb, ms, mlabel, title, summary,
                          measured_footnote(profile) if lim.measured else "")


def draw_memory_wall(data: MemoryWallData, fig=None):
    """Left: time per step (stacked memory bars, compute bars, the bound, measured).
    Right: time per token on a log scale. Returns the Figure."""
    fig = fig or new_figure(12, 5)
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.25, 1]})
    b = data.batch_sizes
    x = np.arange(len(b))
    ms = 1e3
    alpha = np.where(data.fits, 1.0, 0.35)
    for i in range(len(b)):
        hatch = None if data.fits[i] else "//"
        ax.bar(x[i] - 0.2, data.weight_time_s[i] * ms, 0.4, color=COLORS["weights"], alpha=alpha[i],
               hatch=hatch, label="weight reads" if i == 0 else None)
        ax.bar(x[i] - 0.2, data.kv_time_s[i] * ms, 0.4, bottom=data.weight_time_s[i] * ms,
               color=COLORS["kv"], alpha=alpha[i], hatch=hatch, label="KV-cache reads" if i == 0 else None)
        ax.bar(x[i] + 0.2, data.compute_time_s[i] * ms, 0.4, color=COLORS["compute"],
               alpha=alpha[i], hatch=hatch, label="compute (2·N·B FLOPs)" if i == 0 else None)
        if not data.fits[i]:
            ax.annotate("OOM", (x[i], data.step_time_s[i] * ms), xytext=(0, 4),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8,
                        color=COLORS["bound"])
    ax.plot(x, data.step_time_s * ms, "_", ms=22, mew=2.5, color=COLORS["bound"],
            label="roofline step = max(memory, compute)")
    if data.measured_batches.size:
        idx = [int(np.nonzero(b == mb)[0][0]) for mb in data.measured_batches if mb in b]
        keep = [k for k, mb in enumerate(data.measured_batches) if mb in b]
        ax.plot(np.array(idx), data.measured_step_s[keep] * ms, "D-", color=COLORS["measured"],
                ms=5, lw=1, label=data.measured_label)
        ax2.plot(np.array(idx), data.measured_step_s[keep] / data.measured_batches[keep] * ms, "D-",
                 color=COLORS["measured"], ms=5, lw=1, label="measured (this machine)")
    top = max(data.step_time_s.max(), data.measured_step_s.max() if data.measured_step_s.size else 0)
    ax.set_ylim(0, top * ms * 1.45)  # headroom for the legend
    ax.set_xticks(x, [str(v) for v in b])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("time per decode step (ms)")
    ax.set_title("One decode step", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left", ncol=2)
    ax.grid(True, axis="y", alpha=0.3)

    ax2.plot(x, data.weight_time_s / b * ms, "o-", color=COLORS["weights"], label="weight reads ÷ B")
    ax2.plot(x, data.kv_time_s / b * ms, "o-", color=COLORS["kv"], label="KV reads ÷ B")
    ax2.plot(x, data.compute_time_s / b * ms, "o-", color=COLORS["compute"], label="compute ÷ B")
    ax2.plot(x, data.per_token_s * ms, "-", lw=3, alpha=0.6, color=COLORS["bound"],
             label="roofline time per token")
    ax2.set_yscale("log")
    ax2.set_xticks(x, [str(v) for v in b])
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("time per generated token (ms, log scale)")
    ax2.set_title("Per token: batching shares the weight reads", fontsize=10)
    ax2.legend(fontsize=7.5)
    ax2.grid(True, which="both", alpha=0.25)
    if data.highlight_batch is not None:
        i = int(np.nonzero(b == data.highlight_batch)[0][0])
        for a in (ax, ax2):
            a.axvspan(i - 0.5, i + 0.5, color="#FFD54F", alpha=0.25, zorder=0)
    fig.suptitle(data.title, fontsize=11)
    if data.footnote:
        fig.supxlabel(data.footnote, fontsize=7.5, color="#666666")
    return fig


class MemoryWallView(FigureView):
    """Controls: ``model`` (preset Dropdown; sets ``params``), ``params`` (FloatLogSlider),
    ``dtype``, ``context`` (SelectionSlider), ``hardware`` (Dropdown), ``batch``
    (SelectionSlider: the batch the summary line describes)."""

    css = "minillm-memory-wall"

    def __init__(self, profile=None, measured: Sequence | None = None, model: str = "SmolLM2-135M",
                 dtype: str | None = None, context_len: int = 128, hardware_name: str | None = None,
                 batch: int = 1):
        import ipywidgets as w

        self.profile = profile
        self.measured = list(measured or [])
        if dtype is None:  # the dtype the measured points ran in (fp32 when there are none)
            dtype = _SAME.get(self.measured[0].dtype, "fp32") if self.measured else "fp32"
        hw_options = ([THIS_MACHINE] if profile is not None else []) + list(hardware.CATALOG)
        if hardware_name is None:
            hardware_name = hw_options[0]
        spec = model_spec(model)
        controls = {
            "model": w.Dropdown(options=list(MODEL_PRESETS), value=spec.name, description="model"),
            "params": w.FloatLogSlider(value=spec.num_params, base=10, min=7, max=12, step=0.05,
                                       description="params", readout_format=".3g"),
            "dtype": w.Dropdown(options=list(DTYPES), value=dtype, description="dtype"),
            "context": w.SelectionSlider(options=list(CONTEXTS), value=context_len,
                                         description="context (tokens)"),
            "hardware": w.Dropdown(options=hw_options, value=hardware_name, description="hardware"),
            "batch": w.SelectionSlider(options=list(BATCH_SIZES), value=batch, description="batch"),
        }
        self._syncing = False
        c = controls
        super().__init__(controls, [[c["model"], c["params"], c["dtype"]],
                                    [c["hardware"], c["context"], c["batch"]]])

    def _on_change(self, change) -> None:
        if self._syncing:
            return
        if change["owner"] is self.controls["model"]:
            self._syncing = True  # set params from the preset without a second render
            try:
                self.controls["params"].value = MODEL_PRESETS[change["new"]].num_params
            finally:
                self._syncing = False
        self.update()

    def compute(self) -> MemoryWallData:
        c = self.controls
        spec = MODEL_PRESETS[c["model"].value]
        params = c["params"].value
        override = None if abs(params - spec.num_params) <= 1e-6 * spec.num_params else params
        return memory_wall_data(spec, c["dtype"].value, c["context"].value, c["hardware"].value,
                                self.profile, override, BATCH_SIZES, self.measured,
                                c["batch"].value)

    def draw(self, data):
        return draw_memory_wall(data)


def view(profile=None, measured: Sequence | None = None, **kwargs) -> MemoryWallView:
    """The interactive memory wall: ``display(view(profile, measured=decode_measurements))``."""
    return MemoryWallView(profile, measured, **kwargs)
