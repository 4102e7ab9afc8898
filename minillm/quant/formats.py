"""Low-bit floating-point and lookup formats for weights, fake-quantized: FP8 E4M3, FP8 E5M2
and NF4. A fake-quantized weight is the float tensor the format would give back after a
round trip (scale, round to the nearest representable value, scale back): it measures the
format's accuracy, not its speed (no kernel here reads these formats).

    w_hat = formats.fake_quantize(w, "e4m3")          # one fp32 scale per row, absmax -> 448
    w_hat = formats.fake_quantize(w, "nf4", 64)       # one fp16 absmax per 64 weights
    qmodel = formats.fake_quantize_model(model, "e5m2")   # a copy; the model is unchanged
    formats.weight_bytes(model, "nf4", 64)["per_token"]   # bytes a decode step would read

The formats:

- **E4M3** (4 exponent bits, bias 7, 3 mantissa bits; the ``fn`` variant: no infinities,
  one NaN code per sign): largest finite value 1.75 · 2⁸ = 448, 3 significant bits, so
  about 2 decimal digits. The format for weights and activations (inference).
- **E5M2** (5 exponent bits, bias 15, 2 mantissa bits, IEEE-like with infinities): largest
  finite value 1.75 · 2¹⁵ = 57344; more range, one bit less precision. The format for
  gradients, whose range matters more than their precision.
- **NF4** (QLoRA): 16 fixed levels in [−1, 1] placed at quantiles of a normal distribution
  (so each level is about equally used by normally distributed weights), with an exact 0;
  each block of weights is divided by its absmax, rounded to the nearest level.

Invariants: every fast path here (torch's float8 casts, a bucketize on NF4's midpoints) is
tested against a plain reference that enumerates the representable values and picks the
nearest one (tests/test_quant_formats.py); scales are computed per row (FP8) or per block
(NF4) from the absmax, so the largest |w| of a row or block maps to the format's largest
value exactly; a zero row or block stays zero.
"""
from __future__ import annotations

import math

import torch

__all__ = ["FORMATS", "E4M3_MAX", "E5M2_MAX", "NF4_LEVELS", "fp8_values", "nf4_levels_from_normal",
           "fake_quantize", "fake_quantize_fp8", "fake_quantize_nf4", "reference_fake_quantize",
           "fake_quantize_model", "bits_per_weight", "weight_bytes"]

E4M3_MAX = 448.0
E5M2_MAX = 57344.0

# QLoRA's NF4 levels (Dettmers et al., 2023; bitsandbytes' table), ascending.
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float64)

# method name -> (bits per stored value, default group size: None = one scale per row)
FORMATS = {"e4m3": (8, None), "e5m2": (8, None), "nf4": (4, 64)}
_FP8 = {"e4m3": (4, 3, 7, E4M3_MAX, "float8_e4m3fn"), "e5m2": (5, 2, 15, E5M2_MAX, "float8_e5m2")}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {sorted(FORMATS)} "
                         f"(int formats are quant.rtn / quantize_model)")


def fp8_values(fmt: str) -> torch.Tensor:
    """Every finite value of the FP8 format, ascending, decoded bit by bit from its 256 codes
    (the plain reference: sign · 2^(e − bias) · (1 + m / 2^M), subnormals at e = 0)."""
    if fmt not in _FP8:
        raise ValueError(f"fp8_values takes 'e4m3' or 'e5m2', got {fmt!r}")
    e_bits, m_bits, bias, _, _ = _FP8[fmt]
    values = set()
    for code in range(256):
        sign = -1.0 if code >> 7 else 1.0
        e = (code >> m_bits) & ((1 << e_bits) - 1)
        m = code & ((1 << m_bits) - 1)
        if fmt == "e5m2" and e == (1 << e_bits) - 1:
            continue                                   # infinities and NaNs
        if fmt == "e4m3" and e == (1 << e_bits) - 1 and m == (1 << m_bits) - 1:
            continue                                   # e4m3fn: S.1111.111 is NaN, nothing else
        if e == 0:
            v = sign * 2.0 ** (1 - bias) * (m / 2 ** m_bits)
        else:
            v = sign * 2.0 ** (e - bias) * (1 + m / 2 ** m_bits)
        values.add(v)
    return torch.tensor(sorted(values), dtype=torch.float64)


def nf4_levels_from_normal(offset: float = 0.9677083) -> torch.Tensor:
    """NF4's levels rebuilt from their definition: 8 positive quantiles of N(0, 1) between
    `offset` and 0.5, 7 negative ones, and 0, scaled so that the largest is 1."""
    normal = torch.distributions.Normal(0.0, 1.0)
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return levels / levels.max()


