"""Attention variants (MHA, GQA, MQA): KV-cache reduction, score-matrix size, and the
arithmetic intensity of a decode step's attention.
"""

from __future__ import annotations

from ._common import _heads, _int, _real


def gqa_reduction(num_heads, num_kv_heads) -> int:
    """How many times smaller the KV cache is than MHA's: ``num_heads / num_kv_heads``.

    MHA gives 1, MQA gives ``num_heads``; GQA 32/8 gives 4, 64/8 gives 8.
    """
    h, hkv = _heads(num_heads, num_kv_heads)
    return h // hkv


def max_kv_heads(num_heads, num_layers, head_dim, seq_len, budget_bytes, dtype_bytes=2) -> int:
    """The most KV heads a model with ``num_heads`` query heads can keep when one sequence of
    ``seq_len`` tokens may use ``budget_bytes`` of KV cache; 0 when not even MQA fits.

    Every KV head serves the same number of query heads, so the count must divide
    ``num_heads``: the largest divisor whose cache (``kv_cache_bytes``) fits the budget.
    Llama-2-70B's shape (64 heads, 80 layers, head_dim 128) at 32,768 tokens in fp16 costs
    1.34 GB per KV head: 8 GB allows 5 by bytes, so 4 (64 is not divisible by 5).
    """
    from .memory import kv_cache_bytes

    h = _int("num_heads", num_heads)
    budget = _real("budget_bytes", budget_bytes, allow_zero=True)
    per_head = kv_cache_bytes(num_layers, 1, head_dim, seq_len, dtype_bytes)
    fits = [g for g in range(1, h + 1) if h % g == 0 and g * per_head <= budget * (1 + 1e-12)]
    return max(fits, default=0)


def attention_kind(num_heads, num_kv_heads) -> str:
    """Name the attention variant: ``"MHA"`` (one KV head per query head), ``"MQA"`` (one KV
    head in all) or ``"GQA"`` (groups of query heads share a KV head)."""
    h, hkv = _heads(num_heads, num_kv_heads)
    if hkv == h:
        return "MHA"
    if hkv == 1:
        return "MQA"
    return "GQA"


def attention_matrix_bytes(seq_len, dtype_bytes=2, num_heads=1, batch=1) -> float:
    """Bytes of the T×T score matrix naive attention materializes: ``T² · dtype_bytes · H · B``.

    At T = 128K (131,072) in fp16, one head: 34.4 GB = 32 GiB. FlashAttention never stores it.
    """
    t = _int("seq_len", seq_len)
    return t * t * _real("dtype_bytes", dtype_bytes) * _int("num_heads", num_heads) * _int("batch", batch)


def attention_intensity(seq_len, head_dim, num_heads, num_kv_heads=None, dtype_bytes=2) -> float:
    """FLOPs per byte of one decode step's attention (one sequence, one layer).

    FLOPs = ``4 · H · T · D`` (QKᵀ and P·V, softmax left out). Bytes = ``(2 · H_kv · T · D +
    2 · H · D) · dtype_bytes``: the whole K and V cache read once, plus q in and the output
    out. About ``2 · (H / H_kv) / dtype_bytes``: 1 FLOP/byte for MHA in fp16, 4 for GQA 32/8.
    Batching does not help: every sequence reads its own cache.
    """
    t = _int("seq_len", seq_len)
    d = _int("head_dim", head_dim)
    h, hkv = _heads(num_heads, num_heads if num_kv_heads is None else num_kv_heads)
    b = _real("dtype_bytes", dtype_bytes)
    return 4 * h * t * d / ((2 * hkv * t * d + 2 * h * d) * b)


def sliding_window_kv_tokens(seq_len, window) -> int:
    """Positions a sliding-window layer keeps in its KV cache: ``min(T, W)``.

    With a window of W, query i attends to keys i − W + 1 .. i, so older keys can be dropped
    (a ring buffer of W slots). Mistral-7B (W = 4096) at 32,768 tokens keeps 4,096 per layer:
    8× less KV than full attention. Only the cache is bounded; information still reaches
    further back through the layers (W per layer, so up to layers · W tokens).
    """
    return min(_int("seq_len", seq_len), _int("window", window))


def rope_max_wavelength(head_dim, theta=10000.0) -> float:
    """Positions per full turn of RoPE's slowest-rotating pair: ``2π · θ^((D − 2) / D)``.

    Pair i rotates by ``pos · θ^(−2i/D)`` radians. The slowest pair (i = D/2 − 1) completes a
    turn only after this many positions; a model trained on shorter contexts never saw its
    later angles, which is why it degrades past its training length without scaling.
    """
    d = _int("head_dim", head_dim, minimum=2)
    if d % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {d}")
    return 2 * 3.141592653589793 * _real("theta", theta) ** ((d - 2) / d)


def rope_ntk_theta(theta, scale, head_dim) -> float:
    """The RoPE base for NTK-aware scaling by ``scale``: ``θ · s^(D / (D − 2))``.

    It stretches the slowest pair's wavelength by exactly ``s`` (so positions up to s times the
    training length land on angles the model has seen) while the fastest pairs, which encode
    nearby order, barely change. Linear position interpolation instead divides every
    position by s, slowing all pairs alike.
    """
    d = _int("head_dim", head_dim, minimum=3)
    s = _real("scale", scale)
    if s < 1:
        raise ValueError(f"scale must be >= 1 (a context extension factor), got {s}")
    return _real("theta", theta) * s ** (d / (d - 2))
