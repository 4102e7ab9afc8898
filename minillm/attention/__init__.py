"""Attention: every way the model's attention is stored and computed, in one package.

The model computes q, k, v and RoPE, then calls `ctx.attend(layer_idx, q, k, v, kv_stored)`
on an *attention context*, which decides where K/V live and calls a *backend*, which decides
how attention is computed. Contexts own storage; backends own math. A context may let the
layer store K/V in RoPE's pass (`ctx.kv_write(layer_idx)`, see `contexts.py`).

    backends.py    TorchBackend (SDPA), TritonBackend (FlashAttention kernels), get_backend,
                   decode_attention (one query per sequence, GQA folded)
    contexts.py    NoCacheContext, ContiguousCacheContext (Lab 02's KVCache)
    paged.py       PagedAttentionMetadata, PagedAttentionContext: the serving engine's
                   flattened step over a paged cache; `choose_decode_path` picks how
                   decodes attend
    paged_ref.py   the plain-PyTorch paged attention every paged kernel is checked against
    cpu_decode.py  the C++ CPU paged-decode kernel (csrc/), built on first use

Dependencies go one way: this package reads paged *storage* (`minillm.paged.kv_cache`);
nothing under `minillm.paged` imports it.
"""
from .backends import BACKENDS, TorchBackend, TritonBackend, decode_attention, get_backend
from .contexts import ContiguousCacheContext, NoCacheContext
from .paged import (DECODE_PATHS, PagedAttentionContext, PagedAttentionMetadata,
                    choose_decode_path, static_decode_problem)
from .paged_ref import paged_decode_attention_ref, paged_prefill_attention_ref

__all__ = [
    "BACKENDS", "TorchBackend", "TritonBackend", "decode_attention", "get_backend",
    "NoCacheContext", "ContiguousCacheContext",
    "DECODE_PATHS", "PagedAttentionContext", "PagedAttentionMetadata", "choose_decode_path",
    "static_decode_problem",
    "paged_decode_attention_ref", "paged_prefill_attention_ref",
]
