"""Serving latency and queueing: utilization, the M/M/1 queue, Little's law, end-to-end
latency from TTFT and ITL.

Rates are requests/s, times are seconds.
"""

from __future__ import annotations

from ._common import _int, _real


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
