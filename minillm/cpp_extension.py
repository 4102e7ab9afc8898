"""Build minillm's C++ CPU kernels on first use, or say why not and fall back.

Four kernels live in C++ (each beside the module that calls it, in a `csrc/` folder):
`attention/csrc/paged_decode_cpu.cpp` (decode attention read in place through the block
table), `layers/csrc/small_m_linear_cpu.cpp` (a weight product for a few rows that streams
the weight once), `layers/csrc/fused_glue_cpu.cpp` (RMSNorm, RoPE, SiLU·up and the residual
adds in one pass each) and `quant/csrc/quant_linear_cpu.cpp` (the small-M product for packed
4-bit and 8-bit weights, read without dequantizing). `csrc/vec_math.h` holds the SIMD
helpers they share. Each is compiled with `torch.utils.cpp_extension.load`
(a C++ compiler and `ninja`); a build takes 30–40 s once and is cached under
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR). `make setup` builds them all ahead, so
no notebook cell waits for the compiler.

Each calling module marks its `load_kernel` with `@cpp_extension.register(what)`, so this
module never imports its callers: `main` imports the subpackages that hold C++ sources and
builds whatever registered itself.

A source can be built for several instruction sets (`ISAS`: avx2, avx512, avx512bf16; a
build's name ends in its ISA and a hash of its sources and flags, `source_digest`, and `load(..., isa=...)` defines MINILLM_ISA so that each
build names its operators apart). The small-M linear and the W4/W8 kernels are built for
every ISA this CPU runs, and `minillm.cpu_select` measures which build, or the PyTorch
path, runs each bucket of shapes here.

Where a kernel cannot be built (no compiler, another OS), `load` warns once and returns
None, and the caller keeps its PyTorch path: same results to rounding, slower.
MINILLM_CPU_KERNEL (`setting`) chooses: unset or 1, measured per shape; 0 or blas, every
C++ kernel off (the PyTorch paths then run, e.g. to compare against them); default, each
kernel's default build everywhere, not measured; avx2, avx512 or avx512bf16, that build.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

_loaded: dict[tuple[str, str | None], object] = {}  # (stem, isa) -> module or None
INCLUDE = Path(__file__).with_name("csrc")  # vec_math.h (SIMD helpers), build_name.h
# What each kernel does -> its module's `load_kernel`: every module with a C++ kernel adds
# itself when it is imported (`register`), so `main` builds them all without naming them.
KERNELS: dict[str, Callable[[], object]] = {}
BUILDS: dict[str, tuple[str, ...] | None] = {}  # what -> its builds (None: one, the default)


def register(what: str, builds: tuple[str, ...] | None = None):
    """Decorator for a module's `load_kernel`: lists it under `what` (e.g. "fused glue")
    for `main`. A kernel with several builds (`builds`, ISAs of `ISAS`) takes the build
    as its argument, `load_kernel(isa)`; `main` builds each one this CPU runs. Returns the
    function unchanged."""
    def add(load_kernel: Callable[[], object]) -> Callable[[], object]:
        KERNELS[what] = load_kernel
        BUILDS[what] = builds
        return load_kernel
    return add


# MINILLM_CPU_KERNEL: which C++ kernels run (see `setting`).
ENV = "MINILLM_CPU_KERNEL"
# The instruction sets a kernel can be built for, narrowest first. "avx512bf16" is AVX-512
# with the bf16 dot product (`vdpbf16ps`); "generic" (no -m flags) is what a CPU without
# AVX2 gets. A build's extension name ends in its ISA.
ISAS = ("avx2", "avx512", "avx512bf16")
_ISA_FLAGS = {"generic": [], "avx2": ["-mavx2", "-mfma"]}
_ISA_FLAGS["avx512"] = _ISA_FLAGS["avx2"] + ["-mavx512f", "-mavx512bw", "-mavx512vl",
                                             "-mavx512dq"]
_ISA_FLAGS["avx512bf16"] = _ISA_FLAGS["avx512"] + ["-mavx512bf16"]
# MINILLM_CPU_KERNEL's values: "1" (or unset) measures and chooses per shape
# (`minillm.cpu_select`); "0" or "blas" switches every C++ kernel off (the PyTorch / BLAS
# paths run); "default" runs each kernel's default build for every shape it takes, without
# measuring (what the code did before the selection existed); an ISA forces that build.
_SETTINGS = {"1": "auto", "auto": "auto", "0": "blas", "blas": "blas", "default": "default",
             **{isa: isa for isa in ISAS}}


# `setting` is asked ~270 times per eager CPU decode step (each C++ kernel call and each
# remembered per-shape choice, `cpu_select.memoized`), so it must cost little. Measured (AMD
# EPYC, Python 3.11): os.environ.get took 186 ns of setting()'s 282 ns, the parsing the rest.
# So it reads the raw value from the dict that os.environ.get itself reads
# (`os.environ._data`, under the key `encodekey` makes: every write through os.environ,
# monkeypatch.setenv and mock.patch.dict included, lands there before it returns) and parses
# each distinct raw value once: 64 ns a call (`python -m timeit -s "from minillm import
# cpp_extension as c" "c.setting()"`). Invariant: `_parsed[raw]` is a pure function of
# `raw`, so no change of the variable can be missed (tests/test_cpu_select.py). A Python
# whose os.environ lacks `_data` takes os.environ.get (same result, slower).
_ENV_KEY = getattr(os.environ, "encodekey", os.fsencode)(ENV)
_parsed: dict[str | bytes | None, str] = {}  # raw value (None: unset) -> setting; valid only


def _raw_setting() -> str | bytes | None:
    """MINILLM_CPU_KERNEL as os.environ stores it (bytes on POSIX), None when unset."""
    try:
        return os.environ._data.get(_ENV_KEY)
    except AttributeError:
        return os.environ.get(ENV)


def setting() -> str:
    """MINILLM_CPU_KERNEL, normalized: "auto", "blas", "default" or an ISA of `ISAS`.
    Raises ValueError on any other value, naming the ones allowed."""
    raw = _raw_setting()
    try:
        return _parsed[raw]
    except KeyError:
        pass
    # os.fsdecode is how os.environ decodes a POSIX value (a str passes through unchanged).
    text = ("1" if raw is None else os.fsdecode(raw)).strip().lower() or "1"
    if text not in _SETTINGS:
        raise ValueError(f"{ENV}={text!r} is not a setting: use 1 (measure and choose per "
                         f"shape, the default), 0 or blas (PyTorch/BLAS only), default (each "
                         f"kernel's default build, not measured) or one of {', '.join(ISAS)} "
                         f"(force that build)")
    _parsed[raw] = _SETTINGS[text]  # a bad value is not remembered: it raises every time
    return _parsed[raw]


def enabled() -> bool:
    """False when MINILLM_CPU_KERNEL=0 (or =blas) asks for the PyTorch paths."""
    return setting() != "blas"


def host_isas(capability: str | None = None, flags: set[str] | None = None) -> tuple[str, ...]:
    """The ISAs of `ISAS` this CPU runs, narrowest first (empty where it has no AVX2: then
    only "generic" builds). `capability` (PyTorch's, e.g. "AVX512") and `flags` (the CPU
    flags as /proc/cpuinfo spells them) default to this machine's; tests pass others."""
    if capability is None and flags is None:  # this machine: asked per kernel call
        return _this_host_isas()
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    if flags is None:
        from .devices import _cpu_flags
        flags = _cpu_flags()
    isas = []
    if capability in ("AVX2", "AVX512"):
        isas.append("avx2")
    if capability == "AVX512":
        isas.append("avx512")
        if "avx512_bf16" in flags:
            isas.append("avx512bf16")
    return tuple(isas)


