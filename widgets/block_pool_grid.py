"""The KV block pool as a grid, over time, against contiguous reservation (Lab 04).

The real ``BlockManager`` and ``Scheduler`` run the serving workload
(benchmarks/workload.json) on a pool of ``num_blocks`` blocks of 16 tokens, with every
request queued at t = 0, through ``widgets.batching.simulate`` (no model: a step only
advances the scheduler). At each step we record which request holds each block and how
many of its 16 slots are filled.

Two ways to hold the same KV memory (``num_blocks · block_size`` token slots):

- **paged**: a request holds ceil(tokens / 16) blocks, anywhere in the pool; the only
  waste is the unfilled tail of each request's last block (internal fragmentation < 16
  slots per sequence);
- **contiguous**: each request reserves ``max_len`` slots in one piece at admission
  (its prompt + the most it may generate), so floor(slots / max_len) requests fit, and the
  reservation beyond what a request holds right now is waste.

    waste = 1 − (token slots holding a token) / (slots reserved), summed over all steps

Pure functions: ``block_pool_data``; ``fragmentation_series`` (per step, the metric a server
exports: empty ÷ allocated slots of the paged pool) and ``first_alert`` (the step at which an
alert "above a threshold for N consecutive steps" fires, like Prometheus' ``for:``); figure:
``draw_block_pool``; view: ``BlockPoolView`` (CSS class ``minillm-block-pool``; controls
``step`` and ``num_blocks``).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ._view import COLORS, FigureView, new_figure
from .batching import SimResult, load_workload, simulate

__all__ = ["PoolRun", "BlockPoolData", "run_pool", "block_pool_data", "draw_block_pool",
           "BlockPoolView", "view", "fragmentation_series", "first_alert"]

MAX_LEN = 512  # the workload's longest possible request: 256 prompt + 256 output tokens


@dataclasses.dataclass
class PoolRun:
    """Both allocators on the same workload and the same memory."""
    paged: SimResult              # the real BlockManager, blocks recorded per step
    contiguous: SimResult         # the same scheduler, at most floor(slots / max_len) sequences
    num_blocks: int
    block_size: int
    max_len: int
    paged_waste: float            # fraction of allocated slots holding no token
    contiguous_waste: float       # fraction of reserved slots holding no token
    paged_mean_running: float
    contiguous_max_running: int


def _waste(steps, reserved) -> float:
    held = sum(s.num_kv_tokens for s in steps)
    total = sum(reserved(s) for s in steps)
    return 1 - held / total if total else 0.0


@functools.lru_cache(maxsize=8)
def run_pool(num_blocks: int = 256, num_requests: int = 64, block_size: int = 16,
             max_len: int = MAX_LEN) -> PoolRun:
    """Run the workload through a paged pool of ``num_blocks`` and through contiguous
    reservation of the same memory (cached: the view's slider only picks a step)."""
    reqs = load_workload(num_requests)
    slots = num_blocks * block_size
    n_contig = slots // max_len
    if n_contig < 1:
        raise ValueError(f"{num_blocks} blocks of {block_size} = {slots} slots cannot hold one "
                         f"contiguous reservation of {max_len} tokens; give the pool more blocks")
    paged = simulate(reqs, max_num_seqs=256, max_num_batched_tokens=512, num_blocks=num_blocks,
                     block_size=block_size, record_blocks=True)
    contig = simulate(reqs, max_num_seqs=n_contig, max_num_batched_tokens=512,
                      num_blocks=num_blocks, block_size=block_size)
    return PoolRun(paged, contig, num_blocks, block_size, max_len,
                   _waste(paged.steps, lambda s: s.num_used_blocks * block_size),
                   _waste(contig.steps, lambda s: len(s.slots) * max_len),
                   float(np.mean([len(s.slots) for s in paged.steps])), n_contig)


def fragmentation_series(run: PoolRun) -> list[float]:
    """The paged pool's fragmentation at every step that holds blocks: 1 − tokens held ÷
    (blocks used · block_size). This is the gauge a server exports and alerts on."""
    bs = run.block_size
    return [1 - s.num_kv_tokens / (s.num_used_blocks * bs) for s in run.paged.steps if s.num_used_blocks]


def first_alert(series, threshold: float, for_steps: int) -> int | None:
    """Index of the step at which ``series`` has been above ``threshold`` for ``for_steps``
    consecutive steps (the alert fires there), or None if it never does. A single spike
    does not fire: a pool briefly fragmented while requests come and go is normal."""
    if for_steps < 1:
        raise ValueError(f"for_steps must be at least 1, got {for_steps}")
    run_len = 0
    for i, value in enumerate(series):
        run_len = run_len + 1 if value > threshold else 0
        if run_len == for_steps:
            return i
    return None


@dataclasses.dataclass
class BlockPoolData:
    run: PoolRun
    step: int
    owner: np.ndarray             # [num_blocks] request index, -1 free
    fill: np.ndarray              # [num_blocks] slots filled (0..block_size)
    num_running: int
    contiguous_running: int       # sequences the contiguous run had at the same step index
    title: str
    summary: list = dataclasses.field(default_factory=list)


def block_pool_data(step: int = 100, num_blocks: int = 256, num_requests: int = 64) -> BlockPoolData:
    run = run_pool(num_blocks, num_requests)
    steps = run.paged.steps
    if not 0 <= step < len(steps):
        raise ValueError(f"step must be in [0, {len(steps) - 1}], got {step}")
    rec = steps[step]
    cstep = run.contiguous.steps[min(step, len(run.contiguous.steps) - 1)]
    used = rec.num_used_blocks
    held = rec.num_kv_tokens
    summary = [
        f"step {step} of {len(steps)}: {len(rec.slots)} sequences hold {used} of {num_blocks} blocks "
        f"({held} tokens in {used * run.block_size} slots: {100 * (1 - held / max(used * run.block_size, 1)):.1f}% "
        f"unfilled). Contiguous reservation of {run.max_len} fits {run.contiguous_max_running} sequences.",
        f"over the whole run: paged wastes {100 * run.paged_waste:.1f}% of allocated slots, contiguous "
        f"{100 * run.contiguous_waste:.1f}% of reserved slots; paged runs {run.paged_mean_running:.1f} "
        f"sequences on average ({run.paged_mean_running / run.contiguous_max_running:.1f}× contiguous) and "
        f"finishes in {len(run.paged.steps)} steps against {len(run.contiguous.steps)} "
        f"({len(run.contiguous.steps) / len(run.paged.steps):.2f}× faster), with "
        f"{run.paged.num_preemptions} preemptions.",
    ]
    title = (f"{num_requests} requests of benchmarks/workload.json on {num_blocks} blocks × "
             f"{run.block_size} tokens: step {step}")
    return BlockPoolData(run, step, np.array(rec.block_owner), np.array(rec.block_fill),
                         len(rec.slots), len(cstep.slots), title, summary)


def draw_block_pool(data: BlockPoolData, fig=None):
    """Left: the pool, one square per block (colour = request, shade = how full; white =
    free). Right: slots over time, reserved by contiguous vs allocated by paged vs held."""
    import matplotlib

    fig = fig or new_figure(12, 5.2)
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    run, nb = data.run, data.run.num_blocks
    cols = 16
    rows = -(-nb // cols)
    img = np.ones((rows, cols, 4))
    cmap = matplotlib.colormaps["tab20"]
    for b in range(nb):
        if data.owner[b] >= 0:
            rgba = np.array(cmap(int(data.owner[b]) % 20))
            frac = data.fill[b] / run.block_size
            rgba[:3] = 1 - (1 - rgba[:3]) * (0.35 + 0.65 * frac)
            img[b // cols, b % cols] = rgba
    ax.imshow(img, interpolation="nearest", aspect="equal")
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="#dddddd", lw=0.5)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    ax.set_title(f"block pool at step {data.step}: {data.num_running} sequences "
                 f"(paler = partly filled, white = free)", fontsize=9)

    ps, cs = run.paged.steps, run.contiguous.steps
    bs = run.block_size
    ax2.plot(range(len(cs)), [len(s.slots) * run.max_len for s in cs], color=COLORS["bound"],
             label=f"contiguous: reserved ({run.contiguous_max_running} × {run.max_len})")
    ax2.plot(range(len(cs)), [s.num_kv_tokens for s in cs], color=COLORS["bound"], ls="--", lw=1,
             label="contiguous: tokens held")
    ax2.plot(range(len(ps)), [s.num_used_blocks * bs for s in ps], color=COLORS["machine"],
             label="paged: allocated (blocks × 16)")
    ax2.plot(range(len(ps)), [s.num_kv_tokens for s in ps], color=COLORS["machine"], ls="--", lw=1,
             label="paged: tokens held")
    ax2.axhline(nb * bs, color="black", lw=1)
    ax2.axvline(data.step, color="#555555", ls=":")
    ax2.set_xlabel("step")
    ax2.set_ylabel("token slots")
    ax2.set_ylim(0, nb * bs * 1.08)
    ax2.legend(fontsize=7.5, loc="lower center")
    ax2.grid(True, alpha=0.3)
    ax2.set_title(f"waste: contiguous {100 * run.contiguous_waste:.0f}%, paged "
                  f"{100 * run.paged_waste:.1f}%", fontsize=9)
    fig.suptitle(data.title, fontsize=10)
    return fig


class BlockPoolView(FigureView):
    """Controls: ``step`` (IntSlider over the recorded steps), ``num_blocks`` (Dropdown)."""

    css = "minillm-block-pool"

    def __init__(self, step: int = 100, num_blocks: int = 256, num_requests: int = 64,
                 pool_sizes=(128, 256, 512)):
        import ipywidgets as w

        self.num_requests = num_requests
        n = len(run_pool(num_blocks, num_requests).paged.steps)
        controls = {
            "step": w.IntSlider(value=min(step, n - 1), min=0, max=n - 1, description="step"),
            "num_blocks": w.Dropdown(options=list(pool_sizes), value=num_blocks, description="blocks"),
        }
        super().__init__(controls)

    def _on_change(self, change) -> None:
        if change["owner"] is self.controls["num_blocks"]:  # a new run: resize the step slider
            n = len(run_pool(change["new"], self.num_requests).paged.steps)
            s = self.controls["step"]
            s.unobserve(self._on_change, names="value")
            s.max, s.value = n - 1, min(s.value, n - 1)
            s.observe(self._on_change, names="value")
        self.update()

    def compute(self) -> BlockPoolData:
        c = self.controls
        return block_pool_data(c["step"].value, c["num_blocks"].value, self.num_requests)

    def draw(self, data):
        return draw_block_pool(data)


def view(**kwargs) -> BlockPoolView:
    """``display(widgets.block_pool_grid.view())``."""
    return BlockPoolView(**kwargs)
