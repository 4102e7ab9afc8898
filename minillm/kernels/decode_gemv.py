"""The decode GEMV: a few rows times a weight matrix, with the glue before it done in its
prologue (and for q|k|v, RoPE and the K/V store after it in its epilogue). The kernel:
``decode_gemv_kernel.py``; here its wrappers and its tiles.

Why: replayed as a CUDA graph, a SmolLM2 decode step is a chain of ~280 small kernels, nine
per layer (`glue.py`), and on an H100 each costs ~1.5 µs of launch and drain on top of its
work, about as much as the work itself. Three of the nine exist only to feed a weight
product: the input norm (with the residual add) before q|k|v, the post-attention norm (with
its add) before gate|up, and SiLU·up before down. A GEMV can do that glue itself while it
loads its input row; and one more only finishes q|k|v's output: RoPE and the K/V store
(`glue.rope_kv`), which q|k|v's GEMV can do before it stores. So a decode layer becomes five
kernels, four of them this GEMV (o_proj has no glue before it, but at a few rows the GEMV
beats cuBLAS and the W4A16 kernel for it too):

    norm_linear(qkv, rope) -> attention -> linear(o_proj) -> norm_linear(gate_up)
    -> silu_mul_linear(down)

    linear(x, w)                         y = x Wᵀ
    norm_linear(x, delta, nw, eps, w)    (s, y): s = x + delta (or x), y = RMSNorm(s) Wᵀ
      ..., rope=Rope(...)                y's q and k heads rotated, k and v stored
    silu_mul_linear(gate_up, w)          y = (silu(gate) * up) Wᵀ

W is a float matrix [N, K] of x's dtype, or an `Int4Weight`: the packed 4-bit layout of
`minillm.quant.packing` (uint8 [N, K / 2], fp32 scales and zeros [N, K / g]; zeros None for
a symmetric weight, every zero 8), read as int32 words and unpacked in registers (the
2^23 trick of `w4a16_kernel._unpack`). So a w4 model gets the same five kernels, reading a quarter
of the bytes.

Tiles (`DECODE_GEMV`, a `tuning.Tunable`): BLOCK_N rows a program, its warps and, for a
4-bit weight, SPLIT chunks of BLOCK_K columns side by side a step and UNROLL steps a loop
iteration, pinned per GPU architecture and
shape class in ``configs/sm_XY.json`` like every Triton kernel's. Where nothing is measured
the pin is the kernel's own rule (`_analytic`). They are measured by gpu_check's opt-in
`gemv_tiles` section, which times candidates (`tiles`) from CUDA graphs over weights larger
than L2, the way a decode step reads them, and keeps the fastest of each class for the rest
of its process and for `pin_configs.py --merge`; never by the autotuner's warm-L2 loop.

Invariants (the kernel's own, on rounding and RoPE: ``decode_gemv_kernel.py``):
- The tiles depend on N, K, the weight's kind and the prologue, never on M: a padded
  CUDA-graph batch gives a sequence the bits of a batch of one.
- No value of a CUDA tensor is read on the host and nothing is allocated but the outputs:
  safe inside a CUDA-graph capture.

Where it runs (`minillm.layers.fused.norm_linear`, `norm_linear_rope`, `silu_mul_linear`,
`linear`): wherever the Triton glue runs (CUDA, eager or in a graph; not inside
torch.compile), for at most MAX_ROWS rows, and for a weight that is a plain `Linear`'s or
a 4-bit `QuantLinear`'s with no hooks. `MINILLM_FUSED_GEMV=0` switches it off (the A/B of
the GPU check), `MINILLM_FUSED_ROPE=0` the RoPE epilogue alone.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton

from . import tuning
from ._checks import _check_device_dtype
from ._grid import cdiv, next_power_of_2
from .decode_gemv_kernel import _decode_gemv_kernel
from .glue import rope_args
from .interpreter import interpreter_enabled
from .w4a16 import _as_words, _block_k, _check_args, _k_class, _n_class

__all__ = ["Int4Weight", "int4_weight", "Rope", "linear", "norm_linear", "silu_mul_linear",
           "tiles", "launch_tiles", "DECODE_GEMV", "MAX_ROWS"]

MAX_ROWS = 4  # from here the unfused path (cuBLAS, w4a16's tiles): W re-read per row
MAX_DENSE_BLOCK_K = 1024  # columns per step of a float weight (`_dense_block_k`)
TILE_ELEMENTS = 8192  # weights per program per step at most (`_analytic`)
INT4_UNROLL = 8  # 4-bit chunks (one group, <= 64 columns, each) per step: 512 columns ...
INT4_ONE_STEP = 12  # ... unless K has at most this many: then all of them, one step
INTERPRETER_BLOCK_N = 256  # rows a program on the CPU interpreter
_NONE, _NORM, _SILU = 0, 1, 2  # the prologue


class Int4Weight(NamedTuple):
    """A 4-bit weight in `minillm.quant.packing`'s layout (see the module)."""
    qweight: torch.Tensor           # uint8 [N, K / 2]
    scales: torch.Tensor            # fp32 [N, K / group_size]
    zeros: torch.Tensor | None      # fp32 like scales; None: symmetric (every zero 8)
    group_size: int


