"""Lab 03 checks: the online-softmax update, tiled attention in PyTorch, and the inner loop
of a FlashAttention kernel in Triton.

    check.online_softmax_update(online_softmax_update)   # (m, l, acc, scores, v) -> (m, l, acc)
    check.tiled_attention(tiled_attention)               # (q, k, v, causal, block_n) -> out
    check.flash_inner_loop(attn_inner_loop)              # a @triton.jit loop, run in the lab kernel

Oracles: ``minillm.kernels.tiled.online_softmax_update`` and ``naive_attention`` in float64.
When a result differs, the check recomputes the usual mistakes on the same inputs and with
the same tiles (a missed rescale, the block max instead of the running max, an off-by-one
causal mask, a wrong scale, a skipped last tile, unmasked padding keys ...). If the
student's numbers match one of them, the message names it and says what to write;
otherwise it shows yours vs reference with the mismatching rows marked.

Layout: ``update.py`` (the online-softmax update), ``attention.py`` (tiled attention in
PyTorch, and the tile loop with its usual mistakes that the Triton check reuses),
``flash.py`` (the Triton inner loop), ``mistakes.py`` (when a known mistake explains the
student's numbers).

Invariants: inputs are fresh random numbers (never zeros) on every call; the update check
includes blocks whose rows are all −inf (fully masked) and a block that raises the max;
the attention checks run causal and non-causal with T not a multiple of the tile (at
least in the first case). A mistake is only named when it reproduces the student's
output everywhere it is defined and differs from the reference.
"""

from .attention import tiled_attention
from .flash import flash_inner_loop
from .update import online_softmax_update

__all__ = ["online_softmax_update", "tiled_attention", "flash_inner_loop"]
