"""The glue between a layer's weight products, fused: one pass per group of ops (C++ on the
CPU, Triton on CUDA).

Between its four weight products a Llama layer runs elementwise work: RMSNorm, RoPE on the
q and k heads, SiLU(gate)·up, the residual adds. Eager PyTorch runs these as ~15 separate
ops per layer (`F.rms_norm` alone is five on the CPU: pow, mean, add, rsqrt, mul), and each
costs a dispatch of a few µs, a fresh output and one more trip of the activations through
memory. At one row (batch-1 decode) the dispatches dominate; at the serving engine's 64 to
512 rows per step, the trips do. `csrc/fused_glue_cpu.cpp` does each group in one pass:

    rms_norm(x, w, eps)              the norm at a layer's input and the final norm
    add_rms_norm(x, delta, w, eps)   the residual add and the next norm: (x + delta, norm)
    rope_(heads, n, cos, sin)        RoPE in place on the first n heads of q|k|v's output
    silu_mul(gate_up)                SwiGLU's silu(gate) * up

The plain PyTorch expressions beside each are the reference; `tests/test_fused_ops.py`
compares them (fp32 rounding: the C++ sums in another order and has its own exp), and
checks that a row's result does not depend on the other rows (batch invariance: the
engine's greedy tokens equal `generate`'s).

`applies(x)` says when the C++ runs: fp32 or bf16 on the CPU, contiguous, no autograd, the
kernel built, and not inside `torch.compile` (Inductor fuses the plain expressions itself,
and they keep the graph free of opaque calls). In bf16 the C++ computes in fp32 and rounds
to bf16 wherever the reference stores a bf16 tensor, so it matches the reference to fp32
rounding; without it a bf16 model's eager decode step ran ~25 plain ops of glue a layer
where fp32 makes 5 calls. `triton_applies(x)` says when the Triton kernels
of `minillm.kernels.glue` run: CUDA tensors in fp32, fp16 or bf16, no autograd, not inside
`torch.compile` (tests set `TRITON_ON_CPU` to run them on CPU tensors in Triton's
interpreter). On CUDA they cut a decode layer from ~22 kernels to ~10, which is what a
CUDA-graph decode step pays for (see that module). Anywhere else the reference runs.
`benchmarks/glue.py` times eager ops, the C++ and `torch.compile` at 1 to 512 rows.

Where the Triton glue runs, a few rows (a decode step) go one step further: the glue that
only feeds a weight product runs inside that product's kernel (`norm_linear`,
`silu_mul_linear`; `minillm.kernels.decode_gemv`), for a plain `Linear` or a 4-bit
`QuantLinear` (their `gemv_weight`), and RoPE with the K/V store, which only finishes
q|k|v's output, runs at the end of that product's kernel (`norm_linear_rope`). A decode
layer on CUDA is then five kernels, not nine. o_proj, with no glue before it, goes through
the same GEMV (`linear`): at a few rows it is faster than cuBLAS or the W4A16 kernel.

RoPE can also store the layer's new K/V: an attention context that owns a cache hands the
layer a `KVWrite` (`ctx.kv_write(layer)`: the cache viewed as rows [num_slots, Hkv, D] and
each token's row, its slot); `rope_(..., kv_write)` then rotates q|k and stores k and v in
the same pass (or q|k|v's decode GEMV does, `norm_linear_rope`), and the context's
`attend` skips its own write. Where no kernel applies, `KVWrite.store` is the plain write
(`index_copy_`). The CPU's contexts hand out no
`KVWrite` (`stores_kv` is False there), so the CPU path is the one it always was.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import cpp_extension

SOURCE = Path(__file__).with_name("csrc") / "fused_glue_cpu.cpp"


@cpp_extension.register("fused glue")
def load_kernel():
    """The compiled extension, or None if switched off or not buildable here (warns once)."""
    return cpp_extension.load("minillm_fused_glue_cpu", SOURCE,
                              "the model runs its glue as separate PyTorch ops")


CPU_DTYPES = (torch.float32, torch.bfloat16)


def applies(x: torch.Tensor) -> bool:
    """Would the model's glue on `x` run the C++? (Builds the kernel on first call.)"""
    return _cpu_kernel(x) is not None


def _cpu_kernel(x: torch.Tensor):
    """The C++ glue extension where it applies to `x`, else None: one call per glue op (a
    decode step makes ~120), so `load_kernel`'s setting is read once each, not twice."""
    if not (x.is_cpu and x.dtype in CPU_DTYPES and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and not torch.compiler.is_compiling()):
        return None
    return load_kernel()


