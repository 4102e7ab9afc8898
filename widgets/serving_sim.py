"""The serving simulator (Lab 09): Poisson arrivals into replicas of the engine, on a
simulated clock whose step time is a model fitted to this machine's measured engine steps.

    model = StepModel.fit(tokens_per_step, measured_step_s)      # step = base + c · tokens
    data = serving_sim_data(arrival_rate=6, max_num_seqs=8, step_model=model)
    data.ttft_p, data.itl_p, data.queue_len          # percentiles and the queue over time
    widgets.serving_sim.view(step_model=model)       # sliders: rate, batch limit, replicas, step model

Each replica is Lab 05's simulator (``widgets.batching_sim.simulate``: the engine's own
scheduler and block manager, iteration-level batching, chunked prefill) fed a Poisson
stream of ``λ / replicas`` (a random split of a Poisson stream is Poisson). Out come the
queue (requests that arrived and are not yet scheduled) over time, TTFT, ITL and E2E
percentiles (nearest rank, ``calc.percentile``), and the KV fragmentation of the blocks in
use (``calc.kv_fragmentation``).

Invariants: deterministic given its arguments (seeded arrivals, no other randomness);
Little's law holds on every run (the time-average number in the system equals the
completion rate times the mean E2E, both over the run); the ITL samples are exactly
Σ (output tokens − 1); a point with ρ ≥ 1 is simulated like any other (its queue just
grows for as long as the arrivals last).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from minillm import calc

from ._view import COLORS, FigureView, new_figure
from .batching_sim import load_workload, poisson_arrivals, simulate

__all__ = ["StepModel", "ServingSimData", "serving_sim_data", "LoadCurve", "sim_load_curve",
           "draw_serving_sim", "ServingSimView", "view", "PERCENTILES"]

PERCENTILES = (50, 95, 99)


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Engine step time = ``base_ms + ms_per_token · tokens`` (decode rows and prefill
    tokens alike are tokens of the step)."""

    base_ms: float
    ms_per_token: float

    def __post_init__(self):
        if not (self.base_ms > 0 and self.ms_per_token >= 0):
            raise ValueError(f"a step model needs base_ms > 0 and ms_per_token >= 0; got "
                             f"base_ms={self.base_ms!r}, ms_per_token={self.ms_per_token!r}.")

    @classmethod
    def fit(cls, tokens, step_s) -> "StepModel":
        """Least-squares line through measured (tokens in the step, seconds) points."""
        x, y = np.asarray(tokens, float), np.asarray(step_s, float) * 1e3
        if x.size < 2 or np.unique(x).size < 2:
            raise ValueError(f"fitting a line needs steps of at least two sizes; got tokens={x.tolist()}.")
        slope, intercept = np.polyfit(x, y, 1)
        slope = max(float(slope), 0.0)
        base = max(float(np.mean(y - slope * x)) if slope == 0 else float(intercept), 0.1)
        return cls(round(base, 3), round(slope, 4))

    def step_s(self, tokens) -> float:
        return (self.base_ms + self.ms_per_token * tokens) / 1e3

    def service_rate(self, max_num_seqs: int, prompt_len: float, output_len: float) -> float:
        """Requests/s one replica completes with every slot busy: each request's share of
        the steps (output_len / max_num_seqs of them) plus its own tokens
        (prompt + output − 1: the first output token comes out of the prefill)."""
        per_request_ms = (output_len * self.base_ms / max_num_seqs
                          + self.ms_per_token * (prompt_len + output_len - 1))
        return 1e3 / per_request_ms


@dataclasses.dataclass
class ServingSimData:
    arrival_rate: float             # req/s offered to the whole service
    replicas: int
    max_num_seqs: int
    step_model: StepModel
    service_rate: float             # req/s, all replicas (StepModel.service_rate × replicas)
    rho: float
    times: np.ndarray               # replica 0: step start times (s)
    queue_len: np.ndarray           # replica 0: requests waiting at each step
    running: np.ndarray             # replica 0: requests in the batch at each step
    fragmentation: np.ndarray       # replica 0: calc.kv_fragmentation of the blocks in use
    ttft: list                      # s, every request of every replica
    itl: list                       # s, every inter-token gap
    e2e: list
    ttft_p: dict                    # percentile -> s
    itl_p: dict
    e2e_p: dict
    mean_in_system: float           # time-average, all replicas (Little's L)
    throughput: float               # completed req/s
    title: str
    summary: list = dataclasses.field(default_factory=list)


