"""One device per process (`minillm.devices`): MINILLM_DEVICE, its errors, the defaults that
follow from it, and the one-line refusals of the command line.

No GPU is needed: a CUDA machine is imitated by patching `torch.cuda.is_available`,
`torch.cuda.device_count` and `torch.cuda.get_device_capability`, which is all
`minillm.devices` asks of CUDA before a tensor is made.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm import devices

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine that says it has one CUDA GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without CUDA, and no MINILLM_DEVICE: the same answers on any test host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)


def test_default_is_cpu_without_cuda_and_cuda_with_it(monkeypatch, one_gpu):
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)
    assert devices.default_device() == torch.device("cuda", 0)
    assert devices.default_dtype() == torch.bfloat16 and devices.cuda_requested()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.default_device() == torch.device("cpu")
    assert devices.default_dtype() == torch.float32 and not devices.cuda_requested()


def test_gpus_before_ampere_default_to_fp16(monkeypatch, one_gpu):
    # A T4 (7.5) has fp16 tensor cores and no bf16 ones.
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or (7, 5))
    assert devices.default_dtype() == torch.float16
    assert devices.decode_dtype() == torch.float16
    assert devices.default_dtype("cuda:0") == torch.float16
    assert all(torch.device(d).type == "cuda" for d in asked)  # the device in use is asked
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert devices.default_dtype() == devices.decode_dtype() == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # asked on a CPU machine
    assert devices.default_dtype("cuda") == torch.bfloat16


@pytest.mark.parametrize("text,want", [("cpu", "cpu"), ("CPU", "cpu"), ("cuda", "cuda:0"),
                                       ("cuda:0", "cuda:0"), (" cuda ", "cuda:0")])
def test_minillm_device_overrides_the_default(monkeypatch, one_gpu, text, want):
    monkeypatch.setenv(devices.DEVICE_ENV, text)
    assert devices.default_device() == torch.device(want)
    assert devices.resolve_device() == torch.device(want)
    assert devices.cuda_requested() == want.startswith("cuda")


def test_minillm_device_cpu_wins_on_a_cuda_machine(monkeypatch, one_gpu):
    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    assert devices.default_device().type == "cpu"
    assert devices.default_dtype() == torch.float32
    assert not devices.cuda_requested()
    assert not devices.is_cuda()


@pytest.mark.parametrize("text", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_is_one_line_naming_the_devices(monkeypatch, text):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(devices.DEVICE_ENV, text)
    with pytest.raises(devices.DeviceError) as info:
        devices.default_device()
    msg = str(info.value)
    assert "\n" not in msg
    assert f"MINILLM_DEVICE={text!r}" in msg and "the devices available are cpu;" in msg


def test_a_gpu_this_machine_lacks_is_refused(monkeypatch, one_gpu):
    monkeypatch.setenv(devices.DEVICE_ENV, "cuda:7")
    with pytest.raises(devices.DeviceError, match=r"'cuda:7'.*available are cpu, cuda:0;"):
        devices.default_device()
    with pytest.raises(devices.DeviceError, match="cuda:3"):  # an explicit device too
        devices.resolve_device("cuda:3")


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cpu:0:1", "tpu", ""])
def test_garbage_is_refused(monkeypatch, no_gpu, text):
    if text:
        monkeypatch.setenv(devices.DEVICE_ENV, text)
        with pytest.raises(devices.DeviceError, match="not a device of this machine"):
            devices.default_device()
    else:  # empty: unset
        monkeypatch.setenv(devices.DEVICE_ENV, text)
        assert devices.default_device() == torch.device("cpu")


def test_a_bad_value_does_not_break_import_time_setup(monkeypatch):
    monkeypatch.setenv(devices.DEVICE_ENV, "nonsense")
    assert devices.cuda_requested() in (True, False)  # answers, does not raise


def test_describe_names_device_dtype_and_why(monkeypatch, no_gpu):
    line = devices.describe(dtype=torch.float32)
    assert line.startswith("device: cpu (") and "dtype float32" in line
    assert "no CUDA GPU is visible" in line
    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    assert "MINILLM_DEVICE=cpu" in devices.describe()


def test_same_device_and_dtype_names():
    assert devices.same_device("cuda", "cuda:0") and devices.same_device("cpu", torch.device("cpu"))
    assert not devices.same_device("cpu", "cuda:0") and not devices.same_device("cuda:1", "cuda:0")
    assert devices.dtype_name(torch.bfloat16) == "bfloat16"
    assert devices.default_dtype("cuda") == torch.bfloat16  # asked, not resolved: no GPU needed


def test_lab_header_returns_the_pair_and_reports_run_times(no_gpu, capsys, tmp_path):
    import widgets
    from widgets.lab_header import runtime_line

    dev, dt = widgets.lab_header("01-roofline")
    out = capsys.readouterr().out.splitlines()
    assert (dev, dt) == (devices.default_device(), devices.default_dtype())
    assert out[0].startswith("Lab 01: device: cpu") and out[1].startswith("Measured run time")
    table = tmp_path / "t.json"
    table.write_text('{"99-x": {"CPU": {"seconds": 150, "quick_seconds": 40, '
                     '"device_name": "Some CPU, 2 threads", "date": "2026-01-01"}}}')
    line = runtime_line("99-x", "cpu", table)
    assert "on a CPU (Some CPU, 2 threads, 2026-01-01): 2.5 min in full, 40 s with MINILLM_QUICK=1" in line
    assert "on a GPU: not yet measured" in line


def test_every_lab_has_a_measured_cpu_run_time():
    import json

    from widgets.lab_header import RUNTIMES

    table = json.loads(RUNTIMES.read_text())
    labs = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]-*.ipynb"))
    for lab in labs:
        rec = table.get(lab, {}).get("CPU")
        assert rec and rec.get("seconds") and rec["seconds"] <= 300, \
            f"{lab}: no measured CPU run time (at most 5 minutes) in {RUNTIMES.name}"


# ----------------------------------------------------------------------------- the command line


def _cli(*args, env_device=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    if env_device is None:
        env.pop(devices.DEVICE_ENV, None)
    else:
        env[devices.DEVICE_ENV] = env_device
    return subprocess.run([sys.executable, "-m", "minillm", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_generate_refuses_a_missing_cuda_in_one_line():
    res = _cli("generate", "hi", "--max-new-tokens", "1", env_device="cuda")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "MINILLM_DEVICE='cuda'" in lines[0] and "available are cpu" in lines[0]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_device_flag_refuses_a_missing_gpu_in_one_line(command):
    extra = ["hi"] if command == "generate" else []
    res = _cli(command, *extra, "--device", "cuda:7")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert "--device='cuda:7' is not a device of this machine" in lines[-1]
    assert "available are cpu" in lines[-1]


def test_serve_config_device_and_dtype():
    from minillm.serve.config import ServeConfig

    c = ServeConfig(device="cuda:1", dtype="bfloat16")
    assert c.load_options() == {"device": "cuda:1", "dtype": torch.bfloat16}
    assert ServeConfig().load_options() == {"device": None, "dtype": None}
    assert c.engine_options()["attn_backend"] is None  # the engine's: Triton on CUDA
    chosen = ServeConfig(attn_backend="torch")
    assert chosen.engine_options()["attn_backend"] == "torch"
    assert chosen.cli_args()[-2:] == ["--attn-backend", "torch"]
    with pytest.raises(ValueError, match="ServeConfig.attn_backend must be one of"):
        ServeConfig(attn_backend="flash")
    with pytest.raises(ValueError, match="ServeConfig.device must be cpu, cuda or cuda:N"):
        ServeConfig(device="gpu0")
    with pytest.raises(ValueError, match="ServeConfig.dtype must be one of"):
        ServeConfig(dtype="fp32")
    args = c.cli_args()  # what ServerProcess starts the child with
    assert args[args.index("--device") + 1] == "cuda:1" and "--dtype" in args


def test_make_current_sets_the_thread_s_cuda_device_and_the_engine_thread_calls_it(
        monkeypatch, smollm):
    # Triton launches on the current CUDA device: a model on cuda:1 must be made current in
    # every thread that steps it (a new thread starts at cuda:0).
    import threading

    from minillm import LLMEngine
    from minillm.serve import async_engine
    from minillm.serve.config import ServeConfig
    from minillm.serve.metrics import ServerMetrics

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    devices.make_current("cpu")
    devices.make_current("cuda:1")
    assert calls == [torch.device("cuda:1")]

    seen = []
    monkeypatch.setattr(async_engine, "make_current",
                        lambda d: seen.append((torch.device(d), threading.current_thread().name)))
    model, tok = smollm
    engine = LLMEngine(model, tok, num_blocks=8, max_num_seqs=2)
    aengine = async_engine.AsyncEngine(engine, tok, ServeConfig(), ServerMetrics())
    try:
        aengine._executor.submit(lambda: None).result()
    finally:
        aengine._executor.shutdown(wait=True)
    assert len(seen) == 1 and seen[0][0] == model.device
    assert seen[0][1].startswith("minillm-engine")
