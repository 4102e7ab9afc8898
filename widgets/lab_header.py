"""Each lab's first cell: the one device and dtype the lab runs on, and how long the lab
took on the devices it was measured on.

    DEVICE, DTYPE = widgets.lab_header("01-roofline")     # prints both, returns the pair

The device comes from ``minillm.devices.default_device()`` (CUDA when a GPU is visible,
else the CPU; ``MINILLM_DEVICE`` overrides it) unless the lab passes its own, and the dtype
from ``default_dtype`` unless the lab needs another (Lab 02's exact oracle keeps fp32).
Every later cell takes its device from here: no cell of a lab names one.

Run times live in ``lab_runtimes.json`` beside this module, per lab and per kind of device
("CPU", "GPU"): seconds of a full run and of a ``MINILLM_QUICK=1`` run, where, when and
how they were measured. A kind never measured is reported as such, never guessed;
``benchmarks/gpu_check.py --sections labs`` measures the GPU's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from minillm import devices

__all__ = ["lab_header", "runtime_line", "RUNTIMES"]

RUNTIMES = Path(__file__).with_name("lab_runtimes.json")
_KINDS = ("CPU", "GPU")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def runtime_line(lab: str, device=None, path: Path | str = RUNTIMES) -> str:
    """One line: the lab's measured run time on ``device``'s kind first, then on the others."""
    kind = "GPU" if devices.is_cuda(device) else "CPU"
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8")).get(lab, {})
    except (OSError, ValueError):
        table = {}
    parts = []
    for k in [kind] + [k for k in _KINDS if k != kind]:
        where = f"a {k}"
        rec = table.get(k)
        if not rec:
            parts.append(f"on {where}: not yet measured")
            continue
        quick = rec.get("quick_seconds")
        full = rec.get("seconds")
        times = ", ".join(t for t in (
            f"{_minutes(full)} in full" if full else "",
            f"{_minutes(quick)} with MINILLM_QUICK=1" if quick else "") if t)
        parts.append(f"on {where} ({rec.get('device_name', '?')}, {rec.get('date', '?')}): {times}")
    return "Measured run time of this lab " + "; ".join(parts) + "."


def lab_header(lab: str, dtype=None, device=None) -> tuple[torch.device, torch.dtype]:
    """Print the device and dtype the lab ``lab`` (e.g. "01-roofline") runs on and its
    measured run times; return (device, dtype) for the rest of the lab."""
    dev = devices.resolve_device(device)
    dt = devices.default_dtype(dev) if dtype is None else dtype
    print(f"Lab {lab[:2]}: " + devices.describe(device, dt))
    print(runtime_line(lab, dev))
    return dev, dt