class Rope(NamedTuple):
    """RoPE on the q and k heads of q|k|v's product, and the K/V store: what
    `glue.rope_kv(y.view(M, H, D), num_q, num_kv, cos, sin, kv)` does after it."""
    num_q: int
    num_kv: int
    head_dim: int
    cos: torch.Tensor               # [M, head_dim] rows at each token's position, fp32 or
    sin: torch.Tensor               # x's dtype (both alike)
    kv: tuple | None = None         # (k_cache, v_cache [num_slots, num_kv, D], slot_mapping [M])


def int4_weight(qweight, scales, zeros, group_size: int) -> Int4Weight | None:
    """The Int4Weight of a packed 4-bit weight, or None for a layout the kernel does not read
    (a group size with no power-of-two divisor >= 16, rows that are not whole int32 words)."""
    if _block_k(group_size) is None or _as_words(qweight) is None:
        return None
    return Int4Weight(qweight, scales, zeros, group_size)


# ----------------------------------------------------------------------------- tiles


def _int4_unroll(k: int, block_k: int) -> int:
    """4-bit chunks per step: all of K in one step when it is short (SmolLM2's 576 at g64: 9
    chunks, 91 registers a thread in the sm_90 SASS, no spill), else INT4_UNROLL (1536: 3
    steps of 8), so that no step is mostly chunks past K."""
    chunks = cdiv(k, block_k)
    return chunks if chunks <= INT4_ONE_STEP else INT4_UNROLL


def _dense_block_k(k: int) -> int:
    """A float weight's columns per step: all of K up to 1024 (SmolLM2's 576 in one step, so
    every load of the program is in flight at once), else 1024 a step."""
    return min(MAX_DENSE_BLOCK_K, max(16, next_power_of_2(k)))


def _config(block_n: int, warps: int, unroll: int, split: int = 1) -> triton.Config:
    """A tile config; SPLIT only where it is not 1 (the pinned files predate it: a config
    without it launches SPLIT 1, `_constexprs`)."""
    kwargs = {"BLOCK_N": block_n, "UNROLL": unroll} | ({"SPLIT": split} if split > 1 else {})
    return triton.Config(kwargs, num_warps=warps, num_stages=1)


# The candidates, (BLOCK_N, warps, UNROLL, SPLIT). A 4-bit weight's chunk is BLOCK_N x
# BLOCK_K / 8 words, SPLIT chunks side by side; a tile with fewer words than threads
# converts layouts through shared memory every chunk (the sm_90 PTX: 34-66 barriers; the
# H200, 2026-11-28: 2 or 4 rows on 2-4 warps took 14-16 µs at SmolLM2's down against 8-9
# on one warp), so every candidate runs on one warp or gives each thread a whole word: SPLIT
# 1 with 2 or 4 rows on one warp or 8 on two (4 or 8 chunks a step, or one step of SmolLM2's
# widths at BLOCK_K 64: 576 is 9 chunks, 1536 is 24), and SPLIT 2-8 to spread a few rows' K
# over up to 4 warps, a word or two a thread (1 or 3 steps of SPLIT chunks a loop). A float
# weight (UNROLL 1: it steps by `_dense_block_k`): 2-8 rows on 4 or 8 warps. (8 rows on one
# warp and 16 float rows were never the fastest of any SmolLM2 product on the H200.)
INT4_TILES = (tuple((b, w, u, 1) for b, w in ((2, 1), (4, 1), (8, 2)) for u in (4, 8, 9, 24))
              + tuple((b, w, u, sp) for b, w, sp in ((2, 1, 2), (2, 1, 4), (4, 1, 2),
                                                     (2, 2, 4), (4, 2, 2), (4, 4, 4),
                                                     (2, 4, 8))
                      for u in (1, 3)))
