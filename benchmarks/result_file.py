"""How a benchmark writes its result file: the JSON, and where it came from.

The project's rule is that every speed figure is recorded with the machine, the date and
the command that produced it. Each script used to pick its own subset of those; this module
adds the same ``"provenance"`` entry to every result file instead:

    command    ``python benchmarks/decode.py --rounds 3``, from ``sys.argv``
    env        the settings in the environment, when the file is written, that change a
               measurement (MINILLM_*, OMP_*, TRITON_*, ...; minillm sets TRITON_INTERPRET)
    date_utc   when the file was written, ISO 8601 in UTC
    device     ``minillm.devices.device_name`` of the device measured (the CPU by default)
    cpu        the host's CPU model, which bounds launch and glue time even on a GPU run
    platform, cpu_count, torch_threads
    versions   python, torch, triton, numpy
    commit     the short git hash, ``+dirty`` when tracked files outside benchmarks/results
               differ from it (untracked files are not counted, as in ``git describe
               --dirty``); None where git or the checkout is not there (a copied tree)

    write_result(path, data, *, argv=None, device="cpu", indent=2) -> Path
    provenance(argv=None, device="cpu") -> dict    # the entry alone
    write_json(path, data, *, indent=2) -> Path    # the atomic write alone

Invariants:
- The file is replaced atomically (a temporary file beside it, then a rename): a run cut
  short, or a value JSON cannot encode, leaves the previous file whole and no temporary
  file behind.
- Provenance is additive. A dict keeps every key it had and gains ``"provenance"``; a dict
  that already has that key is refused (ValueError) rather than overwritten. Anything else
  (a list) is wrapped as ``{"provenance": ..., "results": data}``.
- The caller's ``data`` is not modified.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's minillm, as every script here imports it

import torch  # noqa: E402

from minillm.devices import device_name  # noqa: E402

KEY = "provenance"
# Settings read from the environment that change what a benchmark measures: the package's
# own (MINILLM_CPU_KERNEL, MINILLM_DEVICE, ...), the thread pools' and the compilers'.
# Prefixes of names, so that nothing else (no token, no path of the user's) is recorded.
ENV_PREFIXES = ("MINILLM_", "OMP_", "MKL_", "TORCHINDUCTOR_", "TRITON_", "CUDA_VISIBLE_DEVICES")
# The directory the scripts write into: a rewritten result file is not a change of the code
# that measured it, so it does not make the commit "+dirty".
RESULTS_DIR = "benchmarks/results"


def write_result(path, data, *, argv: list[str] | None = None, device="cpu",
                 indent: int | None = 2) -> Path:
    """Write ``data`` with its ``"provenance"`` to ``path`` as JSON (``indent``, a trailing
    newline), creating the parent directories, atomically. ``argv``: the command line as
    ``sys.argv`` spells it, script first (None: ``sys.argv``); ``device``: the device the
    script measured. Returns the path written."""
    prov = provenance(argv, device)
    if isinstance(data, dict):
        if KEY in data:
            raise ValueError(f"the result already has a {KEY!r} key: write_result adds that "
                             f"key itself and will not overwrite it; rename the script's own")
        data = {**data, KEY: prov}
    else:
        data = {KEY: prov, "results": data}
    return write_json(path, data, indent=indent)


def write_json(path, data, *, indent: int | None = 2) -> Path:
    """Write ``data`` as JSON to ``path`` atomically, with no provenance added (for a file
    whose parts carry their own, as ``benchmarks/quant.py``'s do)."""
    path = Path(path)
    # Encoded before any file is opened: a value JSON cannot encode raises here, and the
    # previous file is untouched.
    text = json.dumps(data, indent=indent) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Beside the target, so the rename stays on one file system (where it is atomic); the
    # pid keeps two runs writing the same file from sharing a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def provenance(argv: list[str] | None = None, device="cpu") -> dict:
    """Where a result came from: the command, the date, the machine, the versions and the
    commit (see the module docstring). Never fails for want of git."""
    return {
        "command": command(argv),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_name(device),
        "cpu": device_name("cpu"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": _version("triton", "pytorch-triton"), "numpy": _version("numpy")},
        "commit": git_commit(),
    }


def command(argv: list[str] | None = None) -> str:
    """``argv`` (None: ``sys.argv``) as a command to paste into a shell from the project
    root: ``python benchmarks/x.py --flag value``."""
    argv = list(sys.argv if argv is None else argv)
    # The script as a path from the project root, whatever directory it was started from
    # (an argv[0] that is no file, such as "-c", stays as it is).
    if argv and Path(argv[0]).is_file() and Path(argv[0]).resolve().is_relative_to(ROOT):
        argv[0] = Path(argv[0]).resolve().relative_to(ROOT).as_posix()
    return shlex.join(["python", *argv])


def _version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` present, None if none is: read from
    the package metadata, so triton is not imported (and initialised) just to be named."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=10, check=True).stdout


def git_commit() -> str | None:
    """The short hash of this checkout's HEAD, with ``+dirty`` when tracked files other than
    the results differ from it; None where git is missing or ROOT is not a checkout."""
    try:
        top, head = _git("rev-parse", "--show-toplevel", "--short", "HEAD").split()
        # A tree copied inside some other repository would otherwise report that one's commit.
        if Path(top).resolve() != ROOT:
            return None
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                     f":(exclude){RESULTS_DIR}").strip()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return head + ("+dirty" if dirty else "")