# MINILLM_TRITON_GLUE=0 switches the Triton glue off on CUDA (the plain ops then run: an A/B
# measurement, `benchmarks/gpu_step_profile.py`). Tests set TRITON_ON_CPU to run the kernels
# on CPU tensors (Triton's interpreter, fp32 / fp16).
TRITON_GLUE = os.environ.get("MINILLM_TRITON_GLUE", "1") != "0"
TRITON_ON_CPU = False
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_applies(*tensors: torch.Tensor) -> bool:
    """Would the glue on these tensors run the Triton kernels? (CUDA, eager, no autograd.)"""
    x = tensors[0]
    on_device = x.is_cuda or (TRITON_ON_CPU and x.dtype != torch.bfloat16)  # interpreter: no bf16
    return (on_device and TRITON_GLUE and not torch.compiler.is_compiling()
            and all(t.dtype == x.dtype and t.device == x.device for t in tensors)
            and x.dtype in _TRITON_DTYPES
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _glue():
    from ..kernels import glue  # imports triton: only once a Triton path is taken
    return glue


@dataclass(frozen=True)
class KVWrite:
    """Where a layer's new K/V go: token i's k and v into row slot_mapping[i] of k_cache and
    v_cache, both viewed as [num_slots, Hkv, D]. An attention context makes one
    (`ctx.kv_write(layer)`) when the Triton glue will store K/V (`stores_kv`)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [N] long

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The plain write of k, v [..., Hkv, D] (N tokens): what `rope_` does in its pass."""
        hkv, dim = self.k_cache.shape[1:]
        for cache, new in ((self.k_cache, k), (self.v_cache, v)):
            cache.index_copy_(0, self.slot_mapping, new.reshape(-1, hkv, dim).to(cache.dtype))


def stores_kv(cache: torch.Tensor) -> bool:
    """Should an attention context over `cache` hand the layers a `KVWrite`? Where the Triton
    glue runs (RoPE and the K/V store become one kernel); elsewhere its own write stays."""
    return triton_applies(cache)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if triton_applies(x, weight) and x.stride(-1) == 1 and weight.is_contiguous():
        return _glue().rms_norm(x, weight, eps)
    if ((kernel := _cpu_kernel(x)) is not None and weight.dtype == x.dtype
            and weight.is_contiguous() and not weight.requires_grad):
        return kernel.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalize in fp32 whatever the model dtype: the mean of squares overflows fp16.
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the norm that reads its sum."""
    if (triton_applies(x, delta, weight) and delta.shape == x.shape and x.stride(-1) == 1
            and delta.stride(-1) == 1 and weight.is_contiguous()):
        return _glue().add_rms_norm(x, delta, weight, eps)
    if ((kernel := _cpu_kernel(x)) is not None and delta.dtype == x.dtype
            and delta.shape == x.shape and delta.is_contiguous() and not delta.requires_grad
            and weight.dtype == x.dtype and weight.is_contiguous() and not weight.requires_grad):
        s, h = kernel.add_rms_norm(x, delta, weight, eps)
        return s, h
    s = x + delta
    return s, rms_norm_ref(s, weight, eps)


def rope_(heads: torch.Tensor, num_rotated: int, cos: torch.Tensor, sin: torch.Tensor,
          kv_write: KVWrite | None = None) -> torch.Tensor | None:
    """RoPE in place on heads [B, T, H, D] (the first `num_rotated` heads), cos/sin [B, T, D]
    from `model.rope_cos_sin`. With kv_write, heads is q|k|v (k and v of H - num_rotated
    heads each) and the rotated k and v are stored too. Returns `heads`, or None where no
    kernel applies (the caller then runs `model.apply_rope`, which makes a new tensor, and
    `kv_write.store`)."""
    B, T, H, D = heads.shape
    num_kv = H - num_rotated
    if (triton_applies(heads) and heads.is_contiguous() and D % 2 == 0 and num_kv <= num_rotated
            and cos.dtype == sin.dtype and cos.dtype in (torch.float32, heads.dtype)
            and cos.device == heads.device):
        kv = None if kv_write is None else (kv_write.k_cache, kv_write.v_cache,
                                            kv_write.slot_mapping)
        _glue().rope_kv(heads.view(B * T, H, D), num_rotated - num_kv, num_kv,
                        cos.reshape(B * T, D), sin.reshape(B * T, D), kv)
        return heads
    if not ((kernel := _cpu_kernel(heads)) is not None and D % 16 == 0
            and cos.is_contiguous() and sin.is_contiguous()
            and cos.dtype == sin.dtype == torch.float32):
        return None
    rows = heads.shape[0] * heads.shape[1]
    kernel.rope_(heads.view(rows, heads.shape[2], D), num_rotated, cos.reshape(rows, D),
                 sin.reshape(rows, D))
    if kv_write is not None:
        kv_write.store(heads[:, :, num_rotated - num_kv:num_rotated], heads[:, :, num_rotated:])
    return heads


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., gate | up] -> [..., I]."""
    if triton_applies(gate_up) and gate_up.stride(-1) == 1 and gate_up.shape[-1] % 2 == 0:
        return _glue().silu_mul(gate_up)
    if (kernel := _cpu_kernel(gate_up)) is not None and gate_up.shape[-1] % 16 == 0:
        return kernel.silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------- the glue inside the GEMV

# MINILLM_FUSED_GEMV=0 keeps the decode GEMV out (the GPU check's A/B): the glue kernels
# above and the weight products as separate kernels. MINILLM_FUSED_ROPE=0 keeps RoPE and the
# K/V store out of q|k|v's GEMV only (`rope_kv` after it, as its own kernel).
FUSED_GEMV = os.environ.get("MINILLM_FUSED_GEMV", "1") != "0"
FUSED_ROPE = os.environ.get("MINILLM_FUSED_ROPE", "1") != "0"


def _decode_gemv():
    from ..kernels import decode_gemv  # imports triton: only once a Triton path is taken
    return decode_gemv


def gemv_weight(linear, x: torch.Tensor, *others: torch.Tensor):
    """What the decode GEMV (`minillm.kernels.decode_gemv`) reads for `linear` applied to
    x's rows (`others`: the glue's other inputs), or None where it must not replace
    `linear(x)`: no Triton glue here, more rows than a GEMV serves (a prefill), a module
    whose own forward must run (a subclass, a hook that would miss its call), a weight of
    another dtype or device, or one being trained (the kernel has no backward)."""
    if not (FUSED_GEMV and triton_applies(x, *others) and x.stride(-1) == 1):
        return None
    if x.numel() > _decode_gemv().MAX_ROWS * x.shape[-1]:
        return None
    if (linear._forward_hooks or linear._forward_pre_hooks
            or torch.nn.modules.module._global_forward_hooks
            or torch.nn.modules.module._global_forward_pre_hooks):
        return None
    own = vars(linear).get("forward")  # a forward set on the instance must run, unless it
    if own is not None and not getattr(own, "labels_only", False):  # only labels (a profile)
        return None
    get = getattr(linear, "gemv_weight", None)
    w = get() if get is not None else None
    if isinstance(w, torch.Tensor) and (w.dtype != x.dtype or w.device != x.device
                                        or (torch.is_grad_enabled() and w.requires_grad)):
        return None
    return w


def _norm_gemv_weight(linear, x, delta, norm_weight):
    """`gemv_weight` for the product after a norm (and the add of delta), or None where the
    norm's inputs do not fit the kernel."""
    w = gemv_weight(linear, x, norm_weight, *([] if delta is None else [delta]))
    if (w is not None and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and (delta is None or (delta.shape == x.shape and delta.dtype == x.dtype
                                   and delta.stride(-1) == 1))):
        return w
    return None


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, linear(rms_norm(s))) with s = x + delta (x when delta is None): a layer's norm
    and the weight product that reads it. One kernel where the decode GEMV applies; the
    norm's glue and `linear` otherwise."""
    w = _norm_gemv_weight(linear, x, delta, norm_weight)
    if w is not None:
        out = _gemv_or_none(lambda: _decode_gemv().norm_linear(x, delta, norm_weight, eps, w))
        if out is not None:
            return out
    if delta is None:
        return x, linear(rms_norm(x, norm_weight, eps))
    x, h = add_rms_norm(x, delta, norm_weight, eps)
    return x, linear(h)