DENSE_TILES = tuple((b, w, 1, 1) for b in (2, 4, 8) for w in (4, 8))
# Each class's representative shape (SmolLM2's and Llama-3-8B's widths), for the rule and
# for compiling the pinned configs ahead of time: N classes (<= 1024, <= 8192, more), K
# classes (<= 1024, more), as the W4A16 GEMV's. Every shape of a class gets its tiles: K =
# 960 in 4 bits takes 576's step of 9 chunks (two steps for its 15), a tiny test model 8
# warps. Correct for any shape (chunks past K are masked); fast where it was measured.
CLASS_N = {0: 960, 1: 3072, 2: 14336}
CLASS_K = {0: 576, 1: 1536}


def _analytic(b: dict) -> triton.Config:
    """The tiles of a shape class by rule, not measured. A float weight: ~1-2 programs per
    SM of a 132-SM GPU for SmolLM2's widths (N 576 -> 4 rows a program, 960 -> 4, 3072 -> 8
    with 1024-wide steps), at most TILE_ELEMENTS weights a step of 16-bit ones (32 a thread
    at 8 warps: registers; half as many fp32 ones: Triton 3.6 spilled fp32 gate|up's 8 x
    1024 tile with the residual add), and warps for ~16 of them a thread. A 4-bit weight: 4
    rows, one warp (more warps put two layout conversions through shared memory in every
    chunk, 32 barriers a step in the sm_90 PTX; one warp needs none), so 4-8 programs per
    SM, and `_int4_unroll`'s chunks a step."""
    n, k = CLASS_N[b["N"]], CLASS_K[b["K"]]
    if b["w"]:
        return _config(4, 1, _int4_unroll(k, b["w"]))
    block_k = _dense_block_k(k)
    block_n = max(4, min(64, next_power_of_2(max(1, n // 128)) // 2,
                         TILE_ELEMENTS * 16 // b["dt"] // block_k))
    return _config(block_n, max(1, min(8, block_n * block_k // 512)), 1)


def _signature(b: dict) -> dict:
    """The pointer types of a launch in class ``b`` (ahead-of-time compiles)."""
    w, s = ("*i32", "*fp32") if b["w"] else ("*{dt}", "*{dt}")
    return dict(X="*{dt}", Delta="*{dt}", NormW="*{dt}", Sum="*{dt}", W=w, Scales=s, Zeros=s,
                Y="*{dt}", eps="fp32", Cos="*fp32", Sin="*fp32", KC="*{dt}", VC="*{dt}",
                Slots="*i64")


def _constexprs(b: dict) -> dict:
    """The constexprs a class implies besides the tiles, at its representative K (RoPE off:
    tests/test_decode_gemv.py compiles q|k|v's epilogue)."""
    k = CLASS_K[b["K"]]
    return dict(PROLOGUE=b["p"], HAS_DELTA=b["p"] == _NORM, INT4=b["w"] > 0,
                HAS_ZEROS=b["w"] > 0, BLOCK_K=b["w"] or _dense_block_k(k), SPLIT=1,
                NORM_BLOCK=_dense_block_k(k) if b["p"] == _NORM else 16, ROPE=False,
                WRITE_KV=False, ROUND_PRODUCT=False)


# Buckets: w, the weight (0: a float one; else 4-bit, its BLOCK_K), p, the prologue (none,
# norm, SiLU·up), the classes of N and K, the dtype width. Not searched by the autotuner:
# see the module docstring.
DECODE_GEMV = tuning.register(tuning.Tunable(
    name="decode_gemv", fn=_decode_gemv_kernel,
    configs=tuple(_config(*t) for t in INT4_TILES + DENSE_TILES),
    default=_config(4, 4, INT4_UNROLL),
    interpreter=_config(INTERPRETER_BLOCK_N, 4, INT4_UNROLL),  # see `_launch_tiles`
    bucket_space={"w": (0, 16, 32, 64), "p": (_NONE, _NORM, _SILU), "N": (0, 1, 2),
                  "K": (0, 1), "dt": (16, 32)},
    signature=_signature,
    constexprs=_constexprs,
    analytic=_analytic,
    unit_strides=("stride_wk",),
    searchable=False,
))


def bucket_for(n: int, k: int, int4: bool, block_k: int, prologue: int,
               dtype: torch.dtype) -> dict:
    """The shape class of a launch (its `DECODE_GEMV` bucket)."""
    return {"w": block_k if int4 else 0, "p": prologue, "N": _n_class(n), "K": _k_class(k),
            "dt": tuning.dtype_bits(dtype)}


_tile_override: dict = {}  # set only inside `tiles`


@contextlib.contextmanager
def tiles(block_n: int | None = None, warps: int | None = None, unroll: int | None = None,
          split: int | None = None):
    """Launch every decode GEMV inside the block with these tiles (None: the pinned ones):
    for timing candidates on a GPU (`gpu_check.py --sections gemv_tiles`), not for models.
    block_n: rows a program, a power of two >= 2 (RoPE pairs); warps: 1, 2, 4 or 8; unroll:
    4-bit steps a loop, >= 1; split: 4-bit chunks side by side a step, a power of two (a
    float weight has neither). A candidate changes which program computes which rows and
    the order of a row's sum (which chunks share an accumulator, its last reduction),
    never what is computed. Not thread-safe."""
    if block_n is not None and (isinstance(block_n, bool) or not isinstance(block_n, int)
                                or block_n < 2 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 2 (whole RoPE pairs), got {block_n!r}")
    if warps is not None and warps not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {warps!r}")
    if unroll is not None and (isinstance(unroll, bool) or not isinstance(unroll, int)
                               or unroll < 1):
        raise ValueError(f"unroll must be an integer >= 1 (4-bit steps a loop), got {unroll!r}")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int)
                              or split < 1 or split & (split - 1)):
        raise ValueError(f"split must be a power of two >= 1 (4-bit chunks side by side), "
                         f"got {split!r}")
    before = dict(_tile_override)
    _tile_override.update({k: v for k, v in (("block_n", block_n), ("warps", warps),
                                             ("unroll", unroll), ("split", split))
                           if v is not None})
    try:
        yield
    finally:
        _tile_override.clear()
        _tile_override.update(before)


PROLOGUES = {"none": _NONE, "norm": _NORM, "silu": _SILU}  # `launch_tiles`'s names


def bucket_of(n: int, k: int, weight, dtype: torch.dtype, prologue: str = "none") -> dict:
    """The shape class of a launch over ``weight`` (a float [N, K] or an Int4Weight) with
    an input of ``dtype`` and width k after ``prologue`` (`PROLOGUES`)."""
    int4 = isinstance(weight, Int4Weight)
    block_k = _block_k(weight.group_size) if int4 else _dense_block_k(k)
    return bucket_for(n, k, int4, block_k, PROLOGUES[prologue], dtype)


def launch_tiles(n: int, k: int, weight, dtype: torch.dtype, prologue: str = "none",
                 arch: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, warps, UNROLL, SPLIT) of a launch over ``weight`` (a float [N, K] or an
    Int4Weight) with an input of ``dtype`` and width k after ``prologue`` (`PROLOGUES`), on
    a GPU of ``arch`` (None: this process's device; on the interpreter, its tiles): the
    tiles measured in this process, else the pinned ones, then `tiles`' overrides."""
    int4 = isinstance(weight, Int4Weight)
    bucket = bucket_of(n, k, weight, dtype, prologue)
    if arch is None:
        cfg = None if interpreter_enabled() else DECODE_GEMV.config_for(bucket)
    else:
        cfg = DECODE_GEMV.config_on(bucket, arch)
    return _launch_tiles(n, k, int4, bucket, cfg)


def _launch_tiles(n: int, k: int, int4: bool, bucket: dict,
                  cfg: triton.Config | None) -> tuple[int, int, int, int]:
    """(BLOCK_N, warps, UNROLL, SPLIT) from cfg (None on the interpreter: it runs one
    program at a time in numpy, so few wide ones, BLOCK_N up to INTERPRETER_BLOCK_N, and
    K's own unroll; the results depend on the tiles only in a sum's order), then `tiles`'
    overrides. A float weight has no UNROLL or SPLIT (1)."""
    if cfg is None:
        block_n, warps, split = min(INTERPRETER_BLOCK_N, max(4, next_power_of_2(n))), 4, 1
        unroll = _int4_unroll(k, bucket["w"]) if int4 else 1
    else:
        block_n, warps, unroll = cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.kwargs["UNROLL"]
        split = cfg.kwargs.get("SPLIT", 1)
    o = _tile_override
    if not int4:
        return o.get("block_n", block_n), o.get("warps", warps), 1, 1
    return (o.get("block_n", block_n), o.get("warps", warps), o.get("unroll", unroll),
            o.get("split", split))


# ----------------------------------------------------------------------------- host side


def _rows(x: torch.Tensor, name: str, width: int) -> torch.Tensor:
    """x [..., width] as [M, width] with a contiguous last dimension (no copy)."""
    if x.dim() < 1 or x.shape[-1] != width:
        raise ValueError(f"{name} must be [..., {width}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides "
                         f"{x.stride()}: pass {name}.contiguous()")
    return x.reshape(-1, width)


def _weight_args(weight, x: torch.Tensor):
    """(N, group size, kernel arguments, INT4, HAS_ZEROS, BLOCK_K) after checking the weight
    against x [M, K] (the GEMV's input: for silu_mul_linear, the gate half)."""
    if isinstance(weight, Int4Weight):
        n, _, _ = _check_args(x, weight.qweight, weight.scales, weight.zeros, weight.group_size)
        words, block_k = _as_words(weight.qweight), _block_k(weight.group_size)
        if words is None or block_k is None:
            raise ValueError(f"this 4-bit layout (group size {weight.group_size}, qweight "
                             f"strides {weight.qweight.stride()}) is not one the decode GEMV "
                             "reads: the group size needs a power-of-two divisor >= 16 and "
                             "qweight whole int32 words a row; use QuantLinear's own path")
        qw32, z = words[0], weight.scales if weight.zeros is None else weight.zeros
        for name, t in (("scales", weight.scales), ("zeros", z)):
            if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:  # only rows are strided
                raise ValueError(f"{name} must have contiguous groups (stride 1 along its "
                                 f"last dimension), got strides {t.stride()}: pass "
                                 f"{name}.contiguous()")
        return (n, weight.group_size, (qw32, weight.scales, z, qw32.stride(0), 1,
                                       weight.scales.stride(0), z.stride(0)),
                True, weight.zeros is not None, block_k)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-d float tensor [N, K] or an Int4Weight, got "
                         f"{type(weight).__name__} {tuple(getattr(weight, 'shape', ()))}")
    _check_device_dtype({"x": x, "weight": weight})
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"the GEMV's input has K = {x.shape[-1]} columns but weight is "
                         f"[N, K] = {tuple(weight.shape)}")
    return (weight.shape[0], 1, (weight, weight, weight, weight.stride(0), weight.stride(1),
                                 0, 0), False, False, _dense_block_k(weight.shape[1]))


def _rope_args(rope: Rope | None, m: int, n: int, y: torch.Tensor) -> tuple[tuple, dict]:
    """The epilogue's kernel arguments (`glue.rope_args`) after checking rope against the
    product's output y [M, N]; placeholders without rope."""
    if rope is None:
        return (y,) * 5 + (0, 0, 1) + (0,) * 6, dict(ROPE=False, WRITE_KV=False,
                                                      ROUND_PRODUCT=False)
    heads = rope.num_q + 2 * rope.num_kv
    if heads * rope.head_dim != n:
        raise ValueError(f"RoPE's heads need N = (num_q + 2 num_kv) * head_dim = ({rope.num_q} "
                         f"+ 2 * {rope.num_kv}) * {rope.head_dim} = {heads * rope.head_dim} "
                         f"output columns, but the weight has N = {n}")
    args, consts = rope_args(m, rope.num_q, rope.num_kv, rope.head_dim, y, rope.cos, rope.sin,
                             rope.kv)
    return args, dict(ROPE=True, **consts)


def _launch(x2, delta2, norm_weight, eps, weight, prologue, k, rope=None):
    """y [M, N] (and s, x2 + delta2, when delta2 is given) for x2's rows: one kernel. k: the
    GEMV's input width (x2's, or half of it for SiLU·up); rope: the epilogue, or None."""
    n, group_size, (w, scales, zeros, swn, swk, ssn, szn), int4, has_zeros, block_k = \
        _weight_args(weight, x2[:, :k])
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    s = torch.empty_like(x2) if delta2 is not None else x2
    epilogue, epilogue_consts = _rope_args(rope, m, n, y)
    if m == 0 or n == 0:
        return s, y
    d = delta2 if delta2 is not None else x2
    nw = norm_weight if norm_weight is not None else x2
    bucket = bucket_for(n, k, int4, block_k, prologue, x2.dtype)

    def launch(cfg: triton.Config | None) -> None:
        block_n, warps, unroll, split = _launch_tiles(n, k, int4, bucket, cfg)
        _decode_gemv_kernel[(cdiv(n, block_n), m)](
            x2, d, nw, s, w, scales, zeros, y, n, k, float(eps), group_size,
            x2.stride(0), d.stride(0), s.stride(0), swn, swk, ssn, szn, y.stride(0), *epilogue,
            PROLOGUE=prologue, HAS_DELTA=delta2 is not None, INT4=int4, HAS_ZEROS=has_zeros,
            BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, SPLIT=split,
            NORM_BLOCK=_dense_block_k(k) if prologue == _NORM else 16, **epilogue_consts,
            num_warps=warps)

    if interpreter_enabled():
        launch(None)
    elif _tile_override:  # a candidate's tiles over the pinned ones, not through `run`:
        launch(DECODE_GEMV.config_for(bucket, x2.device))  # one that does not fit must not
        # become the class's fallback config
    else:  # the pinned (or measured) tiles: one dict lookup once the class has run
        DECODE_GEMV.run(bucket, launch, x2.device)
    return s, y


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """x [..., K] Wᵀ -> [..., N] (W float [N, K] of x's dtype, or an Int4Weight)."""
    k = x.shape[-1] if x.dim() else 0
    x2 = _rows(x, "x", k)
    _, y = _launch(x2, None, None, 0.0, weight, _NONE, k)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight, rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s) Wᵀ) with s = x + delta (delta None: s = x), in one kernel. x, delta
    [..., K] of one dtype; norm_weight [K] of that dtype. With rope (W: q|k|v's weight), the
    product's q and k heads come out rotated and, with rope.kv, k and v are stored in the
    caches: the bits of this product then `glue.rope_kv` on its [M, H, D] view."""
    k = x.shape[-1] if x.dim() else 0
    x2 = _rows(x, "x", k)
    delta2 = None
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
            raise ValueError(f"delta must match x: {tuple(x.shape)} {x.dtype} on {x.device}, "
                             f"got {tuple(delta.shape)} {delta.dtype} on {delta.device}")
        delta2 = _rows(delta, "delta", k)
    if (not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (k,)
            or norm_weight.dtype != x.dtype or norm_weight.device != x.device
            or norm_weight.stride(0) != 1):
        raise ValueError(f"norm_weight must be a contiguous [{k}] {x.dtype} tensor on {x.device} "
                         f"like x, got {getattr(norm_weight, 'shape', norm_weight)!r}")
    s, y = _launch(x2, delta2, norm_weight, eps, weight, _NORM, k, rope)
    lead = x.shape[:-1]
    return s.reshape(*lead, k), y.reshape(*lead, y.shape[-1])


def silu_mul_linear(gate_up: torch.Tensor, weight) -> torch.Tensor:
    """(silu(gate) * up) Wᵀ for gate_up [..., 2I] = [gate | up]; W reads K = I columns."""
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate | up), got {width}")
    x2 = _rows(gate_up, "gate_up", width)
    _, y = _launch(x2, None, None, 0.0, weight, _SILU, width // 2)
    return y.reshape(*gate_up.shape[:-1], y.shape[-1])
