"""A load generator for the server: open-loop Poisson arrivals, latency percentiles.

    result = run_load("http://127.0.0.1:8000", rate=2.0, duration_s=30)
    print(result.summary())               # throughput, TTFT / ITL / e2e p50/p95/p99, errors
    results = sweep(url, [0.5, 1, 2, 4], duration_s=30)   # the p99-against-rate curve

Arrivals are a Poisson process (exponential gaps, seeded), so requests do not wait for each
other: the queue builds up exactly as it would with independent users. Prompts come from
the benchmark workload (`minillm.serve.workload`: random-token prompts of 16-256 tokens,
greedy, EOS ignored so each request generates exactly its max_tokens), cycled.

Measured per request, as the client sees it: TTFT = first text chunk - send; ITL = gaps
between text chunks; e2e = last byte - send. A 503 (shed) counts as an error, and so does
anything but a complete 200 answer. It sends only to loopback addresses (it refuses any
other URL) and stops by itself: no arrivals after duration_s, and requests still open
timeout_s later are cancelled and counted as errors.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np

from .. import calc
from .config import MODEL_NAME, is_loopback
from .workload import make_workload

METRICS = ("ttft", "itl", "e2e")


@dataclass
class LoadResult:
    rate: float
    duration_s: float
    num_requests: int = 0
    num_errors: int = 0
    num_shed: int = 0                    # 503 answers (part of num_errors)
    num_5xx: int = 0                     # 5xx other than 503 (part of num_errors)
    num_output_tokens: int = 0
    wall_s: float = 0.0                  # first send to last answer
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    status_counts: dict = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.num_errors / self.num_requests if self.num_requests else 0.0

    @property
    def throughput_tok_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def throughput_req_s(self) -> float:
        ok = self.num_requests - self.num_errors
        return ok / self.wall_s if self.wall_s > 0 else 0.0

    def percentile(self, metric: str, p: float) -> float:
        """The p-th percentile (0-100) of 'ttft', 'itl' or 'e2e' in seconds, by the
        nearest-rank method of `calc.percentile` (Lab 09's definition: always a latency some
        request really had); NaN when nothing was measured."""
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        xs = getattr(self, metric + "_s")
        return calc.percentile(xs, p) if xs else math.nan

    def summary(self) -> str:
        lines = [f"rate {self.rate:g} req/s for {self.duration_s:g} s: {self.num_requests} "
                 f"requests, {self.num_errors} errors ({self.error_rate:.1%}; {self.num_shed} "
                 f"shed), {self.throughput_tok_s:.1f} output tok/s, "
                 f"{self.throughput_req_s:.2f} req/s completed"]
        for m in METRICS:
            ps = "  ".join(f"p{p} {self.percentile(m, p) * 1e3:8.1f}" for p in (50, 95, 99))
            lines.append(f"  {m:4s} (ms)  {ps}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("rate", "duration_s", "num_requests",
                                              "num_errors", "num_shed", "num_5xx",
                                              "num_output_tokens", "wall_s", "status_counts")}
        out.update(error_rate=self.error_rate, throughput_tok_s=self.throughput_tok_s,
                   throughput_req_s=self.throughput_req_s)
        for m in METRICS:
            for p in (50, 95, 99):
                out[f"{m}_p{p}_s"] = self.percentile(m, p)
        return out


def check_loopback(url: str) -> str:
    """The URL without a trailing slash, if its host is loopback; else ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http://host:port URL, got {url!r}")
    if not is_loopback(parts.hostname):
        raise ValueError(f"the load generator only targets loopback (127.0.0.1, ::1, "
                         f"localhost), got host {parts.hostname!r}")
    return url.rstrip("/")