def _replica_series(r, block_size: int):
    """Per step of one replica: start time, waiting, running, fragmentation; and the ITL
    samples (a decoding request's gap is the step it decoded in)."""
    admitted = {}
    itl = []
    for s in r.steps:
        for i in s.slots.values():
            admitted.setdefault(i, s.start)
            if r.first_token[i] <= s.start + 1e-12:  # already has its first token: a decode
                itl.append(s.duration)
    arrival = np.asarray(r.arrival)
    admit = np.array([admitted[i] for i in range(len(arrival))])
    starts = np.array([s.start for s in r.steps])
    waiting = ((arrival[None, :] <= starts[:, None] + 1e-12) & (admit[None, :] > starts[:, None] + 1e-12)).sum(1)
    running = np.array([len(s.slots) for s in r.steps])
    frag = np.array([calc.kv_fragmentation(s.num_kv_tokens, s.num_used_blocks, block_size)
                     for s in r.steps])
    return starts, waiting, running, frag, itl


def _time_in_system(results) -> tuple[float, float]:
    """∫ N(t) dt over all replicas (N: arrived, not finished), and the window it covers."""
    events = []
    for r in results:
        events += [(a, 1) for a in r.arrival] + [(f, -1) for f in r.finish]
    events.sort()
    area, n, last = 0.0, 0, events[0][0]
    for t, d in events:
        area += n * (t - last)
        n, last = n + d, t
    return area, events[-1][0] - events[0][0]


def serving_sim_data(arrival_rate: float = 4.0, max_num_seqs: int = 8,
                     step_model: StepModel = StepModel(25.0, 1.5), *, replicas: int = 1,
                     num_requests: int = 200, prompt_len: int | None = None,
                     output_len: int = 16, block_size: int = 16, seed: int = 0) -> ServingSimData:
    """Simulate ``num_requests`` Poisson arrivals at ``arrival_rate`` req/s spread over
    ``replicas`` engines of ``max_num_seqs`` slots. Prompt lengths are the benchmark
    workload's (benchmarks/workload.json, 16-256 tokens), or all ``prompt_len``; every
    request generates ``output_len`` tokens."""
    if replicas < 1 or max_num_seqs < 1 or num_requests < replicas or output_len < 1:
        raise ValueError(f"need replicas >= 1, max_num_seqs >= 1, output_len >= 1 and at least one "
                         f"request per replica; got replicas={replicas}, max_num_seqs={max_num_seqs}, "
                         f"output_len={output_len}, num_requests={num_requests}.")
    workload = load_workload()
    prompts = [prompt_len or workload[i % len(workload)][0] for i in range(num_requests)]
    arrivals = poisson_arrivals(num_requests, arrival_rate, seed)
    rng = np.random.default_rng(seed + 1)
    which = rng.integers(0, replicas, num_requests)  # a random split keeps each stream Poisson
    results = []
    for k in range(replicas):
        idx = np.flatnonzero(which == k)
        if idx.size == 0:
            continue
        results.append(simulate([(prompts[i], output_len) for i in idx], [arrivals[i] for i in idx],
                                max_num_seqs=max_num_seqs, step_ms=step_model.base_ms,
                                ms_per_token=step_model.ms_per_token, block_size=block_size))
    starts, waiting, running, frag, _ = _replica_series(results[0], block_size)
    itl = [x for r in results for x in _replica_series(r, block_size)[4]]
    ttft = [x for r in results for x in r.ttft]
    e2e = [x for r in results for x in r.e2e]
    area, window = _time_in_system(results)
    mu = replicas * step_model.service_rate(max_num_seqs, float(np.mean(prompts)), output_len)
    pcts = lambda xs: {p: calc.percentile(xs, p) for p in PERCENTILES}  # noqa: E731
    data = ServingSimData(arrival_rate, replicas, max_num_seqs, step_model, mu, arrival_rate / mu,
                          starts, waiting, running, frag, ttft, itl, e2e, pcts(ttft), pcts(itl),
                          pcts(e2e), area / window, num_requests / window,
                          f"{num_requests} requests, Poisson {arrival_rate:g} req/s over {replicas} "
                          f"replica(s) of {max_num_seqs} slots; step = {step_model.base_ms:g} ms + "
                          f"{step_model.ms_per_token:g} ms/token")
    data.summary = [
        f"capacity μ ≈ {mu:.2f} req/s (step model, every slot busy): ρ = λ / μ = {data.rho:.2f}",
        "TTFT " + _fmt(data.ttft_p) + "; ITL " + _fmt(data.itl_p) + "; E2E " + _fmt(data.e2e_p),
        f"queue (replica 0): mean {waiting.mean():.1f}, max {waiting.max()} waiting; "
        f"batch mean {running.mean():.1f} of {max_num_seqs}",
        f"Little's law: L = {data.mean_in_system:.2f} in the system = λ·W = "
        f"{data.throughput:.2f} req/s × {np.mean(e2e):.2f} s",
        f"KV fragmentation (replica 0): mean {100 * frag.mean():.0f}% of the slots in used blocks are empty",
    ]
    return data


