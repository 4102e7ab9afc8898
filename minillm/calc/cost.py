"""Cost: dollars per million tokens on a rented GPU, when renting beats an API, and how many
GPUs a load needs.

``utilization`` is the fraction of the paid hours the GPUs spend serving at their measured
throughput (1 = busy around the clock). A rented GPU is paid whether it works or idles, so
every cost per token divides by it: a GPU busy a quarter of the time costs four times as much
per token as the same GPU kept full.
"""

from __future__ import annotations

import math

from ._common import _int, _probability, _real

#: Average hours in a calendar month (8760 h / 12), the figure cloud bills use.
HOURS_PER_MONTH = 730


def _utilization(value) -> float:
    return _probability("utilization", value, allow_zero=False)


def cost_per_million_tokens(dollars_per_hour, tokens_per_s, utilization=1.0) -> float:
    """Dollars per 1M generated tokens: ``$/h ÷ (tok/s · 3600 · utilization) × 1e6``.

    One A100 at $2.50/h serving 800 tok/s: $0.87 per million tokens; busy half the time,
    $1.74. ``tokens_per_s`` is the throughput while serving (all GPUs of the deployment if
    ``dollars_per_hour`` is the whole deployment's price).
    """
    busy = _real("tokens_per_s", tokens_per_s) * _utilization(utilization)
    return _real("dollars_per_hour", dollars_per_hour) / (busy * 3600) * 1e6


def gpu_dollars_per_month(dollars_per_hour, num_gpus=1) -> float:
    """What renting ``num_gpus`` GPUs around the clock costs a month: ``$/h · n · 730``."""
    return _real("dollars_per_hour", dollars_per_hour) * _int("num_gpus", num_gpus) * HOURS_PER_MONTH


def tokens_per_month(tokens_per_s, utilization=1.0) -> float:
    """Tokens a deployment serves in a month: ``tok/s · 3600 · 730 · utilization``."""
    return _real("tokens_per_s", tokens_per_s) * 3600 * HOURS_PER_MONTH * _utilization(utilization)


def break_even_tokens_per_month(gpu_dollars_per_month, api_dollars_per_million_tokens) -> float:
    """Monthly tokens above which renting the GPU beats paying the API:
    ``gpu $/month ÷ api $/token`` = ``gpu $/month ÷ (api $/1M) × 1e6``.

    One A100 at $2.50/h (1,825 $/month) against an API at $0.50 per 1M: 3.65 billion tokens a
    month. Only meaningful if the GPU can serve that many: see ``break_even_utilization``.
    """
    gpu = _real("gpu_dollars_per_month", gpu_dollars_per_month, allow_zero=True)
    api = _real("api_dollars_per_million_tokens", api_dollars_per_million_tokens)
    return gpu / api * 1e6


def break_even_utilization(dollars_per_hour, tokens_per_s, api_dollars_per_million_tokens) -> float:
    """The utilization at which self-hosting costs what the API does:
    ``cost_per_million_tokens(at utilization 1) ÷ api $/1M``.

    Below it the API is cheaper, above it the GPU. A value above 1 means the GPU loses even
    when busy every hour (the API is cheaper than the GPU's best case). One A100 at $2.50/h
    serving 800 tok/s ($0.87 per 1M at full load) against $2 per 1M: 0.43, so the GPU must be
    busy 43% of the time.
    """
    full = cost_per_million_tokens(dollars_per_hour, tokens_per_s)
    return full / _real("api_dollars_per_million_tokens", api_dollars_per_million_tokens)


def gpus_for_load(target_tokens_per_s, tokens_per_s_per_gpu, utilization=1.0) -> int:
    """GPUs (or replicas) needed to serve ``target_tokens_per_s``:
    ``ceil(target ÷ (per-GPU tok/s · utilization))``.

    Here ``utilization`` is the load you allow each GPU to run at (0.8 leaves 20% headroom
    for bursts: queueing delay climbs steeply as a server nears full load, see
    ``mm1_mean_latency``). 20,000 tok/s on GPUs that serve 800 each, at 80%: 32.
    """
    need = _real("target_tokens_per_s", target_tokens_per_s)
    each = _real("tokens_per_s_per_gpu", tokens_per_s_per_gpu) * _utilization(utilization)
    return max(1, math.ceil(need / each * (1 - 1e-12)))
