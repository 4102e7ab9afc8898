"""The speculative-decoding simulator, and the figures of Lab 07.

A draft guesses k tokens, the target scores them in one pass, and each guess survives only
if every guess before it did. With a per-guess acceptance rate α, a draft step costing r
target steps and a verify pass costing c target steps (``minillm.calc``):

    expected tokens per pass  E = (1 − α^(k+1)) / (1 − α)      (the shortcut says k·α + 1)
    speedup                   E / (c + k·r)

    widgets.speculation.view(alpha=0.8, k=4, cost_ratio=0.05, verify_cost=1.3,
                             measured=run.rows,            # sliders α, k, r, c; measured
                             verify_cost_by_k=costs.verify_cost)   # points, and c(k) as measured

Pure functions: ``speculation_data`` (the simulator), ``position_data`` (acceptance by draft
position, from traces), ``batch_cost_data`` (speculation against the batch, from the
engine's measured step times); figures: ``draw_speculation``, ``draw_positions``,
``draw_batch_cost`` (``display(figure_image(fig))`` shows one in a notebook); view:
``SpeculationView`` (CSS class ``minillm-speculation``).
Measurements come from ``widgets.spec_runs``; nothing here runs a model.

Invariants: every curve is ``calc.spec_expected_tokens`` / ``calc.spec_speedup`` /
``calc.spec_optimal_k`` evaluated, never re-derived; measured points are drawn as given.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from minillm import calc

from ._view import COLORS, FigureView, figure_image, new_figure

__all__ = ["MeasuredPoint", "SpeculationData", "speculation_data", "draw_speculation",
           "PositionData", "position_data", "draw_positions", "BatchCostData",
           "batch_cost_data", "draw_batch_cost", "figure_image", "SpeculationView", "view"]


@dataclasses.dataclass
class MeasuredPoint:
    k: int
    speedup: float
    tokens_per_pass: float | None = None


def _points(measured) -> list[MeasuredPoint]:
    """Rows with .k and .speedup (``spec_runs.SpeedupRow``), or (k, speedup[, tokens/pass])."""
    out = []
    for m in measured or ():
        if isinstance(m, (tuple, list)):
            out.append(MeasuredPoint(int(m[0]), float(m[1]), float(m[2]) if len(m) > 2 else None))
        else:
            out.append(MeasuredPoint(int(m.k), float(m.speedup), getattr(m, "tokens_per_pass", None)))
    return out


@dataclasses.dataclass
class SpeculationData:
    alpha: float
    k: int
    cost_ratio: float
    verify_cost: float
    ks: np.ndarray              # 0 .. k_max
    tokens: np.ndarray          # calc.spec_expected_tokens at each k
    tokens_naive: np.ndarray    # the shortcut k·α + 1
    speedup: np.ndarray         # calc.spec_speedup with verify_cost
    speedup_one_step: np.ndarray  # ... with a verify pass costing one step (c = 1)
    optimal_k: int
    measured: list
    title: str
    summary: list = dataclasses.field(default_factory=list)
    verify_cost_by_k: dict = dataclasses.field(default_factory=dict)  # measured c(k)
    speedup_by_k: dict = dataclasses.field(default_factory=dict)      # ... and E / (c(k) + k·r)

    @property
    def expected_tokens(self) -> float:
        return float(self.tokens[self.k])

    @property
    def speedup_at_k(self) -> float:
        return float(self.speedup[self.k])


def speculation_data(alpha: float = 0.8, k: int = 4, cost_ratio: float = 0.05,
                     verify_cost: float = 1.0, measured=(), k_max: int = 16,
                     verify_cost_by_k=None) -> SpeculationData:
    """Expected tokens per pass and speedup for k = 0..k_max, at α, r and c. With
    ``verify_cost_by_k`` ({k: c measured for k}), also the speedup with each k's own c."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= k_max:
        raise ValueError(f"k must be an int in [0, {k_max}]; got {k!r}.")
    ks = np.arange(k_max + 1)
    tokens = np.array([calc.spec_expected_tokens(alpha, int(j)) for j in ks])
    naive = np.array([calc.spec_expected_tokens_naive(alpha, int(j)) for j in ks])
    speed = np.array([calc.spec_speedup(alpha, int(j), cost_ratio, verify_cost) for j in ks])
    one = np.array([calc.spec_speedup(alpha, int(j), cost_ratio) for j in ks])
    best = calc.spec_optimal_k(alpha, cost_ratio, k_max, verify_cost)
    points = _points(measured)
    cost = (verify_cost if k else 1.0) + k * cost_ratio
    summary = [
        f"α = {alpha:.2f}, k = {k}: {tokens[k]:.2f} tokens per target pass, (1 − α^(k+1)) / (1 − α); "
        f"the shortcut k·α + 1 says {naive[k]:.2f}",
        f"one round costs c + k·r = {verify_cost if k else 1.0:.2f} + {k} × {cost_ratio:.3f} = "
        f"{cost:.2f} plain decode steps: speedup {speed[k]:.2f}× ({one[k]:.2f}× if the verify "
        f"pass cost one step, c = 1)",
        (f"best k for these α, r, c: {best} ({speed[best]:.2f}×)" if best else
         "speculation does not pay for these α, r, c: the best k is 0 (plain decoding)"),
    ]
    by_k = {int(j): float(c) for j, c in sorted((verify_cost_by_k or {}).items()) if 1 <= j <= k_max}
    speed_by_k = {j: calc.spec_speedup(alpha, j, cost_ratio, c) for j, c in by_k.items()}
    if speed_by_k:
        j = max(speed_by_k, key=lambda x: (speed_by_k[x], -x))
        summary.append(f"with this machine's c(k) at the measured k: best k = {j} "
                       f"({speed_by_k[j]:.2f}×, c = {by_k[j]:.2f})")
    if points:
        summary.append("measured: " + ", ".join(f"k = {p.k}: {p.speedup:.2f}×" for p in points))
    title = f"Speculative decoding: α = {alpha:.2f}, r = {cost_ratio:.3f}, c = {verify_cost:.2f}"
    return SpeculationData(float(alpha), int(k), float(cost_ratio), float(verify_cost), ks, tokens,
                           naive, speed, one, best, points, title, summary, by_k, speed_by_k)


