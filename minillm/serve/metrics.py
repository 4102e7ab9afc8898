"""Prometheus metrics, named like vLLM's (`minillm:` prefix), and a parser for the text.

Histograms (seconds): `minillm:time_to_first_token_seconds` (one observation per sequence,
at its first token), `minillm:inter_token_latency_seconds` (one per later token, the gap to
the previous one) and `minillm:e2e_request_latency_seconds` (one per sequence that finished
with stop or length). Gauges: `minillm:num_requests_running`, `minillm:num_requests_waiting`,
`minillm:kv_cache_usage_perc` (used blocks / all blocks, a fraction as in vLLM), and the
pool's `minillm:kv_cache_num_blocks` / `minillm:kv_cache_free_blocks`. Counters:
`minillm:prompt_tokens_total` (once per request, whatever n), `minillm:generation_tokens_total`,
`minillm:request_success_total{finished_reason}` (stop/length), `minillm:request_shed_total
{reason}` (503s) and `minillm:request_abort_total` (client gone, stop string, drain).

The timings are those a client sees: from the moment the server read the request to the
moment the token was handed to the HTTP layer. `/health` probes are not counted.
Each app owns its own `CollectorRegistry`, so several servers can live in one process.
"""
from __future__ import annotations

import re

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

disable_created_metrics()  # no `*_created` series: they double /metrics for nothing here

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                   0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("minillm:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minillm:inter_token_latency_seconds", "Inter-token latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minillm:e2e_request_latency_seconds",
                             "End-to-end latency of finished sequences",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("minillm:num_requests_running", "Sequences running in the engine",
                             registry=r)
        self.waiting = Gauge("minillm:num_requests_waiting", "Requests waiting to be scheduled",
                             registry=r)
        self.kv_usage = Gauge("minillm:kv_cache_usage_perc",
                              "Fraction of KV blocks in use (0..1)", registry=r)
        self.kv_blocks = Gauge("minillm:kv_cache_num_blocks", "KV blocks in the pool", registry=r)
        self.kv_free = Gauge("minillm:kv_cache_free_blocks", "Free KV blocks", registry=r)
        self.prompt_tokens = Counter("minillm:prompt_tokens", "Prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("minillm:generation_tokens", "Tokens generated",
                                         registry=r)
        self.success = Counter("minillm:request_success", "Sequences finished",
                               ["finished_reason"], registry=r)
        self.shed = Counter("minillm:request_shed", "Requests answered 503", ["reason"],
                            registry=r)
        self.aborted = Counter("minillm:request_abort", "Requests aborted", registry=r)
        for reason in ("stop", "length"):
            self.success.labels(finished_reason=reason)

    def update_engine(self, stats: dict, num_pending: int) -> None:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"] + num_pending)
        self.kv_usage.set(stats["kv_cache_usage"])
        self.kv_blocks.set(stats["num_blocks"])
        self.kv_free.set(stats["num_free_blocks"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?)\s+(\S+)(?:\s+\S+)?$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}. Comment lines (# HELP,
    # TYPE) are skipped; labels are kept exactly as written, e.g.
    'minillm:request_success_total{finished_reason="length"}'."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        out[m.group(1)] = float(m.group(2))
    return out
