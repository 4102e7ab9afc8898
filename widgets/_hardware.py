"""The hardware limits a widget draws against: ``Limits`` (bandwidth, peak FLOP/s, memory)
for this machine, from its measured ``MachineProfile``, or for a catalog GPU, from its
datasheet (``minillm.hardware``).

Invariant: when a limit is not the one asked for (no fp8 tensor cores, no fp32 figure in
the catalog, a dtype not measured here), the fallback is used and ``Limits.note`` says
so, for the figure to show the student.
"""
from __future__ import annotations

import dataclasses

from minillm import hardware

__all__ = ["THIS_MACHINE", "Limits", "machine_limits", "gpu_limits", "resolve_limits", "measured_footnote",
           "check_same_device"]

THIS_MACHINE = "this machine (measured)"


@dataclasses.dataclass(frozen=True)
class Limits:
    """The three numbers a roofline needs, plus where they came from."""

    label: str
    bandwidth: float            # bytes/s
    peak_flops: float           # FLOP/s in the dtype asked for
    memory_bytes: float | None  # capacity; None when unknown (this machine)
    note: str = ""              # an assumption made, shown to the student
    measured: bool = False


_TORCH_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16",
                "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def machine_limits(profile, dtype: str = "fp32") -> Limits:
    """This machine's measured bandwidth and matmul FLOP/s in ``dtype`` (a MachineProfile)."""
    key = _TORCH_NAMES.get(str(dtype).lower())
    note = ""
    if key is None or key not in profile.matmul_flops:
        note = (f"no {dtype} matmul was measured here; using the measured float32 peak "
                f"(weights dequantized to fp32 before multiplying)")
        key = "float32"
    return Limits(f"{profile.device_name} ({profile.num_threads} threads)",
                  profile.bandwidth_bytes_per_s, profile.matmul_flops[key], None, note, True)


def gpu_limits(name_or_hw, dtype: str = "bf16") -> Limits:
    """A catalog GPU's datasheet bandwidth and dense peak for ``dtype``.

    fp32 has no tensor-core figure in the catalog and int8/int4 here mean weight-only
    quantization (the matmul runs in fp16), so both use the fp16/bf16 peak, with a note.
    A chip without fp8 falls back to bf16, also with a note.
    """
    hw = name_or_hw if isinstance(name_or_hw, hardware.Hardware) else hardware.get(name_or_hw)
    key = str(dtype).lower()
    note = ""
    if key in ("fp32", "float32"):
        key, note = "bf16", "the catalog has no fp32 figure; using the bf16 tensor-core peak (optimistic)"
    elif key in ("int8", "int4"):
        key, note = "fp16", f"{dtype} as weight-only quantization: the matmul runs at the fp16 peak"
    elif key in ("fp8", "float8") and hw.fp8_flops is None:
        key, note = "bf16", f"{hw.name} has no fp8 tensor cores; using its bf16 peak"
    return Limits(hw.name, hw.bandwidth_bytes_per_s, hw.peak_flops(key), hw.memory_bytes, note)


def resolve_limits(hw, dtype: str, profile=None) -> Limits:
    """``THIS_MACHINE`` (needs ``profile``), a catalog name, a ``Hardware`` or ``Limits``."""
    if isinstance(hw, Limits):
        return hw
    if hw == THIS_MACHINE:
        if profile is None:
            raise ValueError(f"hardware={THIS_MACHINE!r} needs a MachineProfile: pass "
                             "profile=minillm.perf.measure_machine().")
        return machine_limits(profile, dtype)
    return gpu_limits(hw, dtype)


def check_same_device(profile, measurements) -> None:
    """A roof and the points under it must come from one device: ``ValueError`` when a
    measurement ran on another device than the ``MachineProfile`` was measured on."""
    from minillm.measure.results import check_same_device as check

    check(profile, measurements)


def measured_footnote(profile) -> str:
    """Where and when this machine's numbers were measured, for a figure's footer."""
    when = str(profile.measured_at)[:16].replace("T", " ")
    return (f"Measured on {profile.device_name}, {profile.num_threads} threads, torch "
            f"{profile.torch_version}, {when} UTC. Medians; on a shared machine they vary "
            f"from run to run.")
