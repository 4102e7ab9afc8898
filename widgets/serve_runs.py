"""Lab 09's measurements against a running server (``minillm.serve.ServerProcess``) and the
engine: one stream watched token by token, a burst of simultaneous requests, the service
rate, /metrics sampled during load, the knee of a p99-against-rate sweep, and the engine's
step times that calibrate the serving simulator.

    timing = stream_completion(server.url, "Tell me about Paris.", max_tokens=32)
    replies = burst(server.url, prompts, max_tokens=8)            # one request per prompt: 503s, Retry-After
    mu = service_rate(replies, max_num_seqs=8)                    # req/s with every slot busy
    with MetricsWatcher(server.url) as watch: serve.run_load(...)
    knee_rate(rates, p99s, threshold_s=1.5 * max_num_seqs / mu)

Invariants: every request goes to loopback only (the URL is checked with
``serve.loadgen.check_loopback``); times are ``time.perf_counter`` seconds from when the
request was sent; a burst sends all its requests before any answer is read (one thread
each, started together), so the server sees them as simultaneous arrivals.
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import numpy as np

from minillm import calc

from .serving_sim import StepModel

__all__ = ["fetch", "StreamTiming", "stream_completion", "Reply", "burst", "service_rate",
           "MetricsWatcher", "knee_rate", "measure_step_model", "percentiles", "draw_load_curve",
           "thread_cpu_s", "BufferingRun", "sse_buffering", "probe"]


def _url(url: str) -> str:
    from minillm.serve.loadgen import check_loopback

    return check_loopback(url)


def fetch(url: str, path: str, timeout_s: float = 30.0) -> str:
    """GET ``path`` from the server; the body as text (e.g. ``fetch(url, "/metrics")``)."""
    import httpx

    r = httpx.get(_url(url) + path, timeout=timeout_s)
    r.raise_for_status()
    return r.text


# --------------------------------------------------------------------------- one stream


@dataclasses.dataclass
class StreamTiming:
    pieces: list            # (seconds after sending, text) per chunk that carried text
    lines: list             # the raw SSE lines, as received
    usage: dict | None
    finish_reason: str | None
    e2e_s: float            # until [DONE]

    @property
    def ttft_s(self) -> float:
        return self.pieces[0][0] if self.pieces else math.nan

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.pieces)

    @property
    def itl_s(self) -> list:
        times = [t for t, _ in self.pieces]
        return [b - a for a, b in zip(times, times[1:])]


def stream_completion(url: str, prompt, *, max_tokens: int = 32, chat: bool = True,
                      timeout_s: float = 120.0, tokens_per_event: int | None = None,
                      **params) -> StreamTiming:
    """Send one streamed (chat) completion and time every chunk as it arrives.
    ``tokens_per_event``: the server's ``stream_options.tokens_per_event`` (None: its
    default); ``params``: more request fields (``temperature``, ``ignore_eos``, ...)."""
    import httpx

    from minillm.serve import MODEL_NAME
    from minillm.serve.sse import iter_events

    options = {"include_usage": True}
    if tokens_per_event is not None:
        options["tokens_per_event"] = tokens_per_event
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "stream": True,
            "stream_options": options, **params}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    pieces, lines, usage, reason, event_lines = [], [], None, None, []
    t0 = time.perf_counter()
    with httpx.stream("POST", _url(url) + path, json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            now = time.perf_counter() - t0
            lines.append(line)
            event_lines.append(line)
            if line:
                continue
            events, event_lines = list(iter_events(event_lines)), []  # an event ends at a blank line
            for event in events:
                if event == "[DONE]":
                    continue
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        pieces.append((now, text))
                    reason = choice.get("finish_reason") or reason
                usage = event.get("usage") or usage
    return StreamTiming(pieces, lines, usage, reason, time.perf_counter() - t0)


# --------------------------------------------------------------------------- SSE buffering


def thread_cpu_s(pid: int) -> dict:
    """CPU seconds each thread of process ``pid`` has used so far, by thread id, read from
    /proc/<pid>/task/<tid>/schedstat (nanoseconds; Linux). The thread whose id is ``pid``
    is the main thread: in ``minillm serve``, the event loop (HTTP, SSE, detokenization)."""
    import os

    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


@dataclasses.dataclass
class BufferingRun:
    tokens_per_event: int
    streams: int
    tokens: int                 # generated tokens, all streams
    events: int                 # SSE events that carried text, all streams
    wall_s: float
    loop_cpu_s: float           # the server's event-loop thread
    server_cpu_s: float         # every thread of the server (the engine's included)
    mean_ttft_s: float
    texts: list                 # each stream's text
    same_text_as_k1: bool | None = None  # its first prompt streamed again at k = 1: same text?

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s

    @property
    def loop_cpu_us_per_token(self) -> float:
        return self.loop_cpu_s / self.tokens * 1e6

    def line(self) -> str:
        return (f"{self.tokens_per_event:5d} {self.events:8d} {self.events_per_s:9.0f}/s "
                f"{self.tokens / self.wall_s:8.0f} tok/s {self.loop_cpu_s * 1e3:9.0f} ms "
                f"{self.loop_cpu_us_per_token:9.0f} µs {self.server_cpu_s:8.2f} s "
                f"{self.mean_ttft_s * 1e3:7.0f} ms")


BUFFERING_HEADER = ("  k   events    events/s   tokens/s   loop CPU  per token  server CPU  "
                    "mean TTFT")


def sse_buffering(server, prompts, tokens_per_event=(1, 2, 5, 10), *, streams: int = 8,
                  max_tokens: int = 48, timeout_s: float = 300.0) -> list:
    """For each k in ``tokens_per_event``: ``streams`` streamed completions at once (greedy,
    EOS ignored, ``stream_options.tokens_per_event = k``) on the running ``ServerProcess``
    ``server``; counts the events and tokens and the CPU time the server's threads used
    meanwhile. Each k gets its own ``streams`` prompts from ``prompts`` (distinct prompts: a
    prompt seen before would hit the prefix cache and flatter the later runs). One
    ``BufferingRun`` per k."""
    url, pid, pool = _url(server.url), server.pid, list(prompts)
    if len(pool) < streams * len(tokens_per_event):
        raise ValueError(f"need {streams} distinct prompts per k, {streams * len(tokens_per_event)} in all; "
                         f"got {len(pool)}")
    runs = []
    for j, k in enumerate(tokens_per_event):
        prompts = pool[j * streams:(j + 1) * streams]
        results = [None] * len(prompts)
        go = threading.Barrier(len(prompts) + 1)

        def one(i: int, k=k) -> None:
            go.wait()
            t = _greedy_stream(url, prompts[i], max_tokens, k, timeout_s)
            results[i] = (len(t.pieces), t.text, t.ttft_s, (t.usage or {}).get("completion_tokens", 0))

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        before = thread_cpu_s(pid)
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = thread_cpu_s(pid)
        if any(r is None for r in results):
            raise RuntimeError("a stream failed; see the server's log (server.log_text())")
        runs.append(BufferingRun(k, len(prompts), sum(r[3] for r in results), sum(r[0] for r in results),
                                 wall, after.get(pid, 0.0) - before.get(pid, 0.0),
                                 sum(after.values()) - sum(before.get(t, 0.0) for t in after),
                                 float(np.mean([r[2] for r in results])), [r[1] for r in results]))
    for run, j in zip(runs, range(len(runs))):  # the same prompt at one token per event: same text?
        run.same_text_as_k1 = (_greedy_stream(url, pool[j * streams], max_tokens, 1, timeout_s).text
                               == run.texts[0])
    return runs


def _greedy_stream(url: str, prompt, max_tokens: int, k: int, timeout_s: float) -> StreamTiming:
    """One streamed completion, greedy, EOS ignored, ``k`` tokens per SSE event."""
    return stream_completion(url, prompt, max_tokens=max_tokens, chat=False, timeout_s=timeout_s,
                             tokens_per_event=k, temperature=0.0, ignore_eos=True)


def probe(url: str, path: str) -> tuple[int, str]:
    """GET a probe route: (status, the body's status or error message)."""
    import httpx

    r = httpx.get(_url(url) + path, timeout=10)
    data = r.json()
    return r.status_code, data.get("status") or _message(data) or ""


# --------------------------------------------------------------------------- a burst


@dataclasses.dataclass
class Reply:
    status: int
    retry_after: str | None     # the Retry-After header of a 503
    sent_s: float               # perf_counter when sent
    done_s: float               # perf_counter when the whole answer was read
    completion_tokens: int
    error: str | None           # the error body's message, if any


def _message(body: dict) -> str | None:
    """The message of an OpenAI-style error body, {"error": {"message": ...}}."""
    return (body.get("error") or {}).get("message")


def burst(url: str, prompts, *, max_tokens: int = 16, stream: bool = False,
          timeout_s: float = 300.0) -> list:
    """Send one completion per prompt (str or token ids), all at the same moment
    (greedy, EOS ignored), and return one ``Reply`` per request, in order.
    Use distinct prompts to measure capacity: identical ones share the prefix cache.

    ``stream=True`` asks for server-sent events and reads every one, as ``serve.run_load``
    does: the capacity measured then includes the per-event work of server and client, which
    on a small CPU shares the cores with the engine (Lab 09 measures μ this way, because its
    load sweep streams)."""
    import httpx

    from minillm.serve import MODEL_NAME
    from minillm.serve.sse import iter_events

    target = _url(url) + "/v1/completions"
    prompts = list(prompts)
    n = len(prompts)
    if n == 0:
        raise ValueError("burst needs at least one prompt.")
    replies = [None] * n
    go = threading.Barrier(n)

    def post(client, body) -> tuple:
        """(status, retry-after, completion tokens, error message) of one request."""
        if not stream:
            r = client.post(target, json=body)
            data = r.json()
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), 0, _message(data)
            return 200, None, data.get("usage", {}).get("completion_tokens", 0), None
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", target, json=body) as r:
            if r.status_code != 200:
                data = json.loads(r.read() or b"{}")
                return r.status_code, r.headers.get("retry-after"), 0, _message(data)
            tokens = 0
            for event in iter_events(r.iter_lines()):
                if isinstance(event, dict) and event.get("usage"):
                    tokens = event["usage"].get("completion_tokens", 0)
            return 200, None, tokens, None

    def one(i: int) -> None:
        with httpx.Client(timeout=timeout_s) as client:
            go.wait()
            sent = time.perf_counter()
            try:
                status, retry, tokens, err = post(client, {"model": MODEL_NAME, "prompt": prompts[i],
                                                           "max_tokens": max_tokens, "temperature": 0.0,
                                                           "ignore_eos": True})
                replies[i] = Reply(status, retry, sent, time.perf_counter(), tokens, err)
            except httpx.HTTPError as exc:
                replies[i] = Reply(0, None, sent, time.perf_counter(), 0, f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def service_rate(replies, max_num_seqs: int) -> float:
    """Completions per second while the server was full: between the ``max_num_seqs``-th
    and the ``(n − max_num_seqs)``-th completion of a burst of n, every slot had work (the
    ramp-up and the last, draining batch are left out)."""
    done = sorted(r.done_s for r in replies if r.status == 200)
    lo, hi = max_num_seqs, len(done) - max_num_seqs
    if hi - lo < 2:
        raise ValueError(f"a burst of {len(done)} completed requests is too small to see the "
                         f"server full with {max_num_seqs} slots; send at least {4 * max_num_seqs}.")
    return (hi - lo) / (done[hi - 1] - done[lo - 1])


def drain_demo(server, prompts, *, max_tokens: int = 48, settle_s: float = 0.5) -> tuple:
    """SIGTERM a ``ServerProcess`` while one request per prompt runs: returns (exit code,
    the in-flight replies, the reply to a request sent during the drain, and what the
    Kubernetes probes answered during the drain: {path: (status, reason)})."""
    import httpx

    prompts = list(prompts)
    inflight, late, code = [], [], []
    sender = threading.Thread(target=lambda: inflight.extend(
        burst(server.url, prompts, max_tokens=max_tokens)))
    sender.start()
    time.sleep(settle_s)                    # the requests are in the server
    stopper = threading.Thread(target=lambda: code.append(server.stop()))
    stopper.start()
    time.sleep(settle_s / 2)                # SIGTERM delivered: the server is draining
    probes = {}
    for path in ("/health/live", "/health/ready"):
        try:
            probes[path] = probe(server.url, path)
        except httpx.HTTPError as exc:
            probes[path] = (0, f"no answer ({type(exc).__name__})")
    late += burst(server.url, prompts[:1], max_tokens=1, timeout_s=30)
    stopper.join()
    sender.join()
    return code[0], inflight, late[0], probes


# --------------------------------------------------------------------------- /metrics


class MetricsWatcher:
    """Polls ``/metrics`` every ``interval_s`` in a background thread while the ``with``
    block runs; ``samples`` holds (seconds since start, parsed metrics) pairs and
    ``series(name)`` one metric over time."""

    def __init__(self, url: str, interval_s: float = 0.25):
        self.url, self.interval_s = _url(url), interval_s
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import httpx

        from minillm.serve.metrics import parse_prometheus

        t0 = time.perf_counter()
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                try:
                    text = client.get(self.url + "/metrics").text
                    self.samples.append((time.perf_counter() - t0, parse_prometheus(text)))
                except Exception:  # noqa: BLE001 - a missed sample is not worth stopping for
                    pass
                self._stop.wait(self.interval_s)

    def __enter__(self) -> "MetricsWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        pts = [(t, m[name]) for t, m in self.samples if name in m]
        return np.array([t for t, _ in pts]), np.array([v for _, v in pts])

    def draw(self, fig=None):
        """Running, waiting and KV usage over the watch."""
        from ._view import COLORS, new_figure

        fig = fig or new_figure(10, 3.6)
        ax = fig.subplots()
        for name, label, color in (("minillm:num_requests_running", "running", COLORS["machine"]),
                                   ("minillm:num_requests_waiting", "waiting", COLORS["bound"])):
            t, v = self.series(name)
            ax.step(t, v, where="post", color=color, label=label)
        ax.set_xlabel("seconds")
        ax.set_ylabel("requests")
        bx = ax.twinx()
        t, v = self.series("minillm:kv_cache_usage_perc")
        bx.plot(t, 100 * v, color=COLORS["kv"], ls="--", label="KV cache used (%)")
        bx.set_ylabel("KV cache used (%)")
        ax.legend(loc="upper left", fontsize=8)
        bx.legend(loc="upper right", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.set_title("/metrics during the load test, sampled every "
                     f"{self.interval_s * 1e3:.0f} ms", fontsize=10)
        return fig


# --------------------------------------------------------------------------- the knee


def knee_rate(rates, p99s, threshold_s: float) -> float:
    """The arrival rate at which p99 first reaches ``threshold_s``, interpolated linearly in
    rate and in log(p99) between the two sweep points around it. The lowest rate if p99 is
    already there; the highest if the sweep never gets there (it did not reach the knee)."""
    pts = sorted(zip(rates, p99s))
    if len(pts) < 2 or not threshold_s > 0:
        raise ValueError(f"a knee needs a sweep of at least two rates and a threshold > 0; got "
                         f"{len(pts)} rate(s), threshold_s={threshold_s!r}.")
    if pts[0][1] >= threshold_s:
        return pts[0][0]
    for (r0, y0), (r1, y1) in zip(pts, pts[1:]):
        if y1 >= threshold_s:
            w = (math.log(threshold_s) - math.log(y0)) / (math.log(y1) - math.log(y0))
            return r0 + w * (r1 - r0)
    return pts[-1][0]


# --------------------------------------------------------------------------- step times


def measure_step_model(model, batch_sizes=(1, 4, 8), prefill_lens=(32, 128), repeats: int = 3,
                       seed: int = 0):
    """Time ``LLMEngine.step`` on this machine: decode steps of ``batch_sizes`` rows and
    prefill steps of ``prefill_lens`` tokens (fastest of ``repeats``); fit a StepModel.
    Returns (model, tokens, seconds)."""
    import torch

    from minillm.engine import LLMEngine, SamplingParams

    from .spec_runs import _clock, engine_step_times

    decode = engine_step_times(model, batch_sizes, prompt_len=16, steps=repeats, seed=seed)
    g = torch.Generator().manual_seed(seed)
    tokens, seconds = list(decode.batch_sizes), list(decode.step_s)
    for n in prefill_lens:
        best = math.inf
        for _ in range(repeats):
            eng = LLMEngine(model, max_num_seqs=1, max_num_batched_tokens=max(512, n),
                            enable_prefix_caching=False, num_blocks=-(-n // 16) + 4)
            prompt = torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
            eng.add_request("p", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            # Device-synchronized clocks: on CUDA, async scheduling returns from this first
            # step as soon as it is launched (its ids are read back by the next step).
            t0 = _clock(model)
            eng.step()
            best = min(best, _clock(model) - t0)
        tokens.append(n)
        seconds.append(best)
    return StepModel.fit(tokens, seconds), np.array(tokens), np.array(seconds)


def percentiles(xs, ps=(50, 95, 99)) -> dict:
    """Nearest-rank percentiles (``calc.percentile``) of raw latencies; NaN when empty."""
    return {p: (calc.percentile(xs, p) if len(xs) else math.nan) for p in ps}


def draw_load_curve(rates, p99s, service_rate: float, base_s: float, threshold_s: float,
                    knee: float, sim=None, fig=None):
    """Measured p99 E2E against the offered rate, with the M/M/1-style prediction
    ``calc.queueing_latency_s(base_s, λ, μ)``, its asymptote at λ = μ, the knee's threshold
    and, if given, the simulator's curve (a ``serving_sim.LoadCurve``)."""
    from ._view import COLORS, new_figure

    fig = fig or new_figure(9, 4.5)
    ax = fig.subplots()
    lam = np.linspace(0, 0.97 * service_rate, 200)
    ax.plot(lam, [calc.queueing_latency_s(base_s, x, service_rate) for x in lam], color=COLORS["grey"],
            lw=2, label="M/M/1-style: unloaded / (1 − λ/μ)  (calc.queueing_latency_s)")
    if sim is not None:
        ax.plot(sim.rates, sim.p99_e2e, "s--", color=COLORS["compute"], ms=4,
                label="simulator (this machine's step model)")
    ax.plot(rates, p99s, "o-", color=COLORS["measured"], label="measured p99 E2E")
    ax.axvline(service_rate, color=COLORS["bound"], ls=":", lw=1)
    ax.text(service_rate, 0.97, " μ (ρ = 1)", color=COLORS["bound"], fontsize=8, va="top",
            transform=ax.get_xaxis_transform())
    ax.axhline(threshold_s, color=COLORS["kv"], ls="--", lw=1, label="knee threshold")
    ax.axvline(knee, color=COLORS["kv"], lw=1)
    ax.text(knee, 0.6, f" knee {knee:.2f} req/s", color=COLORS["kv"], fontsize=8, va="top",
            transform=ax.get_xaxis_transform())
    top = max(max(p99s), threshold_s) * 1.3
    ax.set_ylim(0, top)
    ax.set_xlim(0, max(rates) * 1.05)
    ax.set_xlabel("offered load λ (requests/s)")
    ax.set_ylabel("p99 end-to-end latency (s)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)
    ax.set_title("p99 latency against arrival rate: the knee at ρ = λ/μ → 1", fontsize=10)
    return fig
