"""Parallelism across GPUs: ring all-reduce traffic and time, tensor parallelism's
all-reduces per layer, and the pipeline bubble.
"""

from __future__ import annotations

from ._common import _int, _real


def ring_allreduce_bytes(message_bytes, num_gpus) -> float:
    """Bytes each GPU sends in a ring all-reduce: ``2 · (N − 1) / N · message_bytes``.

    A reduce-scatter then an all-gather, each N − 1 steps of message/N bytes. N = 1: 0.
    """
    n = _int("num_gpus", num_gpus)
    return 2 * (n - 1) / n * _real("message_bytes", message_bytes, allow_zero=True)


def allreduce_time_s(message_bytes, num_gpus, link_bandwidth_bytes_per_s, latency_s=0.0) -> float:
    """Ring all-reduce time: ``ring_allreduce_bytes / link_bandwidth + 2 · (N − 1) · latency``.

    ``link_bandwidth_bytes_per_s`` is what one GPU can send (NVLink 4: 900 GB/s as quoted,
    PCIe 4 x16: 64 GB/s); ``latency_s`` is paid once per ring step.
    """
    n = _int("num_gpus", num_gpus)
    bw = _real("link_bandwidth_bytes_per_s", link_bandwidth_bytes_per_s)
    lat = _real("latency_s", latency_s, allow_zero=True)
    return ring_allreduce_bytes(message_bytes, n) / bw + 2 * (n - 1) * lat


def tp_allreduces_per_layer() -> int:
    """All-reduces per transformer block under Megatron-style tensor parallelism: 2.

    Attention: column-parallel QKV, row-parallel O, then one all-reduce. MLP: column-parallel
    gate/up, row-parallel down, then another.
    """
    return 2


def pp_bubble_fraction(num_stages, num_microbatches) -> float:
    """Idle fraction of a pipeline: ``(N − 1) / (N − 1 + M)`` for N stages, M microbatches.

    M = 1 (batch 1): (N − 1) / N. More microbatches fill the bubble.
    """
    n = _int("num_stages", num_stages)
    m = _int("num_microbatches", num_microbatches)
    return (n - 1) / (n - 1 + m)
