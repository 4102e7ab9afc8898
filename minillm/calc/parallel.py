"""Parallelism across GPUs: ring all-reduce traffic and time, tensor parallelism's head
rule, all-reduces, bytes and per-rank memory, its step time on NVLink or PCIe, and the
pipeline bubble.

Tensor parallelism (TP) here is Megatron-style, as `minillm.dist` implements it:

    qkv, gate|up   column-parallel (each rank holds whole heads / a slice of FFN columns)
    o, down        row-parallel, each followed by one all-reduce of [tokens, hidden]
    embedding      vocab-parallel: each rank looks up its rows, one all-reduce of [tokens, hidden]
    LM head        vocab-parallel, tied to the embedding shard: one gather of the logits to rank 0

Head rule (the one vLLM and Megatron use): ``num_heads % tp_size == 0``; if ``tp_size <=
num_kv_heads`` the KV heads divide too, else ``tp_size % num_kv_heads == 0`` and each KV head
is replicated ``tp_size / num_kv_heads`` times (one KV head per rank). Dimensions that do not
divide evenly (FFN columns, vocabulary rows) are split like ``torch.tensor_split``: the first
``n % tp_size`` ranks get one extra row (`tp_shard_size`).

Link bandwidths are per direction, which is what a ring all-reduce step uses: NVLink 4 on an
H100 moves 450 GB/s each way (900 GB/s is the bidirectional figure quoted on spec sheets),
PCIe Gen5 x16 32 GB/s each way (64 bidirectional).
"""

from __future__ import annotations

import math

from ._common import _int, _real
from .memory import attention_params, embedding_params, norm_params, swiglu_params

#: Per-direction link bandwidths (bytes/s): H100 NVLink 4 and PCIe Gen5 x16.
NVLINK_H100_BYTES_PER_S = 450e9
PCIE_GEN5_BYTES_PER_S = 32e9


def ring_allreduce_bytes(message_bytes, num_gpus) -> float:
    """Bytes each GPU sends in a ring all-reduce: ``2 · (N − 1) / N · message_bytes``.

    A reduce-scatter then an all-gather, each N − 1 steps of message/N bytes. N = 1: 0.
    """
    n = _int("num_gpus", num_gpus)
    return 2 * (n - 1) / n * _real("message_bytes", message_bytes, allow_zero=True)


