"""Which device and dtype the course runs on, and what to call the device.

One device per process, from one place: ``default_device()``. It is CUDA when a GPU is
visible, else the CPU, and the environment variable ``MINILLM_DEVICE`` (``cpu``, ``cuda``
or ``cuda:N``) overrides it. Every function of the package that takes a device takes
``device=None`` and resolves it here (``resolve_device``), so a notebook, a widget and a
measurement cannot disagree about where they run. The dtype follows the device: bf16 on
CUDA, fp32 elsewhere (``default_dtype``).

Invariants:
- A device that this machine does not have (``MINILLM_DEVICE=cuda`` without CUDA,
  ``cuda:7`` on a one-GPU machine, a misspelling) is refused with one ``DeviceError`` line
  that names the devices available; nothing falls back silently.
- ``cuda_requested()`` answers without raising: it is what import-time set-up (Triton's
  CPU interpreter, ``minillm/__init__.py``) consults before any device is resolved.

``minillm.perf`` re-exports the device and dtype names, and keys its cached measurements by
``device_name``.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess

import torch

DEVICE_ENV = "MINILLM_DEVICE"
_DEVICE_TEXT = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


class DeviceError(ValueError):
    """A device that this machine does not have, or a name that is not a device."""


def available_devices() -> list[str]:
    """The devices this process can use, by name: ``cpu`` and one ``cuda:N`` per visible GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + [f"cuda:{i}" for i in range(count)]


def _refuse(what: str, text) -> DeviceError:
    names = ", ".join(available_devices())
    return DeviceError(f"{what}={text!r} is not a device of this machine: the devices "
                       f"available are {names}; use one of them (cpu, cuda or cuda:N), or "
                       f"unset it to take the default")


def parse_device(text, what: str = "device") -> torch.device:
    """``text`` (``cpu``, ``cuda``, ``cuda:N`` or a ``torch.device``) as a device of this
    machine; ``DeviceError`` (one line, naming the devices available) otherwise.
    ``what`` names the setting in the message (e.g. ``MINILLM_DEVICE``, ``--device``)."""
    if isinstance(text, torch.device):
        dev = text
    else:
        m = _DEVICE_TEXT.match(str(text).strip().lower())
        if not m:
            raise _refuse(what, text)
        dev = torch.device(m.group(1), int(m.group(2)) if m.group(2) is not None else None)
    if dev.type == "cuda":
        if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
            raise _refuse(what, text)
    elif dev.type != "cpu" and dev.type != "mps":
        raise _refuse(what, text)
    return dev


def _env_device_text() -> str | None:
    text = os.environ.get(DEVICE_ENV, "").strip()
    return text or None