def draw_speculation(data: SpeculationData, fig=None):
    """Left: tokens per target pass against k (formula, shortcut, measured). Right: speedup
    against k (with the verify cost c, with c = 1, measured), the best k starred."""
    fig = fig or new_figure(12, 4.6)
    ax, ax2 = fig.subplots(1, 2)
    ks = data.ks
    ax.plot(ks, data.tokens, color=COLORS["machine"], lw=2, label="(1 − α^(k+1)) / (1 − α)")
    ax.plot(ks, data.tokens_naive, color=COLORS["bound"], ls="--", lw=1.3,
            label="shortcut k·α + 1 (overestimates)")
    ax.plot(ks, ks + 1, color=COLORS["grey"], ls=":", lw=1, label="every guess accepted: k + 1")
    ax.plot([data.k], [data.expected_tokens], "o", ms=8, color=COLORS["machine"])
    pts = [p for p in data.measured if p.tokens_per_pass is not None]
    if pts:
        ax.plot([p.k for p in pts], [p.tokens_per_pass for p in pts], "D", color=COLORS["measured"],
                label="measured on this machine")
    ax.set_xlabel("draft tokens per pass, k")
    ax.set_ylabel("tokens per target pass")
    ax.set_ylim(0, max(4.0, min(float(data.tokens_naive.max()), 1.3 * float(data.tokens.max()) + 1),
                       1.1 * max((p.tokens_per_pass for p in pts), default=0.0)))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)

    ax2.plot(ks, data.speedup, color=COLORS["machine"], lw=2,
             label=f"E / (c + k·r), c = {data.verify_cost:.2f}")
    ax2.plot(ks, data.speedup_one_step, color=COLORS["gpu"], ls="--", lw=1.3,
             label="the same with c = 1 (a memory-bound verify pass)")
    if data.speedup_by_k:
        ax2.plot(list(data.speedup_by_k), list(data.speedup_by_k.values()), "s-.",
                 color=COLORS["kv"], lw=1.3, label="with this machine's c(k), measured per k")
    ax2.axhline(1.0, color=COLORS["grey"], lw=1)
    ax2.plot([data.k], [data.speedup_at_k], "o", ms=8, color=COLORS["machine"])
    ax2.plot([data.optimal_k], [data.speedup[data.optimal_k]], "*", ms=15, color=COLORS["compute"],
             label=f"best k = {data.optimal_k}")
    if data.measured:
        ax2.plot([p.k for p in data.measured], [p.speedup for p in data.measured], "D",
                 color=COLORS["measured"], label="measured on this machine")
    top = max(float(data.speedup.max()), float(data.speedup_one_step.max()),
              max((p.speedup for p in data.measured), default=0.0),
              max(data.speedup_by_k.values(), default=0.0))
    ax2.set_ylim(0, 1.15 * top + 0.1)
    ax2.set_xlabel("draft tokens per pass, k")
    ax2.set_ylabel("speedup over plain decoding")
    ax2.legend(fontsize=8, loc="lower right")
    ax2.grid(True, alpha=0.3)
    fig.suptitle(data.title, fontsize=10)
    return fig


