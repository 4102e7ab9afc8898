"""Argument checks shared by the Triton kernel wrappers (``flash_attention``,
``flash_attention_varlen``, ``paged_decode_attention``).

Invariants they enforce: all float inputs on one device of the kind the kernels run on
(CUDA when compiled, CPU in the interpreter) and of one supported dtype; ``Hq % Hkv == 0``;
head_dim in 1..256; an ``out`` buffer exactly like q. Index arguments (block tables,
lengths, cumulative lengths) may have any integer dtype: the wrappers convert them to the
int32 the kernels read. Every error says what was wrong and what is allowed.
"""

from __future__ import annotations

import torch

from .interpreter import interpreter_enabled, require_working_setup

_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CPU_DTYPES = (torch.float16, torch.float32)


def _check_device_dtype(name_to_tensor: dict[str, torch.Tensor]) -> None:
    """All tensors on one device of the right kind and of one supported dtype."""
    require_working_setup()
    tensors = list(name_to_tensor.items())
    first_name, first = tensors[0]
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "move all inputs to one device")
        if t.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; "
                             "all of them must have the same dtype")
    if interpreter_enabled():
        if first.device.type != "cpu":
            raise ValueError(f"Triton is running in its CPU interpreter, but the inputs are on "
                             f"{first.device}; pass CPU tensors (or unset TRITON_INTERPRET on a GPU machine)")
        allowed = _CPU_DTYPES
        if first.dtype == torch.bfloat16:
            raise ValueError("the Triton CPU interpreter cannot compute in torch.bfloat16; "
                             "use torch.float32 (or float16) on CPU")
    else:
        if first.device.type != "cuda":
            raise ValueError(f"compiled Triton kernels need CUDA tensors, got {first.device}; "
                             "move the inputs with .cuda() (or run on CPU with TRITON_INTERPRET=1)")
        allowed = _GPU_DTYPES
    if first.dtype not in allowed:
        raise ValueError(f"dtype {first.dtype} is not supported here; allowed: "
                         + ", ".join(str(d) for d in allowed))


def _check_heads(hq: int, hkv: int, d: int) -> None:
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} query heads must be a multiple of Hkv={hkv} KV heads "
                         "(grouped-query attention maps query head h to KV head h // (Hq // Hkv))")
    if not 1 <= d <= 256:
        raise ValueError(f"head_dim={d} is not supported; allowed 1..256")


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The caller's output buffer (must match q exactly), or a fresh one."""
    if out is None:
        return torch.empty_like(q)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype \
            or out.device != q.device:
        raise ValueError(f"out must be a tensor like q: shape {tuple(q.shape)}, dtype {q.dtype}, "
                         f"device {q.device}; got {getattr(out, 'shape', out)!r}, "
                         f"{getattr(out, 'dtype', None)}, {getattr(out, 'device', None)}")
    return out


def _is_integer(t: torch.Tensor) -> bool:
    """True for every integer dtype (int8 ... int64, uint8): what an index argument may be.
    Float, complex and bool tensors are refused."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