def allreduce_time_s(message_bytes, num_gpus, link_bandwidth_bytes_per_s, latency_s=0.0) -> float:
    """Ring all-reduce time: ``ring_allreduce_bytes / link_bandwidth + 2 · (N − 1) · latency``.

    ``link_bandwidth_bytes_per_s`` is what one GPU sends in one direction, since each ring
    step sends to one neighbour while receiving from the other: H100 NVLink 4 450 GB/s
    (`NVLINK_H100_BYTES_PER_S`; the 900 GB/s on spec sheets counts both directions), PCIe
    Gen5 x16 32 GB/s (`PCIE_GEN5_BYTES_PER_S`; 64 both ways). ``latency_s`` is paid once per
    ring step.
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


# --------------------------------------------------------------------------- head rule


def tp_size_problem(num_heads, num_kv_heads, tp_size) -> str | None:
    """Why ``tp_size`` cannot shard these heads (a sentence), or None when it can."""
    hq, hkv, tp = (_int("num_heads", num_heads), _int("num_kv_heads", num_kv_heads),
                   _int("tp_size", tp_size))
    if hq % tp:
        return f"tp_size={tp} does not divide the {hq} query heads"
    if tp <= hkv and hkv % tp:
        return f"tp_size={tp} does not divide the {hkv} KV heads"
    if tp > hkv and tp % hkv:
        return (f"tp_size={tp} is larger than the {hkv} KV heads but not a multiple of them, "
                f"so they cannot be replicated evenly")
    return None


def tp_valid_sizes(num_heads, num_kv_heads) -> list[int]:
    """Every tensor-parallel size the head rule allows, from 1 to ``num_heads``."""
    hq = _int("num_heads", num_heads)
    return [tp for tp in range(1, hq + 1) if tp_size_problem(hq, num_kv_heads, tp) is None]


def _checked_tp(num_heads, num_kv_heads, tp_size) -> int:
    problem = tp_size_problem(num_heads, num_kv_heads, tp_size)
    if problem:
        raise ValueError(f"{problem}; use one of {tp_valid_sizes(num_heads, num_kv_heads)}.")
    return int(tp_size)


def tp_kv_heads_per_rank(num_heads, num_kv_heads, tp_size) -> int:
    """KV heads each rank holds: ``num_kv_heads / tp_size``, or 1 when replicated."""
    tp = _checked_tp(num_heads, num_kv_heads, tp_size)
    return max(1, int(num_kv_heads) // tp)


def tp_kv_replicas(num_heads, num_kv_heads, tp_size) -> int:
    """How many ranks hold a copy of each KV head: ``tp_size / num_kv_heads``, or 1."""
    tp = _checked_tp(num_heads, num_kv_heads, tp_size)
    return max(1, tp // int(num_kv_heads))


def tp_shard_size(n, tp_size, rank=0) -> int:
    """Rows of an ``n``-row dimension on ``rank``: ``n // tp``, plus one on the first
    ``n % tp`` ranks (``torch.tensor_split``'s split)."""
    n, tp = _int("n", n), _int("tp_size", tp_size)
    r = _int("rank", rank, minimum=0)
    if r >= tp:
        raise ValueError(f"rank must lie in [0, {tp}) for tp_size={tp}; got {r}.")
    return n // tp + (1 if r < n % tp else 0)


# --------------------------------------------------------------------------- TP traffic


def tp_allreduce_count(num_layers) -> int:
    """All-reduces in one tensor-parallel forward: 2 per layer plus the embedding's 1."""
    return tp_allreduces_per_layer() * _int("num_layers", num_layers) + 1


def tp_allreduce_bytes(num_tokens, hidden_size, num_layers, dtype_bytes) -> int:
    """Bytes handed to all-reduces in one tensor-parallel forward, on every rank (tp > 1):
    ``(2 · num_layers + 1) · num_tokens · hidden_size · dtype_bytes``.

    Counted: the output of o_proj and of down_proj in each layer, and the embedding's
    output, each a [num_tokens, hidden_size] message (what `minillm.dist.CommLedger`
    records). Not counted: the logits' gather (`tp_logits_gather_bytes`), the sampled
    token's broadcast, and the ring's 2(N−1)/N factor (`ring_allreduce_bytes` applies it).
    At tp_size = 1 nothing is communicated.
    """
    tokens, d = _int("num_tokens", num_tokens), _int("hidden_size", hidden_size)
    nbytes = tokens * d * _real("dtype_bytes", dtype_bytes)
    return int(tp_allreduce_count(num_layers) * nbytes)


def tp_logits_gather_bytes(num_tokens, vocab_size, tp_size, dtype_bytes) -> int:
    """Bytes each rank hands to the gather of the logits to rank 0:
    ``num_tokens · ceil(vocab_size / tp_size) · dtype_bytes`` (shards are padded to the
    largest so the gather moves equal pieces; the padding is cut off on rank 0)."""
    tokens, tp = _int("num_tokens", num_tokens), _int("tp_size", tp_size)
    return int(tokens * math.ceil(_int("vocab_size", vocab_size) / tp)
               * _real("dtype_bytes", dtype_bytes))


# --------------------------------------------------------------------------- TP memory


def tp_param_bytes_per_rank(config, tp_size, dtype_bytes, rank=0) -> int:
    """Parameter bytes held by ``rank`` when ``config`` (a `ModelConfig`) is sharded over
    ``tp_size`` ranks.

    Sharded: qkv (this rank's query heads and its KV heads, replicated ones included), o,
    gate|up, down, and the vocabulary rows of the embedding (the tied LM head shares them;
    an untied head is a second shard). Replicated on every rank: the RMSNorm weights
    (2 per layer and the final one). With uneven splits the first ranks hold a row more.
    """
    c, tp = config, _int("tp_size", tp_size)
    hq = c.num_heads // _checked_tp(c.num_heads, c.num_kv_heads, tp)
    hkv = tp_kv_heads_per_rank(c.num_heads, c.num_kv_heads, tp)
    d = c.hidden_size
    layer = (attention_params(d, hq, hkv, c.head_dim)
             + swiglu_params(d, tp_shard_size(c.intermediate_size, tp, rank)))
    embed = embedding_params(tp_shard_size(c.vocab_size, tp, rank), d, c.tie_word_embeddings)
    return int((c.num_layers * layer + norm_params(d, c.num_layers) + embed)
               * _real("dtype_bytes", dtype_bytes))


# --------------------------------------------------------------------------- TP time


def tp_step_time_s(config, num_tokens, tp_size, link_bandwidth_bytes_per_s,
                   hbm_bandwidth_bytes_per_s, peak_flops, dtype_bytes=2,
                   latency_s=0.0, logit_rows=None) -> dict:
    """Predicted time of one tensor-parallel forward of ``num_tokens`` tokens on GPUs.

    compute: each rank's roofline, ``max(param_bytes / hbm_bandwidth, 2 · params · tokens /
    peak_flops)`` with rank 0's parameters (`tp_param_bytes_per_rank`); attention is left out.
    comm: ``2 · num_layers + 1`` ring all-reduces of ``tokens · hidden · dtype_bytes`` over the
    link (`allreduce_time_s`, per-direction bandwidth), plus the logits' gather, in which rank
    0 receives ``tp − 1`` shards of ``logit_rows`` rows (default every token, as in a full
    forward; generation needs only the last row of each sequence, so pass 1 for its prefill).
    Nothing overlaps: the layer waits for its all-reduce.

    Returns {"compute_s", "comm_s", "total_s"}. At tp_size = 1, comm_s = 0.
    """
    tp = _int("tp_size", tp_size)
    tokens = _int("num_tokens", num_tokens)
    bw_link = _real("link_bandwidth_bytes_per_s", link_bandwidth_bytes_per_s)
    lat = _real("latency_s", latency_s, allow_zero=True)
    param_bytes = tp_param_bytes_per_rank(config, tp, dtype_bytes)
    params = param_bytes / _real("dtype_bytes", dtype_bytes)
    compute = max(param_bytes / _real("hbm_bandwidth_bytes_per_s", hbm_bandwidth_bytes_per_s),
                  2 * params * tokens / _real("peak_flops", peak_flops))
    comm = 0.0
    if tp > 1:
        message = tokens * config.hidden_size * dtype_bytes
        comm = tp_allreduce_count(config.num_layers) * allreduce_time_s(message, tp, bw_link, lat)
        rows = tokens if logit_rows is None else _int("logit_rows", logit_rows)
        gather = tp_logits_gather_bytes(rows, config.vocab_size, tp, dtype_bytes)
        comm += (tp - 1) * gather / bw_link + lat
    return {"compute_s": compute, "comm_s": comm, "total_s": compute + comm}


# --------------------------------------------------------------------------- pipeline


def pp_bubble_fraction(num_stages, num_microbatches) -> float:
    """Idle fraction of a pipeline: ``(N − 1) / (N − 1 + M)`` for N stages, M microbatches.

    M = 1 (batch 1): (N − 1) / N. More microbatches fill the bubble.
    """
    n = _int("num_stages", num_stages)
    m = _int("num_microbatches", num_microbatches)
    return (n - 1) / (n - 1 + m)