def _fmt(pcts: dict) -> str:
    return ", ".join(f"p{p} {v * 1e3:.0f} ms" for p, v in pcts.items())


@dataclasses.dataclass
class LoadCurve:
    rates: list
    p99_e2e: list
    p99_ttft: list
    service_rate: float


def sim_load_curve(rates, max_num_seqs: int, step_model: StepModel, **kwargs) -> LoadCurve:
    """p99 E2E and TTFT of the simulator at each arrival rate (same seed at every rate)."""
    runs = [serving_sim_data(r, max_num_seqs, step_model, **kwargs) for r in rates]
    return LoadCurve(list(rates), [d.e2e_p[99] for d in runs], [d.ttft_p[99] for d in runs],
                     runs[0].service_rate)


def draw_serving_sim(data: ServingSimData, fig=None):
    """Left: the queue and the batch over time (replica 0). Right: TTFT, ITL and E2E at
    p50/p95/p99."""
    fig = fig or new_figure(12, 4.2)
    ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    ax.step(data.times, data.queue_len, where="post", color=COLORS["bound"], label="waiting (queue)")
    ax.step(data.times, data.running, where="post", color=COLORS["machine"], label="running (batch)")
    ax.axhline(data.max_num_seqs, color=COLORS["grey"], ls=":", lw=1, label="max_num_seqs")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("requests")
    ax.set_title(f"λ = {data.arrival_rate:g} req/s, ρ = {data.rho:.2f}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)
    width = 0.25
    for j, (name, pct, color) in enumerate((("TTFT", data.ttft_p, COLORS["kv"]),
                                            ("ITL", data.itl_p, COLORS["compute"]),
                                            ("E2E", data.e2e_p, COLORS["weights"]))):
        xs = np.arange(len(PERCENTILES)) + (j - 1) * width
        bx.bar(xs, [pct[p] * 1e3 for p in PERCENTILES], width, color=color, label=name)
    bx.set_yscale("log")
    bx.set_xticks(range(len(PERCENTILES)), [f"p{p}" for p in PERCENTILES])
    bx.set_ylabel("ms (log)")
    bx.legend(fontsize=8)
    bx.grid(True, axis="y", alpha=0.3)
    fig.suptitle(data.title, fontsize=10)
    return fig


class ServingSimView(FigureView):
    """Controls: ``arrival_rate`` (req/s), ``max_num_seqs``, ``replicas``, ``base_ms`` and
    ``ms_per_token`` (the step model), ``output_len``."""

    css = "minillm-serving-sim"

    def __init__(self, step_model: StepModel = StepModel(25.0, 1.5), arrival_rate: float = 4.0,
                 max_num_seqs: int = 8, replicas: int = 1, output_len: int = 16, **kwargs):
        import ipywidgets as w

        self.kwargs = kwargs
        controls = {
            "arrival_rate": w.FloatLogSlider(value=arrival_rate, base=2, min=-2, max=6, step=0.25,
                                             description="arrival rate (req/s)"),
            "max_num_seqs": w.IntSlider(value=max_num_seqs, min=1, max=64, description="max batch"),
            "replicas": w.IntSlider(value=replicas, min=1, max=8, description="replicas"),
            "base_ms": w.FloatText(value=step_model.base_ms, description="step base (ms)"),
            "ms_per_token": w.FloatText(value=step_model.ms_per_token, description="ms per token"),
            "output_len": w.IntSlider(value=output_len, min=1, max=256, description="output tokens"),
        }
        names = list(controls)
        super().__init__(controls, [[controls[n] for n in names[:3]], [controls[n] for n in names[3:]]])

    def compute(self) -> ServingSimData:
        c = {name: control.value for name, control in self.controls.items()}
        return serving_sim_data(c["arrival_rate"], c["max_num_seqs"],
                                StepModel(c["base_ms"], c["ms_per_token"]), replicas=c["replicas"],
                                output_len=c["output_len"], **self.kwargs)

    def draw(self, data):
        return draw_serving_sim(data)


def view(**kwargs) -> ServingSimView:
    """``display(widgets.serving_sim.view(step_model=...))``; keyword arguments set the start."""
    return ServingSimView(**kwargs)