@functools.cache
def _this_host_isas() -> tuple[str, ...]:
    from .devices import _cpu_flags
    return host_isas(torch.backends.cpu.get_cpu_capability(), _cpu_flags())


def default_isa(avx512: bool = False, avx512_bf16: bool = False,
                isas: tuple[str, ...] | None = None) -> str:
    """The build a kernel gets when nothing is measured or forced: AVX2 where the CPU has
    it, AVX-512 for a kernel written for 16 lanes (`avx512`), and AVX-512 with its bf16 dot
    product for a kernel with such a path (`avx512_bf16`), each where the CPU has it."""
    isas = host_isas() if isas is None else isas
    if avx512_bf16 and "avx512bf16" in isas:
        return "avx512bf16"
    if avx512 and "avx512" in isas:
        return "avx512"
    return "avx2" if "avx2" in isas else "generic"


def build_flags(stem: str, avx512: bool = False, avx512_bf16: bool = False,
                isa: str | None = None) -> tuple[str, list[str]]:
    """(extension name, compiler flags) for this CPU. The name carries the instruction set,
    so a cache directory shared by different machines never hands one the other's build.

    `isa` (one of `ISAS` or "generic") asks for that build; None takes `default_isa(avx512,
    avx512_bf16)`: AVX2 where PyTorch reports the CPU has it, AVX-512 for `avx512=True` (a
    kernel written for 16-lane vectors) and AVX-512 with `-mavx512bf16` for
    `avx512_bf16=True` (a kernel with a bf16 dot-product path, `__AVX512BF16__`), each only
    where the CPU has it. Raises ValueError for an ISA this CPU cannot run."""
    if isa is None:
        isa = default_isa(avx512, avx512_bf16)
    elif isa != "generic" and isa not in host_isas():
        raise ValueError(f"this CPU cannot run a {isa} build: it runs "
                         f"{', '.join(host_isas()) or 'generic builds only'}")
    flags = ["-O3"] + _ISA_FLAGS[isa]
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")  # at::parallel_for runs on PyTorch's OpenMP threads
    return f"{stem}_{isa}", flags


