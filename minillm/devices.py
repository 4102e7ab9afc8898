"""Which device and dtype the course runs on, and what to call the device.

CUDA if a GPU is visible, else CPU; bf16 on CUDA, fp32 elsewhere. ``minillm.perf``
re-exports these names, and keys its cached measurements by ``device_name``.
"""

from __future__ import annotations

import platform
import subprocess

import torch


def default_device() -> torch.device:
    """CUDA if a GPU is visible, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve(device) -> torch.device:
    dev = default_device() if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def default_dtype(device=None) -> torch.dtype:
    """The dtype the engine runs in on ``device``: bf16 on CUDA, fp32 elsewhere.

    GPUs since Ampere have bf16 tensor cores: half the bytes of fp32 at many times the
    FLOP/s, with fp32's exponent range (no overflow). Common CPUs have no native bf16
    arithmetic: bf16 matmuls are emulated several times slower than fp32 (fp16 ones ~100x
    slower), so fp32 is the safe default there. (Batch-1 decode in bf16 can still win on a
    CPU, because it is memory-bound and reads half the bytes: a roofline lesson.)
    """
    return torch.bfloat16 if _resolve(device).type == "cuda" else torch.float32


def _cpuinfo_field(keys: tuple[str, ...], cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The value of the first line of ``cpuinfo`` whose key is one of ``keys`` (lower case),
    or None where there is none or the file cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's flags as /proc/cpuinfo spells them (x86 "flags", Arm "features"); empty
    where they cannot be read."""
    return set((_cpuinfo_field(("flags", "features"), cpuinfo) or "").split())


def cpu_has_flag(flag: str, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Is `flag` (as /proc/cpuinfo spells it, e.g. ``avx512_bf16``) among this CPU's flags?"""
    return flag in _cpu_flags(cpuinfo)


def cpu_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Does this CPU do bf16 arithmetic natively (x86 ``avx512_bf16`` or AMX, Arm ``bf16``)?
    Read from the CPU flags in ``cpuinfo`` (False where they cannot be read)."""
    return bool(_cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"})


def decode_dtype(device=None) -> torch.dtype:
    """The dtype that decodes fastest on ``device`` at acceptable quality: bf16 on CUDA and on
    CPUs with native bf16 (``cpu_native_bf16``), fp32 elsewhere. Batch-1 decode streams every
    weight once per token, so bf16 weights halve the step's bytes. Where bf16 is native,
    prefill's bf16 GEMMs are fast too; elsewhere they are emulated and crawl, so fp32 stays.
    What ``load_model(dtype="auto")`` picks; ``benchmarks/decode.py`` measures both."""
    dev = _resolve(device)
    if dev.type == "cuda" or (dev.type == "cpu" and cpu_native_bf16()):
        return torch.bfloat16
    return torch.float32


def _dtype_key(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device=None) -> str:
    """A human-readable name for ``device``: the GPU model, or the CPU model string."""
    dev = _resolve(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    name = _cpu_name()
    return name if dev.type == "cpu" else f"{dev.type} ({name})"


def _cpu_name() -> str:
    name = _cpuinfo_field(("model name",))
    if name:
        return name
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5)
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"
