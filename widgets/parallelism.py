"""The parallelism timeline of Lab 08: tensor and pipeline parallelism, rank by rank.

For a model on GPUs, a TP size, a number of pipeline stages and of microbatches, the figure
shows every rank's forward pass over time: compute, time inside all-reduces, and pipeline
bubbles. The numbers come from ``minillm.calc.timeline.tp_pp_timeline`` (which prices the
all-reduces with ``calc.allreduce_time_s`` and reproduces ``calc.pp_bubble_fraction``); a
layer's compute is its roofline time on the GPU (``calc.timeline.layer_time_s``). Beside it,
a pipeline measured on this machine (``minillm.dist.run_pipeline``) is drawn the same way.

    widgets.parallelism.view(tp_size=8, pp_stages=1, num_microbatches=1, measured=pp_run)

Pure function ``parallelism_data``; figure ``draw_parallelism``; view ``ParallelismView``
(CSS class ``minillm-parallelism``). Nothing here runs a model or a process group.

Invariants: the modelled timeline is ``tp_pp_timeline`` evaluated, never re-derived; measured
events are drawn as recorded (only re-labelled: fwd -> compute, send/recv -> comm, idle or
unrecorded gaps -> bubble).
"""
from __future__ import annotations

import dataclasses

from minillm import calc, hardware
from minillm.calc import timeline as tl
from minillm.config import ModelConfig

from ._models import MODEL_PRESETS
from ._view import COLORS, FigureView, figure_image, new_figure

__all__ = ["LINKS", "MODELS", "MeasuredPipeline", "ParallelismData", "parallelism_data",
           "measured_pipeline", "draw_parallelism", "figure_image", "ParallelismView", "view"]

#: Per-direction bandwidth of one GPU's link: what a ring all-reduce step sends at.
LINKS = {"NVLink 4 (H100): 450 GB/s per direction": 450e9,
         "PCIe Gen5 x16: 32 GB/s per direction": 32e9}
#: Shapes of the models the widget offers (Llama-2-70B's published configuration).
MODELS = {
    "Llama-2-70B": ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                               num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                               name="Llama-2-70B"),
    "SmolLM2-135M": ModelConfig.smollm2_135m(),
}
KIND_COLORS = {"compute": COLORS["compute"], "comm": COLORS["gpu"], "bubble": "#dddddd"}
_MEASURED_KIND = {"fwd": "compute", "compute": "compute", "send": "comm", "recv": "comm",
                  "comm": "comm", "idle": "bubble", "bubble": "bubble"}
_MAX_ROWS = 16


def _per_layer_params(cfg: ModelConfig) -> int:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return d * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * d + 3 * d * f


@dataclasses.dataclass
class MeasuredPipeline:
    """A measured run as rows of (rank, kind, microbatch, start_s, end_s), kinds as in the
    model; gaps a rank did not record are bubble up to the run's end."""

    events: list
    world_size: int
    total_s: float
    bubble_fraction: float
    predicted_bubble_fraction: float | None
    label: str


def measured_pipeline(run) -> MeasuredPipeline:
    """A ``dist.run_pipeline`` result (``.events`` of (rank, kind, microbatch, start_s,
    end_s), ``.pp_size``, ``.num_microbatches``) as a MeasuredPipeline. Times are shifted
    to start at 0; where a rank's events overlap, the later one is trimmed."""
    raw = [tuple(e) if not hasattr(e, "rank") else (e.rank, e.kind, e.microbatch, e.start_s, e.end_s)
           for e in run.events]
    if not raw:
        raise ValueError("the measured run has no events to draw")
    t0 = min(e[3] for e in raw)
    total = max(e[4] for e in raw) - t0
    ranks = sorted({int(e[0]) for e in raw})
    events = []
    for r in ranks:
        clock = 0.0
        for _, kind, mb, a, b in sorted((e for e in raw if int(e[0]) == r), key=lambda e: e[3]):
            k = _MEASURED_KIND.get(kind)
            if k is None:
                raise ValueError(f"unknown event kind {kind!r}; expected one of {sorted(_MEASURED_KIND)}")
            a, b = max(a - t0, clock), b - t0  # one thing at a time: trim an overlap
            if b <= a:
                continue
            if a > clock:
                events.append((r, "bubble", None, clock, a))
            events.append((r, k, mb, a, b))
            clock = max(clock, b)
        if total > clock:
            events.append((r, "bubble", None, clock, total))
    idle = sum(e[4] - e[3] for e in events if e[1] == "bubble")
    bubble = getattr(run, "measured_bubble_fraction", None)
    bubble = idle / (len(ranks) * total) if bubble is None else float(bubble)
    p, m = getattr(run, "pp_size", len(ranks)), getattr(run, "num_microbatches", None)
    predicted = getattr(run, "predicted_bubble_fraction", None)
    if predicted is None and m:
        predicted = calc.pp_bubble_fraction(p, m)
    label = f"measured on this machine: PP = {p}" + (f", M = {m}" if m else "")
    return MeasuredPipeline(events, len(ranks), total, bubble, predicted, label)


