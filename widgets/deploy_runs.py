"""The Lab 10 capstone's measurements: serve the benchmark workload with SmolLM2 on this
machine under a chosen ``Deployment`` (weights, speculative decoding, batch limits, prefix
caching), within a quality budget (KL to the fp32 model), and rank the results.

The workload (``capstone_requests``): the first requests of benchmarks/workload.json, each
behind one shared system prompt (as a chat service sends), outputs capped so that a run takes
seconds; greedy, EOS ignored, everyone arriving at t = 0 (an offline burst). Throughput is
output tokens over the run's wall time; TTFT is from arrival to the first token.

How a deployment runs: without speculation, through ``LLMEngine`` with its batch limits and
prefix caching; with ``spec_k > 0``, one request at a time through
``minillm.spec.speculative_generate`` and an n-gram draft (the engine does not speculate:
speculation is a batch-1 technique, and this is how a batch-1 server would use it).

The capstone's rules (``Capstone.rules()``): the deployment's weights stay within the KL
budget (mean KL to the fp32 model per token, on held-out text), and its output tok/s is at
least ``1 + min_gain`` times the defaults', both measured back to back, best of ``repeats``
runs each (``Capstone.compare``): a shared machine's timings move by 10% from run to run, and
the best of a few runs is the most repeatable figure.

Invariants: every run checks its tokens against the fp32 engine's when the weights are fp32
(speculation and batching must not change greedy output); quality is measured once per
weight format and cached on the ``Capstone`` object.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import torch

__all__ = ["Deployment", "RunResult", "Capstone", "capstone_requests", "WEIGHTS"]

WEIGHTS = ("fp32", "bf16", "int8", "int4")
_BITS = {"int8": 8, "int4": 4}
QUICK = os.environ.get("MINILLM_QUICK") == "1"


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One way to serve SmolLM2. Defaults are the engine's (``EngineConfig``) in fp32; the
    token budget's default (None) is the engine's for the device: 512 tokens a step on a
    CPU, 8192 on CUDA."""

    weights: str = "fp32"              # "fp32", "bf16", "int8" or "int4" (RTN, groups of 64)
    spec_k: int = 0                    # draft tokens per pass; 0: no speculation
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is None and name == "max_num_batched_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1"
                                 f"{' or None (the engine default)' if 'tokens' in name else ''}"
                                 f", got {v!r}")
        if isinstance(self.spec_k, bool) or not isinstance(self.spec_k, int) or not 0 <= self.spec_k <= 16:
            raise ValueError(f"spec_k must be an int in 0..16 (0: no speculation), got {self.spec_k!r}")

    def label(self) -> str:
        spec = f", spec k={self.spec_k} (batch 1)" if self.spec_k else ""
        return (f"{self.weights}{spec}, max_num_seqs={self.max_num_seqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens or 'default'}, "
                f"prefix caching {'on' if self.enable_prefix_caching else 'off'}")


@dataclasses.dataclass
class RunResult:
    deployment: Deployment
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_s: list
    kl: float                           # mean KL(fp32 ‖ model) per token on held-out text
    same_tokens: bool | None            # equal to the fp32 engine's greedy tokens (fp32 only)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s

    def p99_ttft_s(self) -> float:
        return float(np.percentile(self.ttft_s, 99))

    def line(self) -> str:
        return (f"{self.throughput:7.1f} tok/s  p99 TTFT {self.p99_ttft_s():6.2f} s  "
                f"KL {self.kl:.4f}  {self.deployment.label()}")