# --------------------------------------------------------------------------- acceptance by position


@dataclasses.dataclass
class PositionData:
    names: list
    alpha: dict          # name -> overall α of that trace
    conditional: dict    # name -> [k] acceptance at position j, earlier guesses kept
    reach: dict          # name -> [k] fraction of offered j-th guesses kept; α^j if independent
    judged: dict         # name -> [k] how many guesses each rate is over
    summary: list = dataclasses.field(default_factory=list)


def position_data(traces: dict) -> PositionData:
    """Acceptance by draft position for each ``spec_runs.SpecTrace`` (by name)."""
    names, alpha, cond, reach, judged, summary = list(traces), {}, {}, {}, {}, []
    for name, t in traces.items():
        s = t.position_stats()
        alpha[name], cond[name] = t.acceptance_rate, s.conditional
        reach[name], judged[name] = s.reach, s.judged
        rates = ", ".join("–" if n == 0 else f"{c:.2f} of {n}" for c, n in zip(s.conditional, s.judged))
        summary.append(f"{name}: α = {t.acceptance_rate:.2f} over {t.num_guesses} guesses in "
                       f"{len(t.passes)} passes ({t.tokens_per_pass:.2f} tokens per pass); "
                       f"kept at positions 1..{t.k}, given the earlier guesses kept: {rates}")
    return PositionData(names, alpha, cond, reach, judged, summary)


def draw_positions(data: PositionData, fig=None):
    """Left: acceptance at each draft position given the earlier guesses kept (bars, with the
    number of guesses each is over), against the overall α. Right: the fraction of offered
    j-th guesses kept, against α^j (independent acceptances)."""
    fig = fig or new_figure(12, 4)
    ax, ax2 = fig.subplots(1, 2)
    width = 0.8 / max(1, len(data.names))
    palette = [COLORS["machine"], COLORS["kv"], COLORS["compute"], COLORS["bound"]]
    k = max(len(v) for v in data.conditional.values())
    for i, name in enumerate(data.names):
        color = palette[i % len(palette)]
        j = np.arange(1, len(data.conditional[name]) + 1)
        x = j + (i - (len(data.names) - 1) / 2) * width
        heights = np.nan_to_num(data.conditional[name])
        ax.bar(x, heights, width, color=color, label=name)
        for xi, h, n in zip(x, heights, data.judged[name]):
            ax.text(xi, h + 0.02, f"{n}", ha="center", fontsize=7, color="#444")
        ax.axhline(data.alpha[name], color=color, ls="--", lw=1)
        ax2.plot(j, data.reach[name], "o-", color=color, label=f"{name}: measured")
        ax2.plot(j, data.alpha[name] ** j, ":", color=color, label=f"{name}: α^j (independent)")
    ax.set_xlabel("draft position j (the number over a bar: guesses it is over)")
    ax.set_ylabel("P(guess j kept | guesses 1..j−1 kept)")
    ax.set_title("acceptance at each position (dashed: overall α)", fontsize=10)
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8, loc="lower right")
    ax2.set_xlabel("draft position j")
    ax2.set_ylabel("fraction of j-th guesses kept")
    ax2.set_title("how far into the guesses a pass gets", fontsize=10)
    ax2.set_ylim(0, 1.05)
    ax2.legend(fontsize=7.5)
    for a in (ax, ax2):
        a.set_xticks(range(1, k + 1))
        a.grid(True, alpha=0.3)
    return fig


