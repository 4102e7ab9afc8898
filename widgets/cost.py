"""The Lab 10 cost widget: what serving a model on rented GPUs costs, how many GPUs a load
needs, and where renting breaks even against an API.

Inputs: the model's size (billions of parameters, and its dtype), the GPU (the catalog of
``minillm.hardware``), its price per hour (the catalog's indicative price unless given), the
utilization (the fraction of paid hours spent serving), the throughput one GPU reaches
(tok/s: measured, or assumed), the target load (tok/s) and the API's price per 1M tokens.
Outputs, all from ``minillm.calc``: $ per 1M tokens, the GPUs needed (enough to hold the
weights AND to serve the load), and the break-even (tokens a month, and utilization).

Invariants: ``cost_data`` is pure; the GPUs needed are a whole number of replicas, each
replica the fewest GPUs (a power of two, as tensor parallelism wants) whose usable memory
(90%) holds the weights with at least ``KV_HEADROOM`` of it left for the KV cache.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from minillm import calc, hardware

from ._view import COLORS, FigureView, new_figure

__all__ = ["CostData", "cost_data", "gpus_per_replica", "draw_cost", "CostView", "view",
           "KV_HEADROOM"]

KV_HEADROOM = 0.1           # fraction of a replica's usable memory kept for the KV cache
USABLE = 0.9                # gpu_memory_utilization, as calc.memory_budget's default


@dataclasses.dataclass
class CostData:
    title: str
    params_b: float
    gpu: str
    dollars_per_hour: float
    utilization: float
    tokens_per_s: float                 # per GPU
    target_tokens_per_s: float
    api_dollars_per_million: float
    dollars_per_million: float          # at this utilization
    gpus_per_replica: int
    gpus_for_load: int
    gpus_needed: int
    dollars_per_month: float            # gpus_needed around the clock
    break_even_tokens_per_month: float
    break_even_utilization: float
    utilizations: np.ndarray            # the curve's x
    curve: np.ndarray                   # $ per 1M tokens along it
    summary: list


def gpus_per_replica(params_b: float, gpu: str, dtype_bytes: float = 2, max_gpus: int = 64) -> int:
    """The fewest GPUs (1, 2, 4, ...) whose usable memory holds the weights and leaves
    ``KV_HEADROOM`` of it for KV. Raises ValueError if even ``max_gpus`` cannot."""
    weights = calc.weight_bytes(params_b * 1e9, dtype_bytes)
    memory = hardware.get(gpu).memory_bytes
    n = 1
    while weights > (1 - KV_HEADROOM) * USABLE * n * memory:
        n *= 2
        if n > max_gpus:
            raise ValueError(f"a {params_b:g}B model in {dtype_bytes} bytes per weight does not fit "
                             f"{max_gpus} {gpu}s; pick a larger GPU or fewer bytes per weight.")
    return n


def cost_data(params_b: float = 70.0, gpu: str = "A100-80GB", dollars_per_hour: float | None = None,
              utilization: float = 0.5, tokens_per_s: float = 800.0,
              target_tokens_per_s: float = 20_000.0, api_dollars_per_million: float = 2.0,
              dtype_bytes: float = 2) -> CostData:
    """Everything the cost widget shows. ``tokens_per_s`` is what ONE GPU serves while busy
    (a replica of n GPUs serves n times that); ``dollars_per_hour`` is one GPU's price."""
    price = hardware.get(gpu).price_per_hour if dollars_per_hour is None else dollars_per_hour
    per_replica = gpus_per_replica(params_b, gpu, dtype_bytes)
    per_million = calc.cost_per_million_tokens(price, tokens_per_s, utilization)
    for_load = calc.gpus_for_load(target_tokens_per_s, tokens_per_s)
    needed = per_replica * math.ceil(for_load / per_replica)
    monthly = calc.gpu_dollars_per_month(price, needed)
    be_tokens = calc.break_even_tokens_per_month(monthly, api_dollars_per_million)
    be_util = calc.break_even_utilization(price, tokens_per_s, api_dollars_per_million)
    us = np.linspace(0.02, 1.0, 99)
    curve = np.array([calc.cost_per_million_tokens(price, tokens_per_s, u) for u in us])
    verdict = (f"renting wins above {be_util:.0%} utilization" if be_util <= 1 else
               f"the API wins even at full load (renting would need {be_util:.0%})")
    summary = [
        f"$ per 1M tokens: ${per_million:.3f} at {utilization:.0%} utilization "
        f"(${price:.2f}/h per {gpu}, {tokens_per_s:,.0f} tok/s per GPU)",
        f"GPUs needed: {needed} ({math.ceil(for_load / per_replica)} replica(s) of {per_replica}: "
        f"{per_replica} to hold the {params_b:g}B weights, {for_load} to serve "
        f"{target_tokens_per_s:,.0f} tok/s), ${monthly:,.0f} a month",
        f"break-even against ${api_dollars_per_million:.2f} per 1M: "
        f"{be_tokens / 1e9:,.2f} billion tokens a month; {verdict}",
    ]
    return CostData(f"{params_b:g}B on {gpu}", params_b, gpu, price, utilization, tokens_per_s,
                    target_tokens_per_s, api_dollars_per_million, per_million, per_replica,
                    for_load, needed, monthly, be_tokens, be_util, us, curve, summary)