def capstone_requests(vocab_size: int, num_requests: int | None = None, max_output: int | None = None,
                      system_tokens: int = 96, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of the capstone workload (see the module docstring)."""
    from widgets.batching_sim import WORKLOAD

    n = num_requests or (6 if QUICK else 16)
    cap = max_output or (8 if QUICK else 32)
    reqs = json.loads(WORKLOAD.read_text())["requests"][:n]
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab_size, (system_tokens,), generator=g).tolist()
    return [(system + r["prompt_ids"], min(cap, int(r["max_tokens"]))) for r in reqs]


class Capstone:
    """Runs deployments of ``model`` on one workload and keeps the results (a leaderboard).

    ``kl_budget``: the largest mean KL to fp32 a deployment may have to count; ``min_gain``:
    how much more tok/s than the defaults it must measure (``compare``)."""

    def __init__(self, model, tokenizer, requests, kl_budget: float = 0.05, kl_windows: int = 2,
                 min_gain: float = 0.05, repeats: int = 2):
        self.model, self.tokenizer, self.requests = model, tokenizer, list(requests)
        self.kl_budget, self.kl_windows = kl_budget, kl_windows
        self.min_gain, self.repeats = min_gain, repeats
        self.results: list[RunResult] = []
        self._models, self._kl, self._reference_tokens = {"fp32": model}, {"fp32": 0.0}, None

    # weights and quality ---------------------------------------------------------
    def weights(self, name: str):
        """The model in weight format ``name``: the fp32 model itself, a bf16 copy, or an RTN
        copy (groups of 64), on the same device."""
        if name not in self._models:
            if name == "bf16":
                m = self.model.deep_copy().to(torch.bfloat16)
                m.rope_cos, m.rope_sin = self.model.rope_cos, self.model.rope_sin  # fp32 tables
                self._models[name] = m
            else:
                from minillm import quant

                self._models[name] = quant.quantize_model(self.model, "rtn", _BITS[name], 64,
                                                          progress=False)
        return self._models[name]

    def kl(self, name: str) -> float:
        if name not in self._kl:
            from minillm import quant

            res = quant.evaluate(self.weights(name), self.tokenizer, ref_model=self.model,
                                 window=256, max_windows=self.kl_windows)
            self._kl[name] = float(res["kl"])
        return self._kl[name]

    # running ----------------------------------------------------------------------
    def run(self, deployment: Deployment) -> RunResult:
        """Serve the workload under ``deployment``; the result joins ``self.results``."""
        model = self.weights(deployment.weights)
        if deployment.spec_k:
            tokens, wall, ttft = _run_speculative(model, self.requests, deployment.spec_k)
        else:
            tokens, wall, ttft = _run_engine(model, self.requests, deployment)
        same = None
        if deployment.weights == "fp32":
            if self._reference_tokens is None:
                self._reference_tokens = tokens
            same = tokens == self._reference_tokens
        out = sum(len(t) for t in tokens)
        result = RunResult(deployment, len(self.requests), out, wall, ttft,
                           self.kl(deployment.weights), same)
        self.results.append(result)
        return result

    def compare(self, deployment: Deployment, baseline: Deployment = Deployment()):
        """(best run of ``deployment``, best run of ``baseline``): ``repeats`` runs of each,
        alternating, so that both meet the same machine."""
        mine, base = [], []
        for _ in range(self.repeats):
            base.append(self.run(baseline))
            mine.append(self.run(deployment))
        best = lambda runs: max(runs, key=lambda r: r.throughput)  # noqa: E731
        return best(mine), best(base)

    def rules(self) -> str:
        return (f"weights within the KL budget ({self.kl_budget} nats per token against fp32), and at "
                f"least {1 + self.min_gain:.2f}× the defaults' output tok/s, both measured back to back, "
                f"best of {self.repeats} runs each")

    def leaderboard(self, baseline: Deployment = Deployment()) -> list[str]:
        """Every run, best throughput first, within the KL budget or marked out of it, with
        its throughput and p99 TTFT against the baseline's best run."""
        base = max((r for r in self.results if r.deployment == baseline), key=lambda r: r.throughput,
                   default=None)
        lines = [f"{'':2}{'tok/s':>8} {'p99 TTFT':>9} {'KL':>7}  deployment"]
        for r in sorted(self.results, key=lambda r: (r.kl > self.kl_budget, -r.throughput)):
            mark = "✗" if r.kl > self.kl_budget else ("·" if r.deployment == baseline else " ")
            vs = (f"  ({r.throughput / base.throughput:.2f}× the defaults' tok/s, "
                  f"{r.p99_ttft_s() / base.p99_ttft_s():.2f}× their p99 TTFT)"
                  if base is not None and r.deployment != baseline else "")
            lines.append(f"{mark} {r.throughput:8.1f} {r.p99_ttft_s():8.2f}s {r.kl:7.4f}  "
                         f"{r.deployment.label()}{vs}")
        lines.append(f"· = the defaults; ✗ = over the KL budget of {self.kl_budget}")
        return lines


def _run_engine(model, requests, d: Deployment):
    """Serve ``requests`` as deployed. On CUDA the engine's attention is Triton's whatever
    the model was loaded with (`EngineConfig.attn_backend`), so its steps replay CUDA graphs;
    eager steps there are bound by their launches, and every weight format would measure
    about the same."""
    from minillm.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, max_num_seqs=d.max_num_seqs, max_num_batched_tokens=d.max_num_batched_tokens,
                       enable_prefix_caching=d.enable_prefix_caching)
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=t0)
    tokens = {f"r{i}": [] for i in range(len(requests))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += list(out.new_token_ids)
    wall = time.perf_counter() - t0
    ttft = [m.ttft for m in engine.finished_metrics.values()]
    return [tokens[f"r{i}"] for i in range(len(requests))], wall, ttft


class _TimedDraft:
    """An n-gram draft that notes when the first verify pass has emitted tokens (the 2nd
    proposal), which is this request's first-token time."""

    def __init__(self):
        from minillm import spec

        self._draft, self.calls, self.first_token_time = spec.NgramDraft(), 0, None

    def __getattr__(self, name):
        return getattr(self._draft, name)

    def propose(self, context, k):
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()
        return self._draft.propose(context, k)


def _run_speculative(model, requests, k: int):
    from minillm import spec

    t0 = time.perf_counter()
    tokens, ttft = [], []
    for prompt, n in requests:  # one at a time: everyone else waits in the queue
        draft = _TimedDraft()
        out = spec.speculative_generate(model, draft, prompt, n, k=k, ignore_eos=True)
        done = time.perf_counter()
        tokens.append(out.tokens)
        ttft.append((draft.first_token_time or done) - t0)
    return tokens, time.perf_counter() - t0, ttft



# --------------------------------------------------------------------------- a replica's memory


def kv_pool_bytes(engine) -> int:
    """The bytes the engine's paged KV cache holds (every layer's K and V pool, allocated up
    front): `PagedKVCache.nbytes`."""
    return engine.kv_cache.nbytes()


# --------------------------------------------------------------------------- small-scale validation


def fit_step_model(model, batch: int = 32):
    """A linear ``calc.StepModel`` of this machine's engine: ``base`` = one decode step at
    batch 1, ``per_token`` = what each extra row adds, from a step at ``batch`` rows."""
    from minillm import calc

    from .spec_runs import engine_step_times

    t = engine_step_times(model, (1, batch), prompt_len=8, steps=3)
    one, full = float(t.step_s[0]), float(t.step_s[-1])
    return calc.StepModel(one, max(0.0, (full - one) / (batch - 1)))


def measure_decode_step(model, batch: int) -> float:
    """Seconds of one engine decode step with ``batch`` sequences, measured the way
    ``fit_step_model`` measures its two points (so a prediction from that model compares
    like with like)."""
    from .spec_runs import engine_step_times

    return float(engine_step_times(model, (batch,), prompt_len=8, steps=3).step_s[0])


@dataclasses.dataclass
class Validation:
    """One design point seen three ways: calc's formulas, Lab 05's simulator (the real
    scheduler on a clock driven by the same step model) and the real server under the load
    generator. Latencies in seconds."""

    rate: float
    utilization: float
    rows: dict        # source -> {"e2e p50", "ttft p99", "tok/s"}

    def lines(self) -> list[str]:
        out = [f"{'':16}{'e2e p50':>10}{'TTFT p99':>10}{'tok/s':>9}"]
        for name, r in self.rows.items():
            out.append(f"{name:16}{r['e2e p50']:9.2f}s{r['ttft p99']:9.2f}s{r['tok/s']:9.1f}")
        return out

    def verdict(self, a: str = "real server", b: str = "simulator") -> str:
        """How row ``a`` compared with row ``b`` on this run, in words from the numbers."""
        if a not in self.rows or b not in self.rows:
            return f"(no {a!r} row to compare)"
        parts = []
        for key, what in (("e2e p50", "median e2e"), ("ttft p99", "p99 TTFT")):
            x, y = self.rows[a][key], self.rows[b][key]
            word = "faster" if x < y else "slower"
            parts.append(f"{what} {x:.2f} s against {y:.2f} s: {word} ({x / y:.2f}×)")
        return f"the {a} against the {b}: " + "; ".join(parts)


def validate_design(step, rate: float, max_num_seqs: int, output_tokens: int, duration_s: float,
                    url: str | None = None, seed: int = 0) -> Validation:
    """Predict and measure one load point on this machine. ``url``: a running
    ``minillm.serve`` server (its prompts are the benchmark workload's); None skips it."""
    from minillm import calc

    from .batching_sim import load_workload, poisson_arrivals, simulate

    lens = [(p, output_tokens) for p, _ in load_workload()]
    mean_prompt = round(sum(p for p, _ in lens) / len(lens))
    work = calc.replica_seconds_per_request(step, mean_prompt, output_tokens, max_num_seqs)
    e2e = calc.request_latency_s(step, mean_prompt, output_tokens, 1)
    rows = {"calc (no queue)": {"e2e p50": e2e, "ttft p99": step.step_s(mean_prompt),
                                "tok/s": rate * output_tokens}}
    n = max(8, int(rate * duration_s))
    reqs = [lens[i % len(lens)] for i in range(n)]
    sim = simulate(reqs, poisson_arrivals(n, rate, seed), max_num_seqs=max_num_seqs,
                   step_ms=step.base_s * 1e3, ms_per_token=step.per_token_s * 1e3)
    rows["simulator"] = {"e2e p50": float(np.percentile(sim.e2e, 50)),
                         "ttft p99": float(np.percentile(sim.ttft, 99)), "tok/s": sim.throughput}
    if url is not None:
        from minillm.serve import run_load

        real = run_load(url, rate, duration_s, max_tokens=output_tokens, seed=seed)
        rows["real server"] = {"e2e p50": real.percentile("e2e", 50),
                               "ttft p99": real.percentile("ttft", 99),
                               "tok/s": real.throughput_tok_s}
    return Validation(rate, rate * work, rows)
