"""KV-cache growth against memory capacity (Labs 02 and 03).

    KV bytes = 2 · layers · kv_heads · head_dim · seq_len · dtype_bytes · sequences
    max concurrent sequences = floor((memory − weights) / KV bytes per sequence)

Both come from ``minillm.calc`` (``kv_cache_bytes``, ``max_concurrent_sequences``). The
attention variant only changes ``kv_heads``: MHA has one per query head, GQA the model's own
count, MQA one; the cache shrinks by ``num_heads / kv_heads``.

    view = widgets.kv_growth.view()               # presets: SmolLM2-135M, Llama-3-8B, Llama-2-70B

Pure function: ``kv_growth_data``; figure: ``draw_kv_growth``; view: ``KVGrowthView``
(CSS class ``minillm-kv-growth``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from minillm import calc, hardware

from ._format import fmt_bytes
from ._models import MODEL_PRESETS, dtype_bytes, model_spec
from ._view import COLORS, FigureView, new_figure

__all__ = ["VariantCurve", "KVGrowthData", "VARIANTS", "kv_heads_for", "kv_growth_data",
           "draw_kv_growth", "KVGrowthView", "view"]

VARIANTS = ("MHA", "GQA", "MQA")
SEQ_LENS = tuple(2 ** i for i in range(7, 18))  # 128 .. 131072
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
_VARIANT_COLORS = {"MHA": "#C44E52", "GQA": "#4C72B0", "MQA": "#55A868"}


def kv_heads_for(spec, variant: str) -> int:
    """KV heads of ``variant`` for a model: MHA = num_heads, GQA = the model's own count,
    MQA = 1."""
    if variant == "MHA":
        return spec.num_heads
    if variant == "GQA":
        return spec.num_kv_heads
    if variant == "MQA":
        return 1
    raise ValueError(f"attention must be one of {VARIANTS}; got {variant!r}.")


@dataclasses.dataclass
class VariantCurve:
    name: str
    num_kv_heads: int
    kv_bytes_per_token: float
    kv_bytes_per_seq: float       # at the chosen seq_len
    total_bytes: np.ndarray       # weights + num_seqs · KV, over seq_lens
    max_concurrent: int           # sequences of seq_len that fit
    oom_seq_len: float | None     # longest seq_len for num_seqs that fits; None: all plotted fit


@dataclasses.dataclass
class KVGrowthData:
    seq_lens: np.ndarray
    variants: dict                # name -> VariantCurve, in VARIANTS order
    selected: str
    model: str
    num_heads: int
    max_context: int
    hardware: str
    memory_bytes: float
    weight_bytes: float
    kv_dtype: str
    weight_dtype: str
    seq_len: int
    num_seqs: int
    kv_bytes_per_seq: float       # selected variant, at seq_len
    kv_total_bytes: float         # · num_seqs
    total_bytes: float            # + weights
    fits: bool
    max_concurrent: int
    oom_seq_len: float | None
    title: str
    summary: list = dataclasses.field(default_factory=list)


def _oom_seq_len(memory, weights, num_seqs, per_token, longest) -> float | None:
    free = memory - weights
    if free <= 0:
        return 0.0
    t = free / (num_seqs * per_token)
    return None if t >= longest else t


def kv_growth_data(model="Llama-3-8B", seq_len: int = 8192, num_seqs: int = 16,
                   attention: str = "GQA", kv_dtype: str = "fp16", weight_dtype: str = "fp16",
                   hardware_name="H100-SXM") -> KVGrowthData:
    """KV-cache memory of ``num_seqs`` sequences of ``seq_len`` tokens against the capacity of
    a catalog GPU, for MHA, GQA and MQA (``attention`` picks the one the summary describes).

    ``model``: a preset name (``MODEL_PRESETS``), ``ModelSpec`` or ``ModelConfig``.
    """
    spec = model_spec(model)
    hw = hardware_name if isinstance(hardware_name, hardware.Hardware) else hardware.get(hardware_name)
    if attention not in VARIANTS:
        raise ValueError(f"attention must be one of {VARIANTS}; got {attention!r}.")
    kv_db, w_db = dtype_bytes(kv_dtype), dtype_bytes(weight_dtype)
    seq_len, num_seqs = int(seq_len), int(num_seqs)
    if seq_len < 1 or num_seqs < 1:
        raise ValueError(f"seq_len and num_seqs must be >= 1; got {seq_len}, {num_seqs}.")
    weights = calc.weight_bytes(spec.num_params, w_db)
    mem = hw.memory_bytes
    seq_lens = np.unique(np.geomspace(SEQ_LENS[0], max(SEQ_LENS[-1], seq_len), 256).astype(int))

    curves = {}
    for v in VARIANTS:
        heads = kv_heads_for(spec, v)
        per_tok = calc.kv_cache_bytes_per_token(spec.num_layers, heads, spec.head_dim, kv_db)
        per_seq = calc.kv_cache_bytes(spec.num_layers, heads, spec.head_dim, seq_len, kv_db)
        curves[v] = VariantCurve(
            v, heads, per_tok, per_seq, weights + num_seqs * per_tok * seq_lens,
            calc.max_concurrent_sequences(mem, weights, per_seq),
            _oom_seq_len(mem, weights, num_seqs, per_tok, seq_lens[-1]))
    sel = curves[attention]
    kv_total = sel.kv_bytes_per_seq * num_seqs
    total = weights + kv_total
    fits = total <= mem

    ratio = calc.gqa_reduction(spec.num_heads, sel.num_kv_heads)
    summary = [
        f"{spec.name}, {attention} ({sel.num_kv_heads} KV heads for {spec.num_heads} query heads, "
        f"{ratio}× smaller than MHA), KV in {kv_dtype}: {fmt_bytes(sel.kv_bytes_per_token)} per "
        f"token, {fmt_bytes(sel.kv_bytes_per_seq)} per sequence of {seq_len:,} tokens.",
        f"{num_seqs} sequences: KV {fmt_bytes(kv_total)} + weights ({weight_dtype}) "
        f"{fmt_bytes(weights)} = {fmt_bytes(total)} of {fmt_bytes(mem)} on {hw.name}: "
        + ("fits." if fits else "OUT OF MEMORY."),
    ]
    if weights >= mem:
        summary.append(f"The weights alone exceed {hw.name}'s memory: split the model over "
                       f"several GPUs (Lab 08) or quantize it (Lab 06).")
    else:
        summary.append(
            f"At most {sel.max_concurrent} concurrent sequences of {seq_len:,} tokens fit "
            f"(MHA {curves['MHA'].max_concurrent}, GQA {curves['GQA'].max_concurrent}, "
            f"MQA {curves['MQA'].max_concurrent})"
            + (f"; {num_seqs} sequences run out of memory past {sel.oom_seq_len:,.0f} tokens."
               if sel.oom_seq_len not in (None, 0.0) else "."))
    if seq_len > spec.max_context:
        summary.append(f"Note: {spec.name} was trained for {spec.max_context:,} tokens; longer "
                       f"contexts are shown for the arithmetic only.")
    title = (f"KV cache of {spec.name}: {num_seqs} × {seq_len:,} tokens, {kv_dtype} KV, "
             f"on {hw.name} ({fmt_bytes(mem)})")
    return KVGrowthData(seq_lens, curves, attention, spec.name, spec.num_heads, spec.max_context,
                        hw.name, mem, weights, kv_dtype, weight_dtype, seq_len, num_seqs,
                        sel.kv_bytes_per_seq, kv_total, total, fits, sel.max_concurrent,
                        sel.oom_seq_len, title, summary)


def draw_kv_growth(data: KVGrowthData, fig=None):
    """Left: memory (GB) against sequence length for each variant, with the weights and the
    capacity. Right: max concurrent sequences per variant. Returns the Figure."""
    fig = fig or new_figure(12, 5)
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    gb = 1e9
    x = data.seq_lens
    ax.fill_between(x, 0, data.weight_bytes / gb, color=COLORS["grey"], alpha=0.3,
                    label=f"weights ({data.weight_dtype}): {fmt_bytes(data.weight_bytes)}")
    ax.axhline(data.memory_bytes / gb, color="black", lw=2,
               label=f"{data.hardware} memory: {fmt_bytes(data.memory_bytes)}")
    for name, c in data.variants.items():
        selected = name == data.selected
        ax.plot(x, c.total_bytes / gb, color=_VARIANT_COLORS[name], lw=2.8 if selected else 1.3,
                ls="-" if selected else "--",
                label=f"{name} ({c.num_kv_heads} KV heads): weights + {data.num_seqs} × KV")
        if selected and c.oom_seq_len not in (None, 0.0):
            ax.plot([c.oom_seq_len], [data.memory_bytes / gb], "X", ms=12, color=COLORS["bound"])
            ax.annotate(f"out of memory\nat {c.oom_seq_len:,.0f} tokens", (c.oom_seq_len, data.memory_bytes / gb),
                        xytext=(10, -34), textcoords="offset points", fontsize=8.5,
                        color=COLORS["bound"])
    ax.axvline(data.seq_len, color="#555555", ls=":", lw=1)
    ax.plot([data.seq_len], [data.total_bytes / gb], "o", ms=8, color=_VARIANT_COLORS[data.selected])
    ax.axvline(data.max_context, color=COLORS["grey"], ls="-.", lw=1)
    ax.text(data.max_context, 0.02, f" trained context\n {data.max_context:,}", fontsize=7.5,
            color="#666666", transform=ax.get_xaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_xlim(x[0], x[-1])
    top = max(data.memory_bytes * 1.35, data.weight_bytes * 1.2, data.total_bytes * 1.1) / gb
    ax.set_ylim(0, top)
    ax.set_xlabel("sequence length (tokens, log scale)")
    ax.set_ylabel("memory (GB)")
    ax.set_title("Memory against sequence length", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper left")
    ax.grid(True, alpha=0.3)

    names = list(data.variants)
    counts = [data.variants[n].max_concurrent for n in names]
    bars = ax2.bar(names, counts, color=[_VARIANT_COLORS[n] for n in names])
    for bar, n in zip(bars, names):
        bar.set_alpha(1.0 if n == data.selected else 0.45)
    for bar, n in zip(bars, counts):
        ax2.annotate(f"{n:,}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                     xytext=(0, 3), textcoords="offset points", ha="center", fontsize=9)
    ax2.axhline(data.num_seqs, color="#555555", ls="--", lw=1,
                label=f"requested: {data.num_seqs} sequences")
    ax2.set_ylabel(f"max concurrent sequences of {data.seq_len:,} tokens")
    ax2.set_xlabel("attention variant")
    ax2.set_ylim(0, max(max(counts), data.num_seqs, 1) * 1.18)
    ax2.set_title("How many sequences fit", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(data.title, fontsize=11)
    return fig


class KVGrowthView(FigureView):
    """Controls: ``model`` (preset Dropdown), ``attention`` (ToggleButtons MHA/GQA/MQA),
    ``seq_len`` (SelectionSlider), ``num_seqs`` (IntSlider), ``kv_dtype``, ``weight_dtype``,
    ``hardware`` (Dropdowns)."""

    css = "minillm-kv-growth"

    def __init__(self, model: str = "Llama-3-8B", seq_len: int = 8192, num_seqs: int = 16,
                 attention: str = "GQA", kv_dtype: str = "fp16", weight_dtype: str = "fp16",
                 hardware_name: str = "H100-SXM"):
        import ipywidgets as w

        controls = {
            "model": w.Dropdown(options=list(MODEL_PRESETS), value=model, description="model"),
            "attention": w.ToggleButtons(options=list(VARIANTS), value=attention,
                                         description="attention"),
            "seq_len": w.SelectionSlider(options=list(SEQ_LENS), value=seq_len,
                                         description="sequence length"),
            "num_seqs": w.IntSlider(value=num_seqs, min=1, max=512, description="sequences"),
            "kv_dtype": w.Dropdown(options=list(KV_DTYPES), value=kv_dtype, description="KV dtype"),
            "weight_dtype": w.Dropdown(options=list(KV_DTYPES), value=weight_dtype,
                                       description="weights dtype"),
            "hardware": w.Dropdown(options=list(hardware.CATALOG), value=hardware_name,
                                   description="hardware"),
        }
        c = controls
        for name in ("model", "kv_dtype", "weight_dtype", "hardware"):
            c[name].layout.width = "230px"
        super().__init__(controls, [[c["model"], c["hardware"], c["kv_dtype"], c["weight_dtype"]],
                                    [c["attention"], c["seq_len"], c["num_seqs"]]])

    def compute(self) -> KVGrowthData:
        c = self.controls
        return kv_growth_data(c["model"].value, c["seq_len"].value, c["num_seqs"].value,
                              c["attention"].value, c["kv_dtype"].value, c["weight_dtype"].value,
                              c["hardware"].value)

    def draw(self, data):
        return draw_kv_growth(data)


def view(**kwargs) -> KVGrowthView:
    """The interactive KV-growth plot: ``display(view())``; keyword arguments set the start."""
    return KVGrowthView(**kwargs)
