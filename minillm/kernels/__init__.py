"""Triton kernels (attention, and the W4A16 / W8A16 quantized matmuls), and the plain-PyTorch
attention they are checked against.

* ``flash_attention``        - FlashAttention-2 forward, q ``[B, Hq, T, D]``, GQA, causal.
* ``flash_attention_varlen`` - the same over packed sequences (``cu_seqlens``), used for
  chunked prefill.
* ``paged_decode_attention`` - one query token per sequence, K/V read through a block table.
* ``w4a16_linear``           - ``x @ Wᵀ`` with W stored in 4 bits (``minillm.quant.packing``),
  unpacked in registers from 32-bit words: a split-K GEMV for decode, tiles above.
* ``w8a16_linear``           - the same with W stored in 8 bits: one tiled tl.dot kernel that
  dequantizes each [BLOCK_K, BLOCK_N] tile in registers.
* ``decode_gemv``            - a few rows times a float or 4-bit weight, with the RMSNorm
  (and residual add) or SiLU·up before it done in the same kernel: a decode layer's glue.
* ``tiled``                  - ``naive_attention``, ``online_softmax_update``,
  ``tiled_attention``: the teaching steps and the oracle.

Set-up (``interpreter.py``): without a CUDA GPU the kernels run in Triton's CPU
interpreter, which must be chosen before ``triton`` is imported; that module does it and
says clearly when it came too late. Interpreter limits: fp32 (and fp16) only - no bf16
arithmetic -, every ``tl.dot`` dim >= 16, and it is slow (timings mean nothing).

Tiles (``tuning.py``): on CUDA each kernel launches with the tile configuration pinned for
the GPU's architecture in ``configs/sm_XY.json`` (measured once on such a GPU); autotuning
is something you ask for (``MINILLM_AUTOTUNE=1``), not something a first run pays. On the
interpreter each kernel uses one fixed small tile.
"""

from __future__ import annotations

from .interpreter import SETUP_PROBLEM, interpreter_enabled, require_working_setup
from .flash_attention import flash_attention, flash_attention_varlen  # noqa: E402
from .paged_decode import paged_decode_attention  # noqa: E402
from .tiled import naive_attention, online_softmax_update, tiled_attention  # noqa: E402
from .w4a16 import w4a16_linear  # noqa: E402
from .w8a16 import w8a16_linear  # noqa: E402

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "paged_decode_attention",
    "naive_attention",
    "online_softmax_update",
    "tiled_attention",
    "w4a16_linear",
    "w8a16_linear",
    "interpreter_enabled",
    "require_working_setup",
    "SETUP_PROBLEM",
]
