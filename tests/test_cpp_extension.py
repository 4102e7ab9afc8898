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


def test_a_build_is_named_by_its_sources_and_flags(monkeypatch, tmp_path):
    """Each version of a kernel builds into a folder of its own: the name ends in a hash of
    the source, the shared headers and the flags, so two checkouts never share a build
    folder unless they would build the same thing."""
    import torch.utils.cpp_extension as torch_ext
    names = []
    monkeypatch.setattr(torch_ext, "load", lambda name, *args, **kwargs: names.append(name))
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "default")
    a, b, a_again = tmp_path / "a.cpp", tmp_path / "b.cpp", tmp_path / "a2.cpp"
    a.write_text("int x = 1;\n")
    b.write_text("int x = 2;\n")
    a_again.write_text("int x = 1;\n")
    for stem, source in (("t_a", a), ("t_b", b), ("t_a2", a_again)):
        monkeypatch.delitem(cpp_extension._loaded, (stem, None), raising=False)
        cpp_extension.load(stem, source, "nothing")
    isa = cpp_extension.default_isa()
    digests = [n.split(f"_{isa}_")[1] for n in names]
    assert [n.split(f"_{isa}_")[0] for n in names] == ["t_a", "t_b", "t_a2"]
    assert digests[0] == digests[2] != digests[1] and len(digests[0]) == 12
    flags = cpp_extension.build_flags("t_a")[1]
    assert cpp_extension.source_digest(a, flags) == digests[0]
    assert cpp_extension.source_digest(a, flags + ["-DX"]) != digests[0]
