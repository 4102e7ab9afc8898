"""MHA vs GQA vs MQA: KV-cache bytes per token (from ``minillm.calc``) and the decode step
time measured on this machine, for one model shape with three KV-head counts (Lab 03).

    KV bytes per token = 2 · layers · kv_heads · head_dim · dtype_bytes
    MHA: kv_heads = num_heads;  GQA: the model's own count;  MQA: 1
    the cache is num_heads / kv_heads times smaller than MHA's (``calc.gqa_reduction``)

The measurement builds SmolLM2-135M-shaped models (9 query heads of 64 dims, hidden 576,
MLP 1536) with random weights, one per variant: the speed of a step does not depend on the
values. To keep it cheap the models have ``num_layers`` of the real 30 layers (default 4)
and a ``vocab_size`` of 1024 instead of 49,152, so the LM head does not hide the layers:
what differs between the variants is per layer, so the comparison is the full model's
minus one constant, the cost of its 113 MB fp32 LM head. The K/V cache is filled with a constant
(no prefill of thousands of tokens: the step reads the same bytes either way), and one
decode step, ``model(ids[B, 1], positions, ctx)`` exactly as ``minillm.generate`` runs it,
is timed with ``minillm.perf.time_fn`` (median). The models run on ``device`` in ``dtype``
(None: ``minillm.devices.default_device()`` and its default dtype, fp32 on a CPU and bf16 on
CUDA), and the bytes a step reads are counted in that dtype.

    data = attention_variants_data(context_len=4096, batch=4)     # pure: numbers only
    view()                                                        # slider + dropdown

Also for this lab, re-exported here from ``attention_memory``: ``measure_memory_row`` measures
naive-vs-tiled peak memory on this machine (on a CPU a fresh process per call and the growth
of its peak RSS; on CUDA the allocator's peak); ``load_memory_benchmark`` reads the rows ``benchmarks/attention.py`` committed to
``benchmarks/results/attention.json``; ``format_memory_table`` prints either.

Pure function: ``attention_variants_data``; figure: ``draw_attention_variants``; view:
``AttentionVariantsView`` (CSS class ``minillm-attention-variants``).
"""
from __future__ import annotations

import dataclasses

import torch

from minillm import calc
from minillm.config import ModelConfig

from ._format import fmt_bytes, fmt_time
from ._models import dtype_bytes
from ._view import FigureView, new_figure
from .attention_memory import MEMORY_RESULTS, format_memory_table, load_memory_benchmark, measure_memory_row
from .kv_growth import VARIANTS, kv_heads_for

__all__ = ["VARIANTS", "CONTEXT_LENS", "BATCH_SIZES", "VariantTiming", "AttentionVariantsData",
           "variant_config", "build_models", "measure_decode_step", "attention_variants_data",
           "draw_attention_variants", "AttentionVariantsView", "view", "MEMORY_RESULTS",
           "load_memory_benchmark", "format_memory_table", "measure_memory_row"]

CONTEXT_LENS = (256, 512, 1024, 2048, 4096, 8192)
BATCH_SIZES = (1, 4, 8)
_COLORS = {"MHA": "#C44E52", "GQA": "#4C72B0", "MQA": "#55A868"}


def variant_config(variant: str, base: ModelConfig | None = None, num_layers: int = 4,
                   vocab_size: int = 1024, max_context: int = max(CONTEXT_LENS)) -> ModelConfig:
    """``base`` (default SmolLM2-135M) with the KV heads of ``variant``, ``num_layers`` layers,
    ``vocab_size`` tokens and room for ``max_context`` cached tokens plus the new one."""
    base = base or ModelConfig.smollm2_135m()
    return dataclasses.replace(base, num_kv_heads=kv_heads_for(base, variant), num_layers=num_layers,
                               vocab_size=vocab_size, max_position_embeddings=max_context + 1,
                               name=f"{base.name} {variant}")


def build_models(base: ModelConfig | None = None, num_layers: int = 4, vocab_size: int = 1024,
                 max_context: int = max(CONTEXT_LENS), seed: int = 0, device=None,
                 dtype=None) -> dict:
    """One random-weight ``LlamaModel`` per variant (eval, no grad), keyed by name, on
    ``device`` in ``dtype`` (None: the default device and its default dtype)."""
    from minillm.devices import default_dtype, resolve_device
    from minillm.model import LlamaModel

    dev = resolve_device(device)
    dt = default_dtype(dev) if dtype is None else dtype
    return {v: LlamaModel(variant_config(v, base, num_layers, vocab_size, max_context))
            .init_random_weights(seed).eval().requires_grad_(False).to(dev, dt)
            for v in VARIANTS}


