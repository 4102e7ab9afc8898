"""minillm.cpp_extension's registry: every C++ kernel's module registers its `load_kernel`
when imported, and `main` (what `make setup` runs) finds them all through the subpackages
that hold C++ sources, without naming any of them.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from minillm import cpp_extension

ROOT = Path(__file__).resolve().parents[1]


def test_every_cpp_source_has_a_registered_loader():
    for package in cpp_extension.kernel_packages():
        importlib.import_module(package)
    sources = {sys.modules[fn.__module__].SOURCE.resolve()
               for fn in cpp_extension.KERNELS.values()}
    on_disk = {p.resolve() for p in (ROOT / "minillm").glob("*/csrc/*.cpp")}
    assert on_disk and sources == on_disk
    assert cpp_extension.kernel_packages() == ["minillm.attention", "minillm.layers",
                                               "minillm.quant"]


def test_main_reports_each_registered_kernel():
    """Switched off (MINILLM_CPU_KERNEL=0) nothing builds, and main still names all four."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINILLM_CPU_KERNEL": "0"}
    res = subprocess.run([sys.executable, "-c", "from minillm.cpp_extension import main; main()"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    for what in ("paged-decode attention", "small-M linear", "fused glue",
                 "quantized (W4/W8) linear"):
        assert f"minillm: the CPU {what} kernel is not available; the PyTorch path runs " \
               "instead" in lines, what
    assert len(lines) == 4
