"""Units, dtype sizes and the argument checks every ``minillm.calc`` module shares.

Each check returns the value converted (``int`` or ``float``) or raises ``ValueError`` whose
message names the argument, shows the value given and says what is allowed.
"""

from __future__ import annotations

import math
import numbers

KB = 1e3
MB = 1e6
GB = 1e9
TB = 1e12
GiB = 2**30

#: Bytes per element of the formats the course meets.
DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}


# --------------------------------------------------------------------------- validation


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int(name: str, value, minimum: int = 1) -> int:
    """Return ``value`` as an int, or raise if it is not an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}; got {_describe(value)}.")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def _real(name: str, value, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float, or raise if it is not a finite number > 0 (>= 0)."""
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number {bound}; got {_describe(value)}.")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}.")
    return value


def _probability(name: str, value, *, allow_zero: bool = True) -> float:
    low = "0 <=" if allow_zero else "0 <"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a probability ({low} {name} <= 1); got {_describe(value)}.")
    value = float(value)
    if not (0 <= value <= 1) or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a probability ({low} {name} <= 1); got {value!r}.")
    return value


def _items(name: str, values, what: str) -> list:
    """The elements of a non-empty list, tuple or array (not a string)."""
    try:
        items = [] if isinstance(values, (str, bytes)) else list(values)
    except TypeError:
        items = []
    if not items:
        raise ValueError(f"{name} must be a non-empty list of {what}; got {_describe(values)}.")
    return items


def _lengths(name: str, values) -> list[int]:
    items = _items(name, values, "integers >= 1 (one per request)")
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(items)]


def _heads(num_heads, num_kv_heads) -> tuple[int, int]:
    h = _int("num_heads", num_heads)
    hkv = _int("num_kv_heads", num_kv_heads)
    if hkv > h or h % hkv:
        raise ValueError(
            f"num_kv_heads must divide num_heads (each KV head serves a whole group of query "
            f"heads); got num_heads={h}, num_kv_heads={hkv}. Allowed: a divisor of {h}."
        )
    return h, hkv


def _attention_dims(num_layers, attn_dim) -> tuple[int, int]:
    layers = _int("num_layers", num_layers, minimum=0)
    dim = _int("attn_dim", attn_dim, minimum=0)
    if (layers == 0) != (dim == 0):
        raise ValueError(
            f"num_layers and attn_dim go together (both 0 to leave attention out, both >= 1 "
            f"to count it); got num_layers={layers}, attn_dim={dim}."
        )
    return layers, dim
