"""The glue between a layer's weight products, fused on the CPU: one pass per group of ops.

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

`applies(x)` says when the C++ runs: fp32 on the CPU, contiguous, no autograd, the kernel
built, and not inside `torch.compile` (Inductor fuses the plain expressions itself, and
they keep the graph free of opaque calls). Anywhere else the reference runs.
`benchmarks/glue.py` times eager ops, the C++ and `torch.compile` at 1 to 512 rows.
"""
from __future__ import annotations

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


def applies(x: torch.Tensor) -> bool:
    """Would the model's glue on `x` run the C++? (Builds the kernel on first call.)"""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and not torch.compiler.is_compiling() and load_kernel() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if applies(x) and weight.is_contiguous() and not weight.requires_grad:
        return load_kernel().rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalize in fp32 whatever the model dtype: the mean of squares overflows fp16.
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the norm that reads its sum."""
    if (applies(x) and delta.dtype == x.dtype and delta.shape == x.shape
            and delta.is_contiguous() and not delta.requires_grad
            and weight.is_contiguous() and not weight.requires_grad):
        s, h = load_kernel().add_rms_norm(x, delta, weight, eps)
        return s, h
    s = x + delta
    return s, rms_norm_ref(s, weight, eps)


def rope_(heads: torch.Tensor, num_rotated: int, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor | None:
    """RoPE in place on heads [B, T, H, D] (the first `num_rotated` heads), cos/sin [B, T, D]
    from `model.rope_cos_sin`. Returns `heads`, or None where the C++ does not apply (the
    caller then runs `model.apply_rope`, which makes a new tensor)."""
    D = heads.shape[-1]
    if not (applies(heads) and D % 16 == 0 and cos.is_contiguous() and sin.is_contiguous()
            and cos.dtype == sin.dtype == torch.float32):
        return None
    rows = heads.shape[0] * heads.shape[1]
    load_kernel().rope_(heads.view(rows, heads.shape[2], D), num_rotated,
                        cos.reshape(rows, D), sin.reshape(rows, D))
    return heads


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., gate | up] -> [..., I]."""
    if applies(gate_up) and gate_up.shape[-1] % 16 == 0:
        return load_kernel().silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
