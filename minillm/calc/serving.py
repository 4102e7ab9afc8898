"""Serving latency and queueing: utilization, the M/M/1 queue, Little's law, end-to-end
latency from TTFT and ITL, percentiles of measured latencies, replicas by Little's law; and
the numbers behind three serving designs: prefill/decode disaggregation (KV transfer time),
many LoRA adapters on one base model (adapter bytes), KV fragmentation as a metric.

Rates are requests/s, times are seconds, percentiles p in (0, 100].
"""

from __future__ import annotations

import math

from ._common import _int, _items, _real


def utilization(arrival_rate, service_rate) -> float:
    """Server utilization ``ρ = λ / μ`` (requests/s over requests/s). ρ ≥ 1 means the queue
    grows without bound; latency already climbs steeply above about 0.8."""
    return _real("arrival_rate", arrival_rate, allow_zero=True) / _real("service_rate", service_rate)


def mm1_mean_latency(arrival_rate, service_rate) -> float:
    """Mean time in an M/M/1 system (queueing + service): ``W = 1 / (μ − λ)`` seconds.

    Equivalently (1/μ) / (1 − ρ): at ρ = 0.5 twice the service time, at 0.9 ten times.
    Raises ValueError at ρ ≥ 1, where no steady state exists.
    """
    lam = _real("arrival_rate", arrival_rate, allow_zero=True)
    mu = _real("service_rate", service_rate)
    if lam >= mu:
        raise ValueError(
            f"arrival_rate must be below service_rate for a stable queue; got arrival_rate={lam!r}, "
            f"service_rate={mu!r} (ρ = {lam / mu:.3g} >= 1): the queue grows without bound. "
            "Lower the arrival rate or add capacity."
        )
    return 1 / (mu - lam)


def littles_law_L(arrival_rate, mean_time_s) -> float:
    """Little's law: mean number in the system ``L = λ · W`` (requests/s × seconds)."""
    return _real("arrival_rate", arrival_rate, allow_zero=True) * _real("mean_time_s", mean_time_s, allow_zero=True)


def e2e_latency_s(ttft_s, itl_s, num_output_tokens) -> float:
    """End-to-end latency of a request: ``TTFT + (n − 1) · ITL``.

    The first token arrives at TTFT; each of the other n − 1 follows one ITL later. The
    common form TTFT + n · ITL counts one gap too many.
    """
    n = _int("num_output_tokens", num_output_tokens)
    return _real("ttft_s", ttft_s, allow_zero=True) + (n - 1) * _real("itl_s", itl_s, allow_zero=True)


def percentile(values, p) -> float:
    """The p-th percentile of ``values`` by the nearest-rank method: the smallest observed
    value that at least p % of the values do not exceed.

    Sort, take rank ``⌈p · n / 100⌉`` (1-based): p99 of 100 latencies is the 99th smallest,
    ``sorted(values)[98]``. Always a value that was observed (no interpolation), so a p99
    over a short load test is a real request's latency. p = 100 is the maximum.
    """
    items = _items("values", values, "numbers (latencies, say)")
    xs = sorted(_real(f"values[{i}]", v, allow_zero=True) for i, v in enumerate(items))
    q = _real("p", p)
    if q > 100:
        raise ValueError(f"p is a percentile, 0 < p <= 100 (99 for p99, not 0.99); got {p!r}.")
    rank = math.ceil(round(q * len(xs) / 100, 9))  # round: 99 · 100 / 100 must stay 99
    return xs[max(rank, 1) - 1]


def mm1_latency_percentile(arrival_rate, service_rate, p) -> float:
    """The p-th percentile of the time in an M/M/1 system: ``−ln(1 − p/100) / (μ − λ)``.

    The time in system of M/M/1 is exponential with rate μ − λ, so every percentile is the
    mean ``calc.mm1_mean_latency`` times ``−ln(1 − p/100)``: 4.6× the mean for p99.
    """
    q = _real("p", p)
    if q >= 100:
        raise ValueError(f"p must be below 100 (an exponential has no maximum); got {p!r}.")
    return -math.log(1 - q / 100) * mm1_mean_latency(arrival_rate, service_rate)


