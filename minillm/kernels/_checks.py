"""Argument checks shared by the Triton kernel wrappers (``flash_attention``,
``flash_attention_varlen``, ``paged_decode_attention``; ``w4a16_linear`` and
``w8a16_linear``: `check_packed_linear`).

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


def check_packed_linear(x, qweight, scales, zeros, group_size, storage_bits: int,
                        zeros_optional: bool) -> tuple[int, int, int]:
    """(N, K, G) of ``x @ Ŵᵀ`` with Ŵ stored in `storage_bits` (4: two values a byte, 8: one;
    ``minillm.quant.packing``), after checking every argument (shapes, dtypes, devices:
    never a value). zeros_optional: None means a symmetric weight (4 bits); otherwise
    zeros are required (8-bit weights store theirs, symmetric ones too)."""
    if storage_bits not in (4, 8):
        raise ValueError(f"storage_bits must be 4 or 8, got {storage_bits!r}")
    per_byte = 8 // storage_bits
    named = (("x", x), ("qweight", qweight), ("scales", scales)) + (
        (("zeros", zeros),) if zeros is not None or not zeros_optional else ())
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            hint = (f" ({storage_bits}-bit weights store their zero points, symmetric ones too: "
                    "2^(bits - 1))" if name == "zeros" else "")
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}{hint}")
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [..., K], got a {x.dim()}-d {x.dtype} tensor")
    _check_device_dtype({"x": x})  # device kind and activation dtype (bf16: not on the interpreter)
    for name, t in named[1:]:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; "
                             "move the weight and activations to one device")
    cols, values = ("[N, K]", "one 8-bit value") if per_byte == 1 else (
        "[N, K / 2]", "two 4-bit values")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-d torch.uint8 tensor {cols} ({values} per byte, "
                         f"see minillm.quant.packing); got a {qweight.dim()}-d {qweight.dtype} "
                         "tensor")
    n, k = qweight.shape[0], x.shape[-1]
    if per_byte == 2 and (k < 2 or k % 2):
        raise ValueError(f"K = x.shape[-1] = {k} must be even and >= 2: 4-bit packing stores two "
                         "columns per byte")
    if qweight.shape[1] * per_byte != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} holds {qweight.shape[1] * per_byte} "
                         f"columns but x has K = {k} (x.shape[-1]); qweight must be {cols} = "
                         f"[{n}, {k // per_byte}]")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}; groups must tile each "
                         "row exactly (per-channel quantization: group_size = K)")
    groups = k // group_size
    for name, t in named[2:]:
        if t.dtype != torch.float32 or tuple(t.shape) != (n, groups):
            raise ValueError(f"{name} must be torch.float32 [N, K / group_size] = [{n}, {groups}], "
                             f"got {t.dtype} {tuple(t.shape)} (note: module.half() or "
                             ".to(dtype) also converts these buffers; keep them in fp32)")
    return n, k, groups


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