def _row_scale(w: torch.Tensor, top: float) -> torch.Tensor:
    amax = w.abs().amax(-1, keepdim=True)
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def fake_quantize_fp8(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w [..., in] round-tripped through FP8 `fmt`, one fp32 scale per row (absmax -> the
    format's largest value), rounding to nearest even (torch's float8 cast)."""
    _, _, _, top, dtype = _FP8[fmt]
    x = w.float()
    scale = _row_scale(x, top)
    q = (x / scale).clamp(-top, top).to(getattr(torch, dtype))
    return (q.float() * scale).to(w.dtype)


def _blocks(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if w.shape[-1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide the rows of {tuple(w.shape)}: "
                         f"pick a divisor of {w.shape[-1]}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)


def fake_quantize_nf4(w: torch.Tensor, group_size: int = 64) -> torch.Tensor:
    """w [..., in] round-tripped through NF4: each block of `group_size` weights divided by
    its absmax (kept in fp16), rounded to the nearest of the 16 levels, multiplied back."""
    blocks = _blocks(w.float(), group_size)
    scale = _row_scale(blocks, 1.0).half().float()
    levels = NF4_LEVELS.to(device=w.device, dtype=torch.float32)
    mids = (levels[1:] + levels[:-1]) / 2
    idx = torch.bucketize((blocks / scale).clamp(-1, 1), mids)   # ties go to the lower level
    return (levels[idx] * scale).reshape(w.shape).to(w.dtype)


def fake_quantize(w: torch.Tensor, fmt: str, group_size: int | None = None) -> torch.Tensor:
    """The round trip of `w` through `fmt` ('e4m3', 'e5m2': per row; 'nf4': per block of
    `group_size`, default 64)."""
    _check_format(fmt)
    if fmt == "nf4":
        return fake_quantize_nf4(w, group_size or FORMATS["nf4"][1])
    if group_size is not None:
        raise ValueError(f"{fmt} here has one scale per row: pass group_size=None")
    return fake_quantize_fp8(w, fmt)


def reference_fake_quantize(w: torch.Tensor, fmt: str, group_size: int | None = None) -> torch.Tensor:
    """The plain reference of `fake_quantize`: the same scales and scaled values (fp32), then
    for every value the nearest representable one by exhaustive search over the format's
    values (FP8: ties to the even code, as IEEE rounding does; NF4: ties to the lower level)."""
    _check_format(fmt)
    x = w.float()
    if fmt == "nf4":
        blocks = _blocks(x, group_size or FORMATS["nf4"][1])
        scale = _row_scale(blocks, 1.0).half().float()
        y, table = (blocks / scale).clamp(-1, 1), NF4_LEVELS.to(w.device)
    else:
        top = _FP8[fmt][3]
        scale = _row_scale(x, top)
        y, table = (x / scale).clamp(-top, top), fp8_values(fmt).to(w.device)
    dist = (y.double()[..., None] - table).abs()
    ties = dist == dist.min(-1, keepdim=True).values
    if fmt == "nf4":
        idx = ties.int().argmax(-1)                     # the first (lower) of tied levels
    else:
        # same-sign codes ascend with magnitude, so a code's parity is its distance from 0
        pos = torch.arange(len(table), device=w.device)
        even = (pos - int((table == 0).nonzero()[0])).abs() % 2 == 0
        idx = torch.where((ties & even).any(-1), (ties & even).int().argmax(-1), ties.int().argmax(-1))
    out = table[idx].float() * scale
    return out.reshape(w.shape).to(w.dtype)


def bits_per_weight(fmt: str, in_features: int, group_size: int | None = None) -> float:
    """Stored bits per weight, scales included: FP8 8 + 32 / in_features (an fp32 scale per
    row); NF4 4 + 16 / group_size (an fp16 absmax per block)."""
    _check_format(fmt)
    bits, default = FORMATS[fmt]
    if fmt == "nf4":
        return bits + 16 / (group_size or default)
    return bits + 32 / in_features


@torch.no_grad()
def fake_quantize_model(model, fmt: str, group_size: int | None = None):
    """A copy of `model` whose four projections of every layer hold `fmt`'s round trip of
    their weights (the LM head and embedding stay float, as in ``quantize_model``)."""
    from .quantize import projections

    _check_format(fmt)
    copy = model.deep_copy()
    for layer in copy.layers:
        for parent, attr in projections(layer).values():
            lin = getattr(parent, attr)
            lin.weight.copy_(fake_quantize(lin.weight, fmt, group_size))
    return copy


def weight_bytes(model, fmt: str, group_size: int | None = None) -> dict:
    """``quant.weight_bytes`` of the float `model` as if its projections were stored in
    `fmt` (scales included): {'per_token', 'stored'}."""
    from .quantize import projections, weight_bytes as float_bytes

    base = float_bytes(model)
    saved = 0.0
    for layer in model.layers:
        for parent, attr in projections(layer).values():
            w = getattr(parent, attr).weight
            as_fmt = w.numel() * bits_per_weight(fmt, w.shape[1], group_size) / 8
            saved += w.numel() * w.element_size() - as_fmt
    return {"per_token": int(round(base["per_token"] - saved)),
            "stored": int(round(base["stored"] - saved))}