def queueing_latency_s(base_latency_s, arrival_rate, service_rate) -> float:
    """The M/M/1-style latency curve of a server measured once, unloaded:
    ``base / (1 − ρ)`` with ``ρ = λ / μ``.

    ``base_latency_s`` is the latency (a mean, or a percentile) measured at low load;
    ``service_rate`` μ is the measured capacity in requests/s (for a batching server: the
    completion rate when every slot is busy, not 1 / base). With ``base = 1 / μ`` this is
    exactly ``calc.mm1_mean_latency``. A server with many slots stays flatter than this at
    moderate ρ (many servers share the queue) and then climbs just as steeply near ρ = 1.
    Raises ValueError at ρ ≥ 1, where the queue grows for as long as the load lasts.
    """
    base = _real("base_latency_s", base_latency_s)
    rho = utilization(arrival_rate, service_rate)
    if rho >= 1:
        raise ValueError(
            f"arrival_rate must be below service_rate for a steady state; got ρ = {rho:.3g} >= 1. "
            "Past capacity the latency grows with the test's duration, not with ρ.")
    return base / (1 - rho)


def replicas_needed(arrival_rate, mean_time_s, concurrency_per_replica, max_utilization=1.0) -> int:
    """Replicas a service needs by Little's law: ``⌈λ · W / (c · u)⌉``.

    λ · W requests are in the system on average (Little's law); one replica holds at most
    ``concurrency_per_replica`` of them at once (its max_num_seqs); ``max_utilization``
    below 1 keeps headroom so the queue does not sit at the knee. 50 req/s that each spend
    4 s in the server, 32 per replica: 200 in flight, 7 replicas (8 at u = 0.8).
    """
    in_flight = littles_law_L(arrival_rate, mean_time_s)
    c = _int("concurrency_per_replica", concurrency_per_replica)
    u = _real("max_utilization", max_utilization)
    if u > 1:
        raise ValueError(f"max_utilization is a fraction of capacity, 0 < u <= 1; got {max_utilization!r}.")
    return max(1, math.ceil(round(in_flight / (c * u), 9)))


def kv_transfer_time_s(num_tokens, kv_bytes_per_token, link_bytes_per_s) -> float:
    """Seconds to ship a prompt's KV cache from a prefill node to a decode node
    (prefill/decode disaggregation): ``tokens · bytes per token / link bandwidth``.

    Llama-2-70B (327,680 B per token in fp16) at 4,096 tokens is 1.34 GB: 27 ms over a
    50 GB/s (400 Gb/s) RDMA link, against about a second of prefill on one GPU.
    """
    return (_int("num_tokens", num_tokens) * _real("kv_bytes_per_token", kv_bytes_per_token)
            / _real("link_bytes_per_s", link_bytes_per_s))


def lora_adapter_bytes(num_layers, rank, matrix_shapes, dtype_bytes) -> float:
    """Bytes of one LoRA adapter: ``layers · Σ r · (d_in + d_out) · bytes`` over the adapted
    matrices of a layer, given as ``[(d_in, d_out), ...]``.

    Each adapted W (d_out × d_in) gains B (d_out × r) and A (r × d_in). SmolLM2's q, k, v, o
    at rank 16 in fp32: 30 · 16 · (1152 + 768 + 768 + 1152) · 4 B = 7.4 MB, 1.4% of the
    540 MB base: a hundred adapters fit beside one base model.
    """
    layers = _int("num_layers", num_layers)
    r = _int("rank", rank)
    shapes = _items("matrix_shapes", matrix_shapes, "(d_in, d_out) pairs")
    per_layer = 0
    for i, shape in enumerate(shapes):
        try:
            d_in, d_out = shape
        except (TypeError, ValueError):
            raise ValueError(f"matrix_shapes[{i}] must be a (d_in, d_out) pair; got {shape!r}.") from None
        per_layer += r * (_int(f"matrix_shapes[{i}][0]", d_in) + _int(f"matrix_shapes[{i}][1]", d_out))
    return layers * per_layer * _real("dtype_bytes", dtype_bytes)


def kv_fragmentation(num_tokens, num_blocks, block_size) -> float:
    """Fraction of the allocated KV slots that hold no token: ``1 − tokens / (blocks · size)``.

    In a paged cache only each sequence's last block is partly empty, so with n sequences
    the waste is below n · (block_size − 1) slots. A server exports it as a gauge; alerting
    when it stays high catches a block size too large for the traffic (or a leak: blocks
    held by no live token).
    """
    tokens = _int("num_tokens", num_tokens, minimum=0)
    blocks = _int("num_blocks", num_blocks, minimum=0)
    size = _int("block_size", block_size)
    if tokens > blocks * size:
        raise ValueError(f"{tokens} tokens cannot fit in {blocks} blocks of {size}; num_tokens must be "
                         f"<= num_blocks · block_size = {blocks * size}.")
    return 0.0 if blocks == 0 else 1 - tokens / (blocks * size)