@torch.inference_mode()
def measure_decode_step(model, context_len: int, batch: int = 1, repeats: int = 5,
                        warmup: int = 2) -> float:
    """Median seconds of one decode step over a cache holding ``context_len`` tokens per row.

    The step appends at slot ``context_len`` and attends over ``context_len + 1`` positions
    (through the model's attention backend), LM head included.
    """
    from minillm.attention import ContiguousCacheContext
    from minillm.kv_cache import KVCache
    from minillm.perf import time_fn

    cfg = model.config
    if not 1 <= context_len < cfg.max_position_embeddings:
        raise ValueError(f"context_len must be in [1, {cfg.max_position_embeddings - 1}] for this "
                         f"model; got {context_len}.")
    cache = KVCache(cfg, batch, context_len + 1, model.dtype, model.device)
    for t in cache.k + cache.v:
        t.fill_(0.01)  # the step reads the same bytes whatever the values; 0.01 is not denormal
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g).to(model.device)
    positions = torch.full((batch, 1), context_len, dtype=torch.long, device=model.device)
    ctx = ContiguousCacheContext(model.attn_backend, cache, context_len)
    return time_fn(lambda: model(ids, positions, ctx), warmup=warmup, repeats=repeats,
                   device=model.device)


@dataclasses.dataclass
class VariantTiming:
    name: str
    num_heads: int
    num_kv_heads: int
    reduction: int                    # num_heads / num_kv_heads: how much smaller than MHA
    kv_bytes_per_token: float         # the full model, in kv_dtype
    kv_bytes_per_seq: float           # the full model at context_len, in kv_dtype
    step_kv_bytes: float              # K/V the measured step reads (num_layers, model dtype, batch rows)
    step_weight_bytes: float          # weights the measured step reads (model dtype)
    step_s: float | None              # measured median; None when not measured
    achieved_bytes_per_s: float | None

    @property
    def step_bytes(self) -> float:
        return self.step_kv_bytes + self.step_weight_bytes


@dataclasses.dataclass
class AttentionVariantsData:
    model: str
    context_len: int
    batch: int
    num_layers: int                   # layers of the measured models
    full_layers: int                  # layers of the real model (for the per-token numbers)
    vocab_size: int                   # vocabulary of the measured models
    kv_dtype: str
    variants: dict                    # name -> VariantTiming, in VARIANTS order
    title: str
    summary: list = dataclasses.field(default_factory=list)
    step_dtype: str = "float32"       # the measured models' dtype (their step bytes count it)