def workload_prompts(num: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt_ids, max_tokens) pairs from the benchmark workload."""
    return [(r["prompt_ids"], r["max_tokens"])
            for r in make_workload(num_requests=num, seed=seed)["requests"]]


def run_load(url: str, rate: float, duration_s: float, *, prompts=None, max_tokens=None,
             seed: int = 0, stream: bool = True, timeout_s: float = 120.0) -> LoadResult:
    """Poisson arrivals at `rate` req/s for `duration_s` seconds; see the module doc.
    prompts: None (the workload) or a list of str / token-id lists; max_tokens: None (the
    workload's own lengths; 32 for given prompts) or an int for every request."""
    url = check_loopback(url)
    if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a number of requests per second > 0, got {rate!r}")
    if not (isinstance(duration_s, (int, float)) and 0 < duration_s < math.inf):
        raise ValueError(f"duration_s must be a number of seconds > 0, got {duration_s!r}")
    if prompts is None:
        jobs = workload_prompts(seed=seed)
    else:
        if not prompts:
            raise ValueError("prompts is empty")
        jobs = [(p, 32) for p in prompts]
    if max_tokens is not None:
        jobs = [(p, max_tokens) for p, _ in jobs]
    rng = np.random.default_rng(seed)
    arrivals, t = [], rng.exponential(1 / rate)
    while t < duration_s:  # a Poisson process: exponential gaps
        arrivals.append(float(t))
        t += rng.exponential(1 / rate)
    result = LoadResult(float(rate), float(duration_s))
    return _run_coroutine(_run(url, arrivals, jobs, stream, timeout_s, result))


def measure_capacity(url: str, num_requests: int = 32, max_tokens: int = 32, *,
                     prompts=None, seed: int = 0, timeout_s: float = 600.0) -> LoadResult:
    """The server's service rate: `num_requests` requests (the workload's prompts, or
    `prompts`) sent all at once (a full batch and a queue behind it);
    `result.throughput_req_s` is completed requests per second, the mu of queueing models."""
    url = check_loopback(url)
    jobs = [(p, max_tokens) for p in (prompts or [p for p, _ in workload_prompts(seed=seed)])]
    result = LoadResult(math.inf, 0.0)
    return _run_coroutine(_run(url, [0.0] * num_requests, jobs, True, timeout_s, result))


def sweep(url: str, rates, duration_s: float, **kw) -> list[LoadResult]:
    """run_load at each rate in turn (lowest first is the usual order)."""
    return [run_load(url, r, duration_s, **kw) for r in rates]


def _run_coroutine(coro):
    """asyncio.run, also from inside a running loop (a notebook): then in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc
    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _run(url, arrivals, jobs, stream, timeout_s, result: LoadResult) -> LoadResult:
    """Send jobs (cycled) at the given arrival times (seconds from now); wait for them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for i, t in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            prompt, mt = jobs[i % len(jobs)]
            tasks.append(asyncio.create_task(_one(client, url, prompt, mt, stream, result)))
        result.num_requests = len(tasks)
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            result.num_errors += len(pending)
        result.wall_s = time.perf_counter() - start
    return result


async def _one(client, url, prompt, max_tokens, stream, result: LoadResult) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    times, tokens, ok = [], 0, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            result.status_counts[r.status_code] = result.status_counts.get(r.status_code, 0) + 1
            if r.status_code != 200:
                await r.aread()
                result.num_errors += 1
                result.num_shed += r.status_code == 503
                result.num_5xx += r.status_code >= 500 and r.status_code != 503
                return
            if stream:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        ok = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        break
                    if event.get("choices") and event["choices"][0].get("text"):
                        times.append(time.perf_counter())
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            else:
                event = json.loads(await r.aread())
                tokens, ok = event["usage"]["completion_tokens"], True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError):
        ok = False
    end = time.perf_counter()
    if not ok:
        result.num_errors += 1
        return
    result.num_output_tokens += tokens
    result.e2e_s.append(end - t0)
    if times:
        result.ttft_s.append(times[0] - t0)
        result.itl_s += [b - a for a, b in zip(times, times[1:])]


def ascii_curve(results: list[LoadResult], metric: str = "e2e", p: float = 99,
                width: int = 50) -> str:
    """The p-th percentile of `metric` against the offered rate, as a text bar chart."""
    vals = [r.percentile(metric, p) for r in results]
    top = max((v for v in vals if not math.isnan(v)), default=1.0) or 1.0
    lines = [f"p{p:g} {metric} against offered rate"]
    for r, v in zip(results, vals):
        bar = "" if math.isnan(v) else "#" * max(1, round(width * v / top))
        shown = "   n/a" if math.isnan(v) else f"{v:6.2f} s"
        lines.append(f"{r.rate:7.2f} req/s | {bar:<{width}} {shown}  errors {r.error_rate:.0%}")
    return "\n".join(lines)