# --------------------------------------------------------------------------- the batch


@dataclasses.dataclass
class BatchCostData:
    batch_sizes: np.ndarray   # measured step batch sizes
    step_s: np.ndarray
    k: int
    spec_batches: np.ndarray  # batches whose verify pass, batch · (k + 1) rows, was measured
    verify_cost: np.ndarray   # step(batch · (k + 1)) / step(batch)
    speedup: dict             # α -> calc.spec_speedup(α, k, r, verify_cost) at each batch
    summary: list = dataclasses.field(default_factory=list)


def batch_cost_data(cost, alphas=(0.8,), k: int = 3, cost_ratio: float = 0.0) -> BatchCostData:
    """Speculation at each batch size, priced by the engine's measured step times
    (``spec_runs.BatchCost``): a verify pass for B sequences moves B · (k + 1) rows, so it
    costs step(B · (k + 1)) / step(B) plain steps. One speedup curve per α in ``alphas``."""
    sizes, steps = np.asarray(cost.batch_sizes), np.asarray(cost.step_s)
    spec_b = np.array([b for b in sizes if b * (k + 1) <= sizes.max()])
    if not len(spec_b):
        raise ValueError(f"no measured batch has room for {k + 1} rows per sequence: measure up to "
                         f"at least {k + 1} rows")
    c = np.array([cost.verify_cost(int(b), k) for b in spec_b])
    speed = {float(a): np.array([calc.spec_speedup(a, k, cost_ratio, float(x)) for x in c])
             for a in alphas}
    summary = [f"batch {b:>3}: step {t * 1e3:6.1f} ms, {t / b * 1e3:6.2f} ms per sequence, "
               f"{t / steps[0]:5.2f}× the batch-1 step" for b, t in zip(sizes, steps)]
    summary += [f"k = {k}: at batch {b:>2} a verify pass costs {x:.2f} plain steps; speedup "
                + ", ".join(f"{s[i]:.2f}× at α = {a:.2f}" for a, s in speed.items())
                for i, (b, x) in enumerate(zip(spec_b, c))]
    for a in speed:
        e = calc.spec_expected_tokens(a, k)
        lost = [int(b) for b, x in zip(spec_b, c) if x + k * cost_ratio > e]
        summary.append(f"α = {a:.2f} yields {e:.2f} tokens per pass, so speculation stops paying once a "
                       f"verify pass costs more than {e:.2f} steps: "
                       + (f"from batch {lost[0]} on this machine" if lost else
                          f"not within the measured batches (the verify pass reached {c.max():.2f} steps)"))
    return BatchCostData(sizes, steps, int(k), spec_b, c, speed, summary)