def load(stem: str, source: Path, fallback: str, avx512: bool = False,
         avx512_bf16: bool = False, on_load=None, isa: str | None = None):
    """The compiled extension for `source`, or None if switched off or not buildable here.

    `fallback` names what the caller does instead; it goes into the one warning. `avx512`,
    `avx512_bf16` and `isa`: see `build_flags`; an explicit `isa` also defines the macro
    MINILLM_ISA (e.g. `avx2`) in the build, so that each build of one source can name its
    operators apart. `on_load(module)` runs once, right after a successful load (the kernels
    register their operators' shape functions there)."""
    if not enabled():
        return None
    key = (stem, isa)
    if key not in _loaded:
        name, flags = build_flags(stem, avx512, avx512_bf16, isa)
        if isa is not None:
            flags = flags + [f"-DMINILLM_ISA={isa}"]
        try:
            from torch.utils.cpp_extension import load as cpp_load

            _loaded[key] = cpp_load(f"{name}_{source_digest(source, flags)}", [str(source)],
                                    extra_cflags=flags,
                                    extra_include_paths=[str(INCLUDE)],
                                    extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                                    verbose=False)
        except Exception as e:  # compiler, ninja or headers missing: keep the torch path
            _loaded[key] = None
            last = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
            warnings.warn(f"minillm: could not build {source.name} ({name}: "
                          f"{type(e).__name__}: {last}); {fallback} instead",
                          RuntimeWarning, stacklevel=3)
        else:
            if on_load is not None:
                on_load(_loaded[key])
    return _loaded[key]


def source_digest(source: Path, flags: list[str]) -> str:
    """A short hash of what a build is made of: `source`, the shared headers and `flags`.

    It ends the extension's name, so a build folder holds exactly one version of a kernel.
    Two checkouts of different versions on one machine (a worktree, an older commit built to
    compare) then build side by side instead of rebuilding one folder in turn, and a process
    waiting on another's build lock never loads a build of other sources. The cost: a folder
    per version in the extension cache (a few MB each)."""
    h = hashlib.sha256()
    for path in (source, *sorted(INCLUDE.glob("*.h"))):
        h.update(path.read_bytes())
    h.update("\0".join(flags).encode())
    return h.hexdigest()[:12]


def kernel_packages() -> list[str]:
    """The subpackages of minillm with C++ sources (a `csrc/` folder beside their modules):
    importing them imports, and so registers, every module that loads a kernel."""
    root = Path(__file__).parent
    return sorted(f"{__package__}.{d.parent.name}" for d in root.glob("*/csrc") if d.is_dir())


def main() -> None:
    """Build (or load) every C++ kernel now, each build this CPU runs, and say how it went;
    then load or measure which build runs which shapes (`minillm.cpu_select`) and print it.
    `make setup` calls this (`from minillm.cpp_extension import main; main()`), so no lab
    cell waits for a compiler or a measurement."""
    for package in kernel_packages():
        importlib.import_module(package)
    if not enabled():  # MINILLM_CPU_KERNEL=0: nothing builds
        for what in KERNELS:
            print(f"minillm: the CPU {what} kernel is not available; the PyTorch path runs "
                  f"instead")
        return
    for what, load_kernel in KERNELS.items():
        isas = [isa for isa in BUILDS[what] or () if isa in host_isas()]
        for isa in isas or [None]:
            t0 = time.perf_counter()
            kernel = load_kernel(isa) if isa else load_kernel()
            build = f" ({isa} build)" if isa else ""
            if kernel is None:
                print(f"minillm: the CPU {what} kernel{build} is not available; the PyTorch "
                      f"path runs instead")
            else:
                print(f"minillm: CPU {what} kernel{build} ready ({kernel.__file__}, "
                      f"{time.perf_counter() - t0:.0f} s)")
    from . import cpu_select

    sel = cpu_select.current()
    print(f"minillm: CPU kernel selection (MINILLM_CPU_KERNEL={sel.setting}; {sel.source}):")
    for line in sel.lines():
        print(f"  {line}")
    # The ranks of a minillm.dist world run fewer threads each (Lab 08), and a selection is
    # measured per thread count: measure theirs now too, one process, quietly.
    from .dist.launch import default_threads_per_rank

    own = torch.get_num_threads()
    for world in (2, 4):
        threads = default_threads_per_rank(world)
        if threads == own:
            continue
        torch.set_num_threads(threads)
        try:
            ranks = cpu_select.select()
        finally:
            torch.set_num_threads(own)
        print(f"minillm: CPU kernel selection for {threads} thread(s) per rank of a world of "
              f"{world}: {ranks.source}")