def attention_variants_data(context_len: int = 4096, batch: int = 4, *, base: ModelConfig | None = None,
                            num_layers: int = 4, vocab_size: int = 1024, kv_dtype: str = "fp16",
                            models: dict | None = None, measure: bool = True, repeats: int = 5,
                            bandwidth_bytes_per_s: float | None = None) -> AttentionVariantsData:
    """KV bytes (calc) and, with ``measure``, the measured decode step of each variant.

    ``bandwidth_bytes_per_s``: this machine's measured bandwidth (``perf.measure_machine()``);
    when given, the summary says what fraction of it each step reached.
    ``models``: prebuilt ``build_models(...)`` to reuse (the view builds them once); they
    must match ``base``/``num_layers``/``vocab_size``. Without it they are built here.
    """
    base = base or ModelConfig.smollm2_135m()
    context_len, batch = int(context_len), int(batch)
    if context_len < 1 or batch < 1:
        raise ValueError(f"context_len and batch must be >= 1; got {context_len}, {batch}.")
    kv_db = dtype_bytes(kv_dtype)
    if measure and models is None:
        models = build_models(base, num_layers, vocab_size, max(context_len, max(CONTEXT_LENS)))
    # the bytes the measured step reads: in the models' dtype (fp32 when nothing is measured)
    step_dtype = next(iter(models.values())).dtype if measure else torch.float32
    step_db = torch.empty((), dtype=step_dtype).element_size()
    step_name = str(step_dtype).removeprefix("torch.")
    rows = {}
    for v in VARIANTS:
        hkv = kv_heads_for(base, v)
        cfg = variant_config(v, base, num_layers, vocab_size)
        step_kv = calc.kv_cache_bytes(num_layers, hkv, base.head_dim, context_len + 1, step_db, batch)
        step_w = calc.weight_bytes(cfg.num_params(), step_db)
        seconds = None
        if measure:
            model = models[v]
            if model.config.num_kv_heads != hkv or model.config.num_layers != num_layers:
                raise ValueError(f"models[{v!r}] has {model.config.num_kv_heads} KV heads and "
                                 f"{model.config.num_layers} layers; expected {hkv} and {num_layers}. "
                                 "Build them with build_models(base, num_layers, vocab_size).")
            seconds = measure_decode_step(model, context_len, batch, repeats)
        rows[v] = VariantTiming(
            v, base.num_heads, hkv, calc.gqa_reduction(base.num_heads, hkv),
            calc.kv_cache_bytes_per_token(base.num_layers, hkv, base.head_dim, kv_db),
            calc.kv_cache_bytes(base.num_layers, hkv, base.head_dim, context_len, kv_db),
            step_kv, step_w, seconds, (step_kv + step_w) / seconds if seconds else None)

    mha, mqa = rows["MHA"], rows["MQA"]
    per_tok = " / ".join(fmt_bytes(r.kv_bytes_per_token) for r in rows.values())
    summary = [
        f"{base.name}: {base.num_heads} query heads of {base.head_dim} dims. KV heads MHA "
        f"{mha.num_kv_heads}, GQA {rows['GQA'].num_kv_heads}, MQA {mqa.num_kv_heads}: KV per token "
        f"({base.num_layers} layers, {kv_dtype}) {per_tok}, i.e. "
        + " / ".join(f"{r.reduction}×" for r in rows.values()) + " smaller than MHA; "
        f"{fmt_bytes(mha.kv_bytes_per_seq)} / {fmt_bytes(rows['GQA'].kv_bytes_per_seq)} / "
        f"{fmt_bytes(mqa.kv_bytes_per_seq)} per sequence of {context_len:,} tokens.",
    ]
    if measure:
        summary.append(
            f"Measured decode step here ({num_layers} of {base.num_layers} layers, vocab {vocab_size}, "
            f"{step_name}, batch {batch}, context {context_len:,}): "
            + ", ".join(f"{r.name} {fmt_time(r.step_s)}" for r in rows.values())
            + "; bytes read " + " / ".join(fmt_bytes(r.step_bytes) for r in rows.values())
            + " (" + " / ".join(f"{r.achieved_bytes_per_s / 1e9:.1f} GB/s" for r in rows.values()) + ").")
        if bandwidth_bytes_per_s:
            summary.append(
                f"This machine's measured bandwidth is {bandwidth_bytes_per_s / 1e9:.1f} GB/s: the steps reach "
                + " / ".join(f"{100 * r.achieved_bytes_per_s / bandwidth_bytes_per_s:.0f}%" for r in rows.values())
                + " of it.")
        time_ratio, bytes_ratio = mha.step_s / mqa.step_s, mha.step_bytes / mqa.step_bytes
        summary.append(
            f"MHA ÷ MQA: time {time_ratio:.2f}×, bytes read {bytes_ratio:.2f}×. "
            "A decode step must read every weight and the whole KV cache; the fewer KV heads, the "
            "fewer bytes, the shorter the step. "
            + ("Here the time shrinks less than the bytes: fixed per-step costs remain (on a GPU, "
               "the launch of every kernel of the step: Lab 01's launch wall), and an attention "
               "kernel with one query per row runs below the machine's bandwidth."
               if time_ratio < bytes_ratio else
               "Here the time shrinks at least as much as the bytes: the step is bound by the bytes "
               "it reads, and the smaller cache may also fit better in the CPU's caches."))
    title = (f"MHA / GQA / MQA, {base.name} shapes: context {context_len:,}, batch {batch}"
             + (f" (measured with {num_layers} layers)" if measure else ""))
    return AttentionVariantsData(base.name, context_len, batch, num_layers, base.num_layers,
                                 vocab_size, kv_dtype, rows, title, summary, step_name)


