"""Memory: KV-cache bytes, weight bytes, and how many sequences fit beside the weights.

Bytes are SI (see ``minillm.calc``); ``dtype_bytes`` is bytes per element.
"""

from __future__ import annotations

import math

from ._common import _int, _real


# --------------------------------------------------------------------------- KV cache


def kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes=2) -> float:
    """KV-cache bytes one token adds: ``2 · L · H_kv · D · dtype_bytes``.

    The 2 is one K and one V vector per KV head per layer. Llama-2-70B (80 layers, 8 KV
    heads, head_dim 128) in fp16: 327,680 bytes (320 KiB) per token.
    """
    layers = _int("num_layers", num_layers)
    kv_heads = _int("num_kv_heads", num_kv_heads)
    dim = _int("head_dim", head_dim)
    b = _real("dtype_bytes", dtype_bytes)
    return 2 * layers * kv_heads * dim * b


def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, dtype_bytes=2, batch=1) -> float:
    """KV-cache bytes: ``2 · L · H_kv · D · T · dtype_bytes · batch``.

    Llama-2-70B at T = 4096 in fp16: 1.34 GB per sequence (with 64 KV heads, i.e. MHA:
    10.7 GB). Llama-3-8B (32 layers, 8 KV heads, 128) at 8192: 1.07 GB. GPT-3 175B
    (96 layers, 96 heads, 128, MHA) at 4096: 19.3 GB, which is 18.0 GiB, the "about 18 GB"
    many texts quote.
    """
    per_token = kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
    return per_token * _int("seq_len", seq_len) * _int("batch", batch)


# --------------------------------------------------------------------------- weights and memory
# A Llama-style decoder's parameters, piece by piece: the one formula that `ModelConfig.
# num_params`, the tensor-parallel shard (`tp_param_bytes_per_rank`, per-rank heads and rows)
# and the MoE count (`MoEConfig.shared_params`) all add up.


def attention_params(hidden_size, num_heads, num_kv_heads, head_dim) -> int:
    """One layer's attention weights: q|k|v ``(Hq + 2·Hkv)·D·d`` and o ``d·Hq·D`` (no biases).
    SmolLM2-135M (d 576, 9 / 3 heads of 64): 884,736."""
    d, hq = _int("hidden_size", hidden_size), _int("num_heads", num_heads)
    hkv, dim = _int("num_kv_heads", num_kv_heads), _int("head_dim", head_dim)
    return (hq + 2 * hkv) * dim * d + d * hq * dim


def swiglu_params(hidden_size, intermediate_size) -> int:
    """One SwiGLU MLP's weights: gate, up and down, ``3·d·f``. SmolLM2-135M: 2,654,208."""
    return 3 * _int("hidden_size", hidden_size) * _int("intermediate_size", intermediate_size)


def norm_params(hidden_size, num_layers) -> int:
    """The RMSNorm weights: two per layer and the final one, ``(2L + 1)·d``."""
    return (2 * _int("num_layers", num_layers) + 1) * _int("hidden_size", hidden_size)


def embedding_params(vocab_size, hidden_size, tie_word_embeddings=True) -> int:
    """The embedding ``V·d``, and as much again for an LM head that is not tied to it."""
    return _int("vocab_size", vocab_size) * _int("hidden_size", hidden_size) * (
        1 if tie_word_embeddings else 2)


def weight_bytes(num_params, dtype_bytes) -> float:
    """Bytes of the weights: ``N · dtype_bytes``. 13B in fp16: 26 GB; 70B: 140 GB."""
    return _real("num_params", num_params) * _real("dtype_bytes", dtype_bytes)


def memory_per_gpu(weight_bytes, tp) -> float:
    """Weight bytes each GPU holds under tensor parallelism of degree ``tp``: ``W / tp``.

    70B in fp16 (140 GB) at tp = 1 / 2 / 4 / 8: 140 / 70 / 35 / 17.5 GB. KV cache and
    activations come on top.
    """
    return _real("weight_bytes", weight_bytes) / _int("tp", tp)


def max_concurrent_sequences(memory_bytes, weight_bytes, kv_bytes_per_seq, overhead_bytes=0) -> int:
    """How many sequences' KV caches fit: ``floor((M − W − overhead) / kv_per_seq)``, at least 0.

    80 GB with a 14 GB model and 5 GB per sequence: floor(66 / 5) = 13.
    """
    memory = _real("memory_bytes", memory_bytes)
    weights = _real("weight_bytes", weight_bytes, allow_zero=True)
    per_seq = _real("kv_bytes_per_seq", kv_bytes_per_seq)
    overhead = _real("overhead_bytes", overhead_bytes, allow_zero=True)
    free = memory - weights - overhead
    if free <= 0:
        return 0
    # The tiny relative slack keeps float noise such as 60e9 / 5e9 = 11.999... from losing one.
    return int(math.floor(free / per_seq * (1 + 1e-12)))
