"""What a measurement returns, ``OpMeasurement``, and how measurements are reported: the
fraction of the roofline reached and a plain-text table.

Only counts and seconds are fields; the rates are computed from them: FLOP/s = flops /
seconds, bytes/s = bytes_moved / seconds, intensity = flops / bytes_moved.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch

from .. import calc
from ..devices import same_device


@dataclasses.dataclass(frozen=True)
class OpMeasurement:
    """One measured operation. ``flops`` and ``bytes_moved`` are per call, for the whole
    batch; ``seconds`` is the median time of one call."""

    name: str            # e.g. "decode B=8", "matmul 512x3072x576"
    kind: str            # "decode", "prefill", "matmul", "matvec" or "attention"
    batch: int           # sequences (decode, prefill, attention) or rows of the input (matmul)
    flops: float
    bytes_moved: float
    seconds: float
    dtype: str           # torch dtype name, e.g. "float32"
    device: str
    details: dict = dataclasses.field(default_factory=dict)  # sizes used, bytes breakdown

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_moved / self.seconds

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes_moved

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict:
        """Fields plus the derived rates, JSON-ready."""
        d = dataclasses.asdict(self)
        d.update(flops_per_s=self.flops_per_s, bytes_per_s=self.bytes_per_s,
                 intensity=self.intensity)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "OpMeasurement":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def __str__(self) -> str:
        return (f"{self.name}: {self.seconds * 1e3:.2f} ms, {self.flops_per_s / 1e9:.2f} GFLOP/s, "
                f"{self.bytes_per_s / 1e9:.2f} GB/s, {self.intensity:.3g} FLOP/byte")


def check_same_device(profile, ops: Iterable[OpMeasurement]) -> None:
    """The roof (``profile``, a ``MachineProfile``) and the points under it (``ops``) must
    come from one device; ``ValueError`` naming both otherwise."""
    other = sorted({op.device for op in ops if not same_device(op.device, profile.device)})
    if other:
        raise ValueError(
            f"the measurements ran on {', '.join(other)} but the machine profile was measured "
            f"on {profile.device} ({profile.device_name}): a roofline divides each point by "
            f"its own device's limits. Measure both on one device: perf.measure_machine() and "
            f"load_model() both default to minillm.devices.default_device(), or pass the same "
            f"device= to each.")


def roofline_fraction(op: OpMeasurement, peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """Achieved FLOP/s over the roofline's attainable FLOP/s at the op's intensity
    (``calc.roofline_flops``). 1.0 means on the roof; small-cache effects can exceed it."""
    return op.flops_per_s / calc.roofline_flops(op.intensity, peak_flops, bandwidth_bytes_per_s)


def format_table(ops: Iterable[OpMeasurement], profile=None) -> str:
    """A plain-text table of measurements; with a ``minillm.perf.MachineProfile``, each row
    also shows the fraction of this machine's roofline reached and what bounds it."""
    ops = list(ops)
    if profile is not None:
        check_same_device(profile, ops)
    head = f"{'operation':<24}{'ms':>9}{'GFLOP/s':>10}{'GB/s':>8}{'FLOP/B':>8}"
    if profile is not None:
        head += f"{'% roof':>8}  bound"
    lines = [head, "-" * len(head)]
    for op in ops:
        line = (f"{op.name:<24}{op.seconds * 1e3:>9.2f}{op.flops_per_s / 1e9:>10.2f}"
                f"{op.bytes_per_s / 1e9:>8.2f}{op.intensity:>8.3g}")
        if profile is not None:
            peak = _profile_peak(profile, op.dtype)
            bw = profile.bandwidth_bytes_per_s
            bound = "memory" if op.intensity < peak / bw else "compute"
            line += f"{100 * roofline_fraction(op, peak, bw):>7.0f}%  {bound}"
        lines.append(line)
    if profile is not None:
        lines.append(f"roofline: {profile.device_name}, {profile.bandwidth_bytes_per_s / 1e9:.1f} GB/s "
                     f"measured; matmul peak per dtype as measured by minillm.perf")
    return "\n".join(lines)


def _profile_peak(profile, dtype: str) -> float:
    """The profile's measured matmul FLOP/s in ``dtype``, else its fp32 figure."""
    flops = profile.matmul_flops
    value = flops.get(dtype) or flops.get("float32") or max(flops.values())
    if not (value and math.isfinite(value)):
        raise ValueError(f"machine profile has no usable matmul FLOP/s: {flops!r}")
    return value