def draw_attention_variants(data: AttentionVariantsData, fig=None):
    """Left: KV bytes per token of the full model per variant. Right: the measured step time
    per variant, with the bytes it read (weights + KV), and the time predicted from MHA's
    time if time were proportional to bytes. Returns the Figure."""
    fig = fig or new_figure(12, 4.8)
    ax, ax2 = fig.subplots(1, 2)
    names = list(data.variants)
    rows = [data.variants[n] for n in names]
    colors = [_COLORS[n] for n in names]
    kb = [r.kv_bytes_per_token / 1e3 for r in rows]
    bars = ax.bar(names, kb, color=colors)
    for bar, r in zip(bars, rows):
        ax.annotate(f"{fmt_bytes(r.kv_bytes_per_token)}\n{r.num_kv_heads} KV heads, {r.reduction}× less",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8.5)
    ax.set_ylim(0, max(kb) * 1.3)
    ax.set_ylabel(f"KV cache per token (KB, {data.kv_dtype})")
    ax.set_title(f"KV per token, full model ({data.full_layers} layers, {rows[0].num_heads} query heads)",
                 fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)

    if rows[0].step_s is None:
        ax2.text(0.5, 0.5, "not measured (measure=False)", ha="center", va="center", transform=ax2.transAxes)
        ax2.set_axis_off()
    else:
        ms = [r.step_s * 1e3 for r in rows]
        weights = [r.step_weight_bytes / 1e6 for r in rows]
        bars = ax2.bar(names, ms, color=colors)
        mha = data.variants["MHA"]
        predicted = [mha.step_s * 1e3 * r.step_bytes / mha.step_bytes for r in rows]
        ax2.plot(names, predicted, "D", color="black", mfc="none", ms=9,
                 label="if time ∝ bytes read: MHA's time × bytes ratio")
        for bar, r, w in zip(bars, rows, weights):
            ax2.annotate(f"{fmt_time(r.step_s)}\nreads {fmt_bytes(r.step_bytes)}\n(KV {fmt_bytes(r.step_kv_bytes)})",
                         (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 9),
                         textcoords="offset points", ha="center", fontsize=8)
        ax2.set_ylim(0, max(ms + predicted) * 1.45)
        ax2.set_ylabel("measured decode step (ms)")
        ax2.set_title(f"Measured here: {data.num_layers} layers, batch {data.batch}, "
                      f"context {data.context_len:,}, {data.step_dtype}", fontsize=10)
        ax2.legend(fontsize=8, loc="upper right")
        ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(data.title, fontsize=11)
    return fig


class AttentionVariantsView(FigureView):
    """Controls: ``context_len`` (SelectionSlider over ``context_lens``) and ``batch``
    (Dropdown over ``batch_sizes``). Every change re-measures the three variants (a few
    seconds); the models are built once, here."""

    css = "minillm-attention-variants"

    def __init__(self, context_len: int = 4096, batch: int = 4, *, base: ModelConfig | None = None,
                 num_layers: int = 4, vocab_size: int = 1024, context_lens=CONTEXT_LENS,
                 batch_sizes=BATCH_SIZES, repeats: int = 5, models: dict | None = None,
                 bandwidth_bytes_per_s: float | None = None, device=None, dtype=None):
        import ipywidgets as w

        self.base, self.num_layers, self.vocab_size, self.repeats = base, num_layers, vocab_size, repeats
        self.bandwidth = bandwidth_bytes_per_s
        self.models = models or build_models(base, num_layers, vocab_size, max(context_lens),
                                             device=device, dtype=dtype)
        controls = {
            "context_len": w.SelectionSlider(options=list(context_lens), value=context_len,
                                             description="context (tokens)"),
            "batch": w.Dropdown(options=list(batch_sizes), value=batch, description="batch"),
        }
        controls["batch"].layout.width = "160px"
        super().__init__(controls)

    def compute(self) -> AttentionVariantsData:
        c = self.controls
        return attention_variants_data(c["context_len"].value, c["batch"].value, base=self.base,
                                       num_layers=self.num_layers, vocab_size=self.vocab_size,
                                       models=self.models, repeats=self.repeats,
                                       bandwidth_bytes_per_s=self.bandwidth)

    def draw(self, data):
        return draw_attention_variants(data)


def view(**kwargs) -> AttentionVariantsView:
    """The interactive comparison: ``display(view())``; keyword arguments set the start."""
    return AttentionVariantsView(**kwargs)