def cuda_requested() -> bool:
    """Will the course run on CUDA? A GPU is visible and ``MINILLM_DEVICE`` does not say
    otherwise. Never raises (a bad ``MINILLM_DEVICE`` is reported when a device is resolved)."""
    text = _env_device_text()
    if text is not None and not text.lower().startswith("cuda"):
        return False
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The process's device: ``MINILLM_DEVICE`` if set, else CUDA if a GPU is visible, else
    the CPU. CUDA comes with its index (the current device unless one is named)."""
    text = _env_device_text()
    if text is not None:
        return _with_index(parse_device(text, DEVICE_ENV))
    return _with_index(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _with_index(dev: torch.device) -> torch.device:
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_device(device=None) -> torch.device:
    """``device`` (None: ``default_device()``) as a device of this machine, CUDA with its
    index; ``DeviceError`` when this machine does not have it."""
    dev = default_device() if device is None else parse_device(device)
    return _with_index(dev)


_resolve = resolve_device  # the name the package's modules import


def _kind(device) -> str:
    """The device type ("cpu", "cuda", ...) of ``device``, None for the default one. A device
    named explicitly is not checked against this machine: what dtype CUDA would use is a
    question a CPU-only machine may ask."""
    return default_device().type if device is None else torch.device(device).type


def reference_device() -> torch.device:
    """Where correctness references run whatever the course's device is: the CPU, in fp32
    (quantization's source weights, the fp32 reference models of the labs' checks)."""
    return torch.device("cpu")


def is_cuda(device=None) -> bool:
    """Is ``device`` (None: the default) a CUDA device? For code that must not spell one."""
    return resolve_device(device).type == "cuda"


def same_device(a, b) -> bool:
    """Do ``a`` and ``b`` (devices or their names) name the same device? ``cuda`` and
    ``cuda:0`` do when device 0 is current; nothing is checked against this machine."""
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and (da.index or 0) == (db.index or 0)


def make_current(device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op for other devices).
    Triton launches on the current device and its stream, and CUDA events and streams are
    made there: a model on cuda:1 driven from a thread whose current device is still cuda:0
    would launch its kernels in the wrong context. The current device is per thread, and a
    new thread starts at cuda:0, so a worker that steps an engine calls this first."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)


def synchronize(device=None) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def default_dtype(device=None) -> torch.dtype:
    """The dtype the engine runs in on ``device``: bf16 on CUDA (fp16 on GPUs older than
    Ampere: ``cuda_half_dtype``), fp32 elsewhere.

    GPUs since Ampere have bf16 tensor cores: half the bytes of fp32 at many times the
    FLOP/s, with fp32's exponent range (no overflow). Common CPUs have no native bf16
    arithmetic: bf16 matmuls are emulated several times slower than fp32 (fp16 ones ~100x
    slower), so fp32 is the safe default there. (Batch-1 decode in bf16 can still win on a
    CPU, because it is memory-bound and reads half the bytes: a roofline lesson.)
    """
    if _kind(device) == "cuda":
        return cuda_half_dtype(default_device() if device is None else device)
    return torch.float32


def cuda_half_dtype(device=None) -> torch.dtype:
    """The 16-bit dtype of a CUDA device: bf16 from compute capability 8.0 (Ampere) on, fp16
    before (Volta, Turing: a T4 has fp16 tensor cores and no bf16 ones, so its bf16 GEMMs are
    emulated; Triton's dots take FMAs there in either dtype, compiled for sm_75 with Triton
    3.6 and 3.7: ``benchmarks/triton_compile_sweep.py --arch 75``). SmolLM2's activations stay far inside fp16's range:
    an fp16 SmolLM2 agrees with fp32 better than a bf16 one does (on 512 tokens of the Lee
    corpus, measured on a CPU: KL 2e-5 and top-1 99%, against 1e-3 and 98%). A CUDA device named on a machine without one is taken to
    be a current GPU (bf16): nothing can be asked of it."""
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(dev)
        if major < 8:
            return torch.float16
    return torch.bfloat16


def describe(device=None, dtype=None) -> str:
    """One line for a lab's first cell: the device (how it was chosen, and its name), and
    the dtype the lab's model runs in (None: ``default_dtype``)."""
    dev = resolve_device(device)
    dt = default_dtype(dev) if dtype is None else dtype
    if device is not None:
        why = "chosen by the lab"
    elif _env_device_text() is not None:
        why = f"{DEVICE_ENV}={_env_device_text()}"
    elif dev.type == "cuda":
        why = "a CUDA GPU is visible"
    else:
        why = f"no CUDA GPU is visible; set {DEVICE_ENV} to choose"
    threads = f", {torch.get_num_threads()} threads" if dev.type == "cpu" else ""
    return (f"device: {dev} ({device_name(dev)}{threads}; {why}), dtype "
            f"{_dtype_key(dt)}, torch {torch.__version__}")


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
    """The dtype that decodes fastest on ``device`` at acceptable quality: 16 bits on CUDA
    (``cuda_half_dtype``), bf16 on CPUs with native bf16 (``cpu_native_bf16``), fp32 elsewhere. Batch-1 decode streams every
    weight once per token, so bf16 weights halve the step's bytes. Where bf16 is native,
    prefill's bf16 GEMMs are fast too; elsewhere they are emulated and crawl, so fp32 stays.
    What ``load_model(dtype="auto")`` picks; ``benchmarks/decode.py`` measures both."""
    kind = _kind(device)
    if kind == "cuda":
        return cuda_half_dtype(default_device() if device is None else device)
    if kind == "cpu" and cpu_native_bf16():
        return torch.bfloat16
    return torch.float32


def _dtype_key(dtype) -> str:
    return str(dtype).removeprefix("torch.")


dtype_name = _dtype_key  # torch.bfloat16 -> "bfloat16"


def bf16_note(device=None) -> str:
    """One line: how ``device`` (None: the default) does bf16 arithmetic, the fact a lab's
    fp32-against-bf16 comparison turns on."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        major, _ = torch.cuda.get_device_capability(dev)
        if major >= 8:
            return f"bf16 on {dev}: native, on tensor cores (compute capability {major}.x)"
        return f"bf16 on {dev}: no bf16 tensor cores before compute capability 8.0 (this is {major}.x)"
    if dev.type == "cpu":
        if cpu_native_bf16():
            return "bf16 on this CPU: native (avx512_bf16, AMX or Arm bf16 in its flags)"
        return "bf16 on this CPU: not native; kernels widen every bf16 number to fp32"
    return f"bf16 on {dev}: unknown"


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