@dataclasses.dataclass
class ParallelismData:
    timeline: tl.Timeline
    model: str
    gpu: str
    link: str
    tokens_per_microbatch: int
    weight_bytes_per_gpu: float
    gpu_memory_bytes: float | None
    measured: MeasuredPipeline | None
    title: str
    summary: list = dataclasses.field(default_factory=list)


def parallelism_data(tp_size: int = 8, pp_stages: int = 1, num_microbatches: int = 1,
                     tokens_per_microbatch: int = 512, link: str = next(iter(LINKS)),
                     latency_us: float = 2.0, model: str = "Llama-2-70B", gpu: str = "H100-SXM",
                     dtype: str = "fp16", measured=None) -> ParallelismData:
    """The modelled per-rank timeline of one forward, its shares and memory per GPU, and the
    measured pipeline (a ``dist.run_pipeline`` result or a MeasuredPipeline) if given."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}; got {model!r}.")
    if link not in LINKS:
        raise ValueError(f"link must be one of {list(LINKS)}; got {link!r}.")
    cfg, hw, b = MODELS[model], hardware.get(gpu), calc.DTYPE_BYTES[dtype]
    params = _per_layer_params(cfg)
    layer_s = tl.layer_time_s(params, tokens_per_microbatch, b, hw.peak_flops(dtype),
                              hw.bandwidth_bytes_per_s)
    message = tokens_per_microbatch * cfg.hidden_size * b
    t = tl.tp_pp_timeline(cfg.num_layers, layer_s, message, tp_size, pp_stages, num_microbatches,
                          LINKS[link], latency_us * 1e-6)
    nominal = MODEL_PRESETS[model].num_params if model in MODEL_PRESETS else cfg.num_params()
    per_gpu = calc.memory_per_gpu(calc.weight_bytes(nominal, b), tp_size * pp_stages)
    if measured is not None and not isinstance(measured, MeasuredPipeline):
        measured = measured_pipeline(measured)
    n = tp_size * pp_stages
    formula = calc.pp_bubble_fraction(pp_stages, num_microbatches)
    summary = [
        f"{model} on {n} × {hw.name} (TP = {tp_size} × PP = {pp_stages}), {dtype}, "
        f"{tokens_per_microbatch} tokens per microbatch, {num_microbatches} microbatch"
        f"{'es' if num_microbatches > 1 else ''}",
        f"one layer on one rank: compute {t.layer_compute_s * 1e3:.3f} ms (roofline ÷ tp); each of "
        f"its 2 all-reduces of {message / 1e6:.2f} MB: {t.allreduce_s * 1e3:.3f} ms "
        f"(2(N−1)/N × message ÷ link + 2(N−1) × {latency_us:g} µs)",
        f"forward: {t.total_s * 1e3:.2f} ms; compute {t.compute_fraction:.0%}, all-reduce "
        f"{t.comm_fraction:.0%}, bubble {t.bubble_fraction:.0%} of the GPUs' time "
        f"((P − 1)/(M + P − 1) = {formula:.0%}; sends between stages {t.send_s * 1e6:.1f} µs each)",
        f"weights per GPU: {nominal / 1e9:g}B × {b:g} B ÷ {n} = {per_gpu / 1e9:.1f} GB"
        + (f" of {hw.memory_bytes / 1e9:.0f} GB" if hw.memory_bytes else "")
        + ("  (does not fit)" if hw.memory_bytes and per_gpu > hw.memory_bytes else ""),
    ]
    if measured is not None:
        line = f"{measured.label}: bubble {measured.bubble_fraction:.0%} of the ranks' time"
        if measured.predicted_bubble_fraction is not None:
            line += f" (formula {measured.predicted_bubble_fraction:.0%})"
        summary.append(line)
    title = f"{model}: TP = {tp_size}, PP = {pp_stages}, M = {num_microbatches} on {link.split(':')[0]}"
    return ParallelismData(t, model, hw.name, link, tokens_per_microbatch, per_gpu,
                           hw.memory_bytes, measured, title, summary)


def _rows(timeline: tl.Timeline):
    """(label, intervals) per row: every rank, or one row per stage when there are too many."""
    if timeline.world_size <= _MAX_ROWS:
        return [(f"stage {r // timeline.tp_size} · tp {r % timeline.tp_size}", timeline.rank_intervals(r))
                for r in range(timeline.world_size)]
    tp = timeline.tp_size
    return [(f"stage {s} (tp ranks {s * tp}–{s * tp + tp - 1}, alike)", timeline.rank_intervals(s * tp))
            for s in range(timeline.pp_stages)]


def _merged(items) -> list:
    """(kind, microbatch, start, end) with each microbatch's per-layer compute and all-reduce
    pieces on a rank drawn as one compute block then one all-reduce block (same totals):
    80 layers' thin stripes would blur into one colour."""
    out, block = [], None
    for kind, mb, a, b in items + [("bubble", None, None, None)]:
        if kind != "bubble" and block and block[0] == mb:
            block[2 if kind == "compute" else 3] += b - a
            block[4] = b
            continue
        if block:
            mb0, start, comp, comm, end = block
            out += [("compute", mb0, start, start + comp), ("comm", mb0, start + comp, end)]
        block = [mb, a, b - a if kind == "compute" else 0.0, b - a if kind == "comm" else 0.0, b] \
            if kind != "bubble" else None
        if kind == "bubble" and a is not None:
            out.append((kind, mb, a, b))
    return out