def draw_batch_cost(data: BatchCostData, fig=None):
    """Left: the engine's step time against the rows in it, beside a flat line (memory-bound)
    and a line proportional to the rows (compute-bound). Middle: what a verify pass costs at
    each batch, between free (1 step) and full price (k + 1 steps). Right: the speedup."""
    fig = fig or new_figure(14, 4.3)
    ax, ax2, ax3 = fig.subplots(1, 3)
    b, t = data.batch_sizes, data.step_s * 1e3
    ax.plot(b, t, "o-", color=COLORS["measured"], lw=2, label="measured: LLMEngine.step")
    ax.plot(b, np.full(len(b), t[0]), ":", color=COLORS["weights"],
            label="flat (memory-bound: rows are free)")
    ax.plot(b, t[-1] * b / b[-1], "--", color=COLORS["bound"],
            label="proportional to the rows (compute-bound)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(b, [str(x) for x in b])
    ax.set_xlabel("rows in the step (sequences decoding)")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=7.5)
    ax.grid(True, alpha=0.3, which="both")
    sb = data.spec_batches
    for a in (ax2, ax3):
        a.set_xscale("log", base=2)
        a.set_xticks(sb, [str(x) for x in sb])
        a.set_xlabel("batch (sequences)")
        a.grid(True, alpha=0.3)
    ax2.plot(sb, data.verify_cost, "D-", color=COLORS["kv"],
             label=f"measured: step({data.k + 1}·B) / step(B)")
    ax2.axhline(1.0, color=COLORS["weights"], ls=":", label="free: one step")
    ax2.axhline(data.k + 1, color=COLORS["bound"], ls="--", label=f"full price: k + 1 = {data.k + 1} steps")
    ax2.set_ylim(0, data.k + 1.5)
    ax2.set_ylabel(f"verify pass, k = {data.k} (plain steps)")
    ax2.legend(fontsize=7.5)
    palette = [COLORS["machine"], COLORS["gpu"], COLORS["compute"]]
    top = 1.0
    for i, (a, s) in enumerate(data.speedup.items()):
        e = calc.spec_expected_tokens(a, data.k)
        color = palette[i % len(palette)]
        ax3.plot(sb, s, "D-", color=color, label=f"α = {a:.2f}")
        ax3.axhline(e, color=color, ls=":", lw=1,
                    label="dotted: if a verify pass cost one step" if i == 0 else None)
        top = max(top, e)
    ax3.axhline(1.0, color=COLORS["grey"], lw=1.5)
    ax3.set_ylim(0, top * 1.15)
    ax3.set_ylabel(f"speculative speedup, k = {data.k}")
    ax3.legend(fontsize=7.5)
    return fig


# --------------------------------------------------------------------------- the view


class SpeculationView(FigureView):
    """Controls: ``alpha``, ``k``, ``cost_ratio`` (r), ``verify_cost`` (c); ``measured``
    points (rows with .k, .speedup, .tokens_per_pass) are drawn on the curves, and with
    ``verify_cost_by_k`` ({k: c}) a curve that uses each k's own measured c."""

    css = "minillm-speculation"

    def __init__(self, alpha: float = 0.8, k: int = 4, cost_ratio: float = 0.05,
                 verify_cost: float = 1.0, measured=(), k_max: int = 16, verify_cost_by_k=None):
        import ipywidgets as w

        self.measured, self.k_max = list(measured or ()), k_max
        self.verify_cost_by_k = dict(verify_cost_by_k or {})
        controls = {
            "alpha": w.FloatSlider(value=alpha, min=0.0, max=1.0, step=0.01, description="α (acceptance)"),
            "k": w.IntSlider(value=k, min=0, max=k_max, description="k (draft tokens)"),
            "cost_ratio": w.FloatSlider(value=cost_ratio, min=0.0, max=max(1.0, cost_ratio),
                                        step=0.001, readout_format=".3f",
                                        description="r (draft step ÷ target step)"),
            "verify_cost": w.FloatSlider(value=verify_cost, min=min(0.5, verify_cost),
                                         max=max(4.0, verify_cost), step=0.01,
                                         description="c (verify pass ÷ target step)"),
        }
        super().__init__(controls)

    def compute(self) -> SpeculationData:
        c = self.controls
        return speculation_data(c["alpha"].value, c["k"].value, c["cost_ratio"].value,
                                c["verify_cost"].value, self.measured, self.k_max,
                                self.verify_cost_by_k)

    def draw(self, data):
        return draw_speculation(data)


def view(**kwargs) -> SpeculationView:
    """``display(widgets.speculation.view(alpha=..., measured=run.rows))``."""
    return SpeculationView(**kwargs)
