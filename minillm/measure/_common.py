"""Argument checks and small conversions shared by the ``minillm.measure`` modules."""

from __future__ import annotations

import torch

from ..devices import default_dtype, resolve_device


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return value


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32; got {dtype!r}.")
    return dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device(device) -> torch.device:
    """``device`` (None: the process's device, ``minillm.devices.default_device()``)."""
    return resolve_device(device)


def _device_dtype(device, dtype) -> tuple[torch.device, torch.dtype]:
    """The device (None: the default) and the dtype (None: that device's default dtype,
    ``minillm.devices.default_dtype``: bf16 on CUDA, fp32 on a CPU)."""
    dev = resolve_device(device)
    return dev, default_dtype(dev) if dtype is None else _dtype(dtype)