def norm_linear_rope(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float, linear, num_q: int, num_kv: int, cos: torch.Tensor,
                     sin: torch.Tensor, kv_write: KVWrite | None
                     ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`norm_linear` for q|k|v's product [..., (num_q + 2 num_kv) * D], and where the decode
    GEMV applies, RoPE (cos/sin [..., D]: `rope_`'s) and the K/V store in its epilogue: (s,
    qkv, True) with q and k rotated in qkv and, with kv_write, k and v in the cache; one
    kernel. Elsewhere (s, qkv, False): the caller rotates (`rope_`) and stores K/V."""
    w = _norm_gemv_weight(linear, x, delta, norm_weight) if FUSED_ROPE else None
    heads, n = num_q + 2 * num_kv, getattr(linear, "out_features", 0)
    dim = n // heads if heads > 0 and n % heads == 0 else 0
    if (w is not None and dim and dim % 2 == 0 and cos.shape == (*x.shape[:-1], dim)
            and sin.shape == cos.shape and sin.dtype == cos.dtype
            and cos.dtype in (torch.float32, x.dtype) and cos.device == x.device
            and cos.stride(-1) == 1 and sin.stride(-1) == 1):
        kv = None if kv_write is None else (kv_write.k_cache, kv_write.v_cache,
                                            kv_write.slot_mapping)
        rope = _decode_gemv().Rope(num_q, num_kv, dim, cos.reshape(-1, dim),
                                   sin.reshape(-1, dim), kv)
        out = _gemv_or_none(lambda: _decode_gemv().norm_linear(x, delta, norm_weight, eps, w,
                                                               rope=rope), "FUSED_ROPE")
        if out is not None:
            return (*out, True)
    return (*norm_linear(x, delta, norm_weight, eps, linear), False)


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    """layer(x) for a product with no glue before it (o_proj): the decode GEMV where it
    applies, since at a few rows it is the faster kernel (o_proj at batch 1 on an H100,
    2026-11-27: 3.02 µs against cuBLAS's 3.93 in bf16; in 4 bits at K = 576 the GEMV beat
    the W4A16 kernel by 1.33x), and layer's own forward elsewhere."""
    w = gemv_weight(layer, x)
    if w is not None:
        out = _gemv_or_none(lambda: _decode_gemv().linear(x, w))
        if out is not None:
            return out
    return layer(x)


def silu_mul_linear(gate_up: torch.Tensor, linear) -> torch.Tensor:
    """linear(silu(gate) * up): SwiGLU's glue and the down projection, one kernel where the
    decode GEMV applies."""
    w = gemv_weight(linear, gate_up)
    if w is not None and gate_up.shape[-1] % 2 == 0:
        out = _gemv_or_none(lambda: _decode_gemv().silu_mul_linear(gate_up, w))
        if out is not None:
            return out
    return linear(silu_mul(gate_up))


# A profiler range opened around each decode GEMV call, or None (no range, no cost). The
# GEMV runs no Linear's forward, so a profile that labels the weight products by wrapping
# their modules (Lab 01's, `measure.step_profile.hook_linears`) sets this to its label.
PRODUCT_RANGE: str | None = None

# What each switch turns off, and what runs instead (`_gemv_or_none`'s warning).
_FALLBACKS = {
    "FUSED_GEMV": ("the decode GEMV", "the glue and the weight products run as separate "
                   "kernels"),
    "FUSED_ROPE": ("the decode GEMV's RoPE epilogue", "RoPE and the K/V store run as their own "
                   "kernel after q|k|v's product"),
}


def _gemv_or_none(call, switch: str = "FUSED_GEMV"):
    """call()'s result, or None once the decode GEMV has failed here: `switch` (FUSED_GEMV,
    or FUSED_ROPE for q|k|v's RoPE epilogue alone) is turned off for the process, with one
    warning naming the error, and the caller runs the unfused path. A kernel that does not
    compile on some Triton or GPU (it is checked on sm_90 ahead of time, not on every stack)
    must cost a decode step its fusion, not its result. Inside a CUDA-graph capture the
    error propagates: a failed launch there has already spoiled the capture (the graphs
    warm up eagerly first, so the first call of each kernel, and its compile, happen before
    any capture)."""
    try:
        if PRODUCT_RANGE is None:
            return call()
        with torch.profiler.record_function(PRODUCT_RANGE):
            return call()
    except Exception as e:  # noqa: BLE001  (any failure: fall back, said once, below)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        globals()[switch] = False
        what, instead = _FALLBACKS[switch]
        warnings.warn(f"{what} failed ({type(e).__name__}: {str(e)[:300]}); it is switched off "
                      f"for this process (MINILLM_{switch}=0 does this from the start): "
                      f"{instead}", RuntimeWarning, stacklevel=3)
        return None
