"""Shared pieces of the widgets: number formatting, model presets, hardware lookup, and the
``FigureView`` base class that ties controls, a pure data function and a matplotlib figure.

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
import dataclasses
import html
import io
import math

from minillm import calc, hardware
from minillm.config import ModelConfig

THIS_MACHINE = "this machine (measured)"

COLORS = {"weights": "#4C72B0", "kv": "#DD8452", "compute": "#55A868", "bound": "#C44E52",
          "measured": "#222222", "machine": "#4C72B0", "gpu": "#C44E52", "grey": "#999999"}


# --------------------------------------------------------------------------- formatting


def _scaled(value: float, unit: str, prefixes=(("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))) -> str:
    if value is None or not math.isfinite(value):
        return f"∞ {unit}" if value == math.inf else f"n/a {unit}"
    for prefix, scale in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def fmt_bytes(n: float) -> str:
    """1.34e9 -> '1.34 GB' (SI prefixes, as ``minillm.calc`` uses)."""
    return _scaled(n, "B")


def fmt_flops(f: float) -> str:
    """1.7e11 -> '170 GFLOP/s'."""
    return _scaled(f, "FLOP/s")


def fmt_bandwidth(b: float) -> str:
    """2.039e12 -> '2.04 TB/s'."""
    return _scaled(b, "B/s")


def fmt_time(s: float) -> str:
    """0.0543 -> '54.3 ms'."""
    if not math.isfinite(s):
        return "∞"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_params(n: float) -> str:
    """1.345e8 -> '135M'; 7e10 -> '70B'."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


# --------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the memory formulas need about a model. ``num_params`` of the 7B/70B presets are
    the nominal sizes the book's arithmetic uses (70B fp16 = 140 GB)."""

    name: str
    num_params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int

    @classmethod
    def from_config(cls, config: ModelConfig, name: str | None = None) -> "ModelSpec":
        return cls(name or config.name, float(config.num_params()), config.num_layers,
                   config.num_heads, config.num_kv_heads, config.head_dim,
                   config.max_position_embeddings)

    def kv_bytes_per_token(self, dtype_bytes: float, num_kv_heads: int | None = None) -> float:
        return calc.kv_cache_bytes_per_token(self.num_layers, num_kv_heads or self.num_kv_heads,
                                             self.head_dim, dtype_bytes)


MODEL_PRESETS: dict[str, ModelSpec] = {
    "SmolLM2-135M": ModelSpec.from_config(ModelConfig.smollm2_135m(), "SmolLM2-135M"),
    "Llama-3-8B": ModelSpec("Llama-3-8B", 8.0e9, 32, 32, 8, 128, 8192),
    "Llama-2-70B": ModelSpec("Llama-2-70B", 70e9, 80, 64, 8, 128, 4096),
}


def display_name(name: str, num_params: float | None = None) -> str:
    """A preset's short name when ``num_params`` matches it (within 1%), else ``name``.

    The GGUF file names SmolLM2 "Smollm2 135M 8k Lc100K Mix1 Ep2"; figures say "SmolLM2-135M".
    """
    if num_params:
        for key, spec in MODEL_PRESETS.items():
            if abs(spec.num_params - num_params) <= 0.01 * spec.num_params:
                return key
    return name


def model_spec(model) -> ModelSpec:
    """A preset name, a ``ModelSpec`` or a ``ModelConfig`` -> ``ModelSpec``."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, ModelConfig):
        return ModelSpec.from_config(model)
    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]
    raise ValueError(f"model must be one of {list(MODEL_PRESETS)}, a ModelSpec or a "
                     f"minillm.ModelConfig; got {model!r}.")


def dtype_bytes(dtype: str) -> float:
    """'fp16' -> 2 (see ``calc.DTYPE_BYTES``)."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in calc.DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(calc.DTYPE_BYTES)}; got {dtype!r}.")
    return calc.DTYPE_BYTES[key]


# --------------------------------------------------------------------------- hardware


@dataclasses.dataclass(frozen=True)
class Limits:
    """The three numbers a roofline needs, plus where they came from."""

    label: str
    bandwidth: float            # bytes/s
    peak_flops: float           # FLOP/s in the dtype asked for
    memory_bytes: float | None  # capacity; None when unknown (this machine)
    note: str = ""              # an assumption made, shown to the student
    measured: bool = False


_TORCH_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16",
                "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def machine_limits(profile, dtype: str = "fp32") -> Limits:
    """This machine's measured bandwidth and matmul FLOP/s in ``dtype`` (a MachineProfile)."""
    key = _TORCH_NAMES.get(str(dtype).lower())
    note = ""
    if key is None or key not in profile.matmul_flops:
        note = (f"no {dtype} matmul was measured here; using the measured float32 peak "
                f"(weights dequantized to fp32 before multiplying)")
        key = "float32"
    return Limits(f"{profile.device_name} ({profile.num_threads} threads)",
                  profile.bandwidth_bytes_per_s, profile.matmul_flops[key], None, note, True)


def gpu_limits(name_or_hw, dtype: str = "bf16") -> Limits:
    """A catalog GPU's datasheet bandwidth and dense peak for ``dtype``.

    fp32 has no tensor-core figure in the catalog and int8/int4 here mean weight-only
    quantization (the matmul runs in fp16), so both use the fp16/bf16 peak, with a note.
    A chip without fp8 falls back to bf16, also with a note.
    """
    hw = name_or_hw if isinstance(name_or_hw, hardware.Hardware) else hardware.get(name_or_hw)
    key = str(dtype).lower()
    note = ""
    if key in ("fp32", "float32"):
        key, note = "bf16", "the catalog has no fp32 figure; using the bf16 tensor-core peak (optimistic)"
    elif key in ("int8", "int4"):
        key, note = "fp16", f"{dtype} as weight-only quantization: the matmul runs at the fp16 peak"
    elif key in ("fp8", "float8") and hw.fp8_flops is None:
        key, note = "bf16", f"{hw.name} has no fp8 tensor cores; using its bf16 peak"
    return Limits(hw.name, hw.bandwidth_bytes_per_s, hw.peak_flops(key), hw.memory_bytes, note)


def resolve_limits(hw, dtype: str, profile=None) -> Limits:
    """``THIS_MACHINE`` (needs ``profile``), a catalog name, a ``Hardware`` or ``Limits``."""
    if isinstance(hw, Limits):
        return hw
    if hw == THIS_MACHINE:
        if profile is None:
            raise ValueError(f"hardware={THIS_MACHINE!r} needs a MachineProfile: pass "
                             "profile=minillm.perf.measure_machine().")
        return machine_limits(profile, dtype)
    return gpu_limits(hw, dtype)


def measured_footnote(profile) -> str:
    """Where and when this machine's numbers were measured, for a figure's footer."""
    when = str(profile.measured_at)[:16].replace("T", " ")
    return (f"Measured on {profile.device_name}, {profile.num_threads} threads, torch "
            f"{profile.torch_version}, {when} UTC. Medians; on a shared machine they vary "
            f"from run to run.")


# --------------------------------------------------------------------------- figures


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