def draw_cost(data: CostData, fig=None):
    """Left: $ per 1M tokens against utilization, the API's price and the break-even.
    Right: the monthly bill against tokens a month, renting (flat) against the API (linear)."""
    fig = fig or new_figure(11, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(data.utilizations * 100, data.curve, color=COLORS["weights"], label=f"self-hosted, {data.gpu}")
    ax1.axhline(data.api_dollars_per_million, color=COLORS["bound"], ls="--", label="API price")
    ax1.plot([data.utilization * 100], [data.dollars_per_million], "o", color=COLORS["measured"],
             label=f"you: ${data.dollars_per_million:.3f}")
    if data.break_even_utilization <= 1:
        ax1.axvline(data.break_even_utilization * 100, color=COLORS["grey"], ls=":",
                    label=f"break-even: {data.break_even_utilization:.0%}")
    ax1.set_yscale("log")
    ax1.set_xlabel("utilization (% of paid hours serving)")
    ax1.set_ylabel("$ per 1M tokens")
    ax1.legend(fontsize=8)
    capacity = calc.tokens_per_month(data.tokens_per_s * data.gpus_needed)
    tokens = np.linspace(0, capacity, 50)
    ax2.plot(tokens / 1e9, np.full_like(tokens, data.dollars_per_month), color=COLORS["weights"],
             label=f"{data.gpus_needed} × {data.gpu}, rented")
    ax2.plot(tokens / 1e9, tokens / 1e6 * data.api_dollars_per_million, color=COLORS["bound"],
             ls="--", label="API")
    if data.break_even_tokens_per_month <= capacity:
        ax2.axvline(data.break_even_tokens_per_month / 1e9, color=COLORS["grey"], ls=":",
                    label=f"break-even: {data.break_even_tokens_per_month / 1e9:,.1f} B tokens")
    ax2.set_xlabel("tokens a month (billions), up to the GPUs' capacity")
    ax2.set_ylabel("$ a month")
    ax2.legend(fontsize=8)
    fig.suptitle(data.title)
    return fig


class CostView(FigureView):
    """Controls: ``params_b``, ``gpu``, ``price`` ($/h per GPU), ``utilization``,
    ``tokens_per_s`` (per GPU), ``target`` (tok/s) and ``api_price`` ($ per 1M)."""

    css = "minillm-cost"

    def __init__(self, params_b: float = 70.0, gpu: str = "A100-80GB", dollars_per_hour: float | None = None,
                 utilization: float = 0.5, tokens_per_s: float = 800.0,
                 target_tokens_per_s: float = 20_000.0, api_dollars_per_million: float = 2.0):
        import ipywidgets as w

        names = [n for n, h in hardware.CATALOG.items() if h.interconnect_bytes_per_s]
        price = hardware.get(gpu).price_per_hour if dollars_per_hour is None else dollars_per_hour
        controls = {
            "params_b": w.FloatText(value=params_b, description="model (B params)"),
            "gpu": w.Dropdown(options=names, value=gpu, description="GPU"),
            "price": w.FloatText(value=price, step=0.05, description="$/h per GPU"),
            "utilization": w.FloatSlider(value=utilization, min=0.02, max=1.0, step=0.01,
                                         description="utilization"),
            "tokens_per_s": w.FloatText(value=tokens_per_s, description="tok/s per GPU"),
            "target": w.FloatText(value=target_tokens_per_s, description="target load (tok/s)"),
            "api_price": w.FloatText(value=api_dollars_per_million, step=0.1, description="API $ per 1M"),
        }
        controls["gpu"].observe(self._gpu_changed, names="value")
        super().__init__(controls, [[controls[k] for k in ("params_b", "gpu", "price", "utilization")],
                                    [controls[k] for k in ("tokens_per_s", "target", "api_price")]])

    def _gpu_changed(self, change) -> None:
        """A new GPU brings its catalog price (which redraws once more)."""
        self.controls["price"].value = hardware.get(change["new"]).price_per_hour

    def compute(self) -> CostData:
        c = self.controls
        for name in ("params_b", "price", "tokens_per_s", "target", "api_price"):
            if not c[name].value > 0:
                raise ValueError(f"{c[name].description} must be > 0; got {c[name].value}.")
        return cost_data(c["params_b"].value, c["gpu"].value, c["price"].value, c["utilization"].value,
                         c["tokens_per_s"].value, c["target"].value, c["api_price"].value)

    def draw(self, data):
        return draw_cost(data)


def view(**kwargs) -> CostView:
    """``display(widgets.cost.view(tokens_per_s=measured_tok_s, ...))``."""
    return CostView(**kwargs)