def _draw_rows(ax, rows, scale: float, unit: str) -> None:
    for y, (label, items) in enumerate(rows):
        for kind, color in KIND_COLORS.items():
            spans = [(a * scale, (b - a) * scale) for k, _, a, b in items if k == kind and b > a]
            if spans:
                ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=color, edgecolor="none")
        blocks = {}
        for k, mb, a, b in items:
            if k == "compute" and mb is not None:
                lo, hi = blocks.get(mb, (a, b))
                blocks[mb] = (min(lo, a), max(hi, b))
        width = max((b for _, _, _, b in items), default=1.0) * scale
        for mb, (a, b) in blocks.items():
            if (b - a) * scale > 0.03 * width:
                ax.text((a + b) / 2 * scale, y, str(mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit}); numbers: microbatch")
    ax.grid(True, axis="x", alpha=0.3)


def draw_parallelism(data: ParallelismData, fig=None):
    """Left: the modelled timeline, a row per rank (compute green, all-reduce red, bubble
    grey; each microbatch's all-reduces drawn together after its compute). Right, when a
    measured run is given: the same for the run on this machine."""
    has_measured = data.measured is not None
    fig = fig or new_figure(13 if has_measured else 10, 4.4)
    axes = fig.subplots(1, 2, width_ratios=(3, 2)) if has_measured else [fig.subplots(1, 1)]
    t = data.timeline
    rows = [(label, _merged([(i.kind, i.microbatch, i.start_s, i.end_s) for i in items]))
            for label, items in _rows(t)]
    _draw_rows(axes[0], rows, 1e3, "ms")
    axes[0].set_title(f"model: {data.gpu} × {t.world_size}; bubble {t.bubble_fraction:.0%}, "
                      f"all-reduce {t.comm_fraction:.0%}", fontsize=9)
    if has_measured:
        m = data.measured
        mrows = [(f"rank {r}", [(k, mb, a, b) for rr, k, mb, a, b in m.events if rr == r])
                 for r in sorted({e[0] for e in m.events})]
        _draw_rows(axes[1], mrows, 1e3, "ms")
        axes[1].set_title(f"{m.label}; bubble {m.bubble_fraction:.0%}", fontsize=9)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k)
               for k, c in (("compute", KIND_COLORS["compute"]),
                            ("all-reduce (model: each microbatch's, together) / send, recv", KIND_COLORS["comm"]),
                            ("bubble (idle)", KIND_COLORS["bubble"]))]
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=3)
    fig.suptitle(data.title, fontsize=10)
    return fig


class ParallelismView(FigureView):
    """Controls: ``tp_size``, ``pp_stages``, ``num_microbatches``, ``tokens_per_microbatch``,
    ``link``, ``latency_us``; ``measured`` (a ``dist.run_pipeline`` result) is drawn beside."""

    css = "minillm-parallelism"

    def __init__(self, tp_size: int = 8, pp_stages: int = 1, num_microbatches: int = 1,
                 tokens_per_microbatch: int = 512, link: str = next(iter(LINKS)),
                 latency_us: float = 2.0, model: str = "Llama-2-70B", measured=None):
        import ipywidgets as w

        self.model = model
        self.measured = None if measured is None else measured_pipeline(measured)
        controls = {
            "tp_size": w.Dropdown(options=[1, 2, 4, 8], value=tp_size, description="TP size"),
            "pp_stages": w.Dropdown(options=[1, 2, 4, 8], value=pp_stages, description="PP stages"),
            "num_microbatches": w.IntSlider(value=num_microbatches, min=1, max=32,
                                            description="microbatches M"),
            "tokens_per_microbatch": w.SelectionSlider(
                options=[1, 16, 128, 512, 2048, 8192], value=tokens_per_microbatch,
                description="tokens per microbatch"),
            "link": w.Dropdown(options=list(LINKS), value=link, description="link"),
            "latency_us": w.FloatSlider(value=latency_us, min=0.0, max=20.0, step=0.5,
                                        description="latency per ring step (µs)"),
        }
        super().__init__(controls, layout_rows=[list(controls.values())[:3], list(controls.values())[3:]])

    def compute(self) -> ParallelismData:
        c = {k: v.value for k, v in self.controls.items()}
        return parallelism_data(model=self.model, measured=self.measured, **c)

    def draw(self, data):
        return draw_parallelism(data)


def view(**kwargs) -> ParallelismView:
    """``display(widgets.parallelism.view(tp_size=8, measured=pp_run))``."""
    return ParallelismView(**kwargs)
