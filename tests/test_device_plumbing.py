"""Every lab keeps to the one device it was given.

The labs run on `minillm.devices.default_device()`. Here the machine claims a CUDA GPU
(`torch.cuda.is_available` patched to return True) while `MINILLM_DEVICE=cpu` chooses the
CPU: code that respects the choice runs on the CPU as usual, and code that decides for
itself (`torch.cuda.is_available()`, a literal "cuda") reaches for a GPU this machine
does not have and fails. Each test runs the package functions one lab's cells call, at
small sizes, so that this class of bug cannot come back unnoticed; the last ones start a
fresh process with the same lie (`tests/fixtures/fake_cuda/sitecustomize.py`) for what
runs outside this one: the command line and the server.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm import LlamaModel, ModelConfig, devices

ROOT = Path(__file__).resolve().parents[1]
FAKE_CUDA = ROOT / "tests" / "fixtures" / "fake_cuda"
CPU = torch.device("cpu")


@pytest.fixture
def cpu_chosen_on_a_cuda_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "cache"))
    assert devices.default_device() == CPU


def tiny(dtype=None):
    """Lab 05's tiny model, placed as the labs place theirs."""
    dev = devices.default_device()
    return (LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()
            .to(dev, dtype or devices.default_dtype(dev)))


def _all_on_cpu(model):
    return all(t.device == CPU for t in [*model.parameters(), *model.buffers()])


def test_every_lab_header_chooses_the_cpu(cpu_chosen_on_a_cuda_machine, capsys):
    import widgets

    for lab in sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]-*.ipynb")):
        dev, dt = widgets.lab_header(lab)
        assert dev == CPU and dt == torch.float32, lab
    assert "MINILLM_DEVICE=cpu" in capsys.readouterr().out


def test_lab01_roofline_and_launch_wall(cpu_chosen_on_a_cuda_machine):
    import widgets
    from minillm import measure, perf

    profile = perf.measure_machine(bandwidth_bytes=1 << 20, matvec_bytes=1 << 20, matmul_n=32,
                                   repeats=1)
    assert profile.device == "cpu"
    model = tiny()
    ops = measure.measure_decode_steps(model, (1, 2), context_len=8, repeats=1)
    ops.append(measure.measure_matvec(64, 32, repeats=1))
    ops.append(measure.measure_matmul(8, 16, 32, repeats=1))
    ops.append(measure.measure_attention_decode(1, 16, repeats=1))
    assert {op.device for op in ops} == {"cpu"} and {op.dtype for op in ops} == {"float32"}
    measure.format_table(ops, profile)
    widgets.roofline.roofline_data(profile, ops, "H100-SXM", "bf16")
    widgets.memory_wall.memory_wall_data(hardware_name=widgets.THIS_MACHINE, profile=profile,
                                         measured=ops)
    wall = measure.LaunchWall(model, profile.matvec_bytes_per_s, prompt_len=4, steps=2,
                              count_steps=2, rounds=1)
    wall.measure("eager")
    assert wall.run("eager").launches > 0 and not wall.overlapped
    assert measure.launch.default_variants(devices.default_device()) == ("eager", "compiled")


def test_lab02_cache_and_generate(cpu_chosen_on_a_cuda_machine):
    import minillm

    model = tiny(torch.float32)
    cache = minillm.KVCache(model.config, 1, 16)
    assert cache.k[0].device == CPU
    assert minillm.generate(model, [1, 2, 3], 4) == minillm.generate(model, [1, 2, 3], 4,
                                                                      use_cache=False)


def test_lab03_attention_variants_and_memory(cpu_chosen_on_a_cuda_machine):
    from minillm.kernels.tiled import naive_attention, tiled_attention
    from widgets import attention_variants

    models = attention_variants.build_models(num_layers=1, vocab_size=64, max_context=32)
    assert all(_all_on_cpu(m) for m in models.values())
    data = attention_variants.attention_variants_data(16, 1, num_layers=1, vocab_size=64,
                                                      models=models, repeats=1)
    assert data.step_dtype == "float32"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 20, 16, generator=g) for h in (4, 2, 2))
    torch.testing.assert_close(tiled_attention(q, k, v, block_m=8, block_n=8),
                               naive_attention(q, k, v))


def test_lab05_engine(cpu_chosen_on_a_cuda_machine):
    from widgets import batching

    model = tiny()
    run = batching.run_engine(model, batching.tiny_workload(3), "continuous", max_num_seqs=2)
    assert run["tokens"] > 0


def test_lab06_quantized_copies(cpu_chosen_on_a_cuda_machine):
    from minillm import quant
    from widgets import quant_runs

    model = tiny(torch.float32)
    q = quant.quantize_model(model, "rtn", 4, 32, progress=False)
    assert _all_on_cpu(q)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    g = quant.quantize_model(model, "gptq", 4, 32, calibration=ids, progress=False)
    assert _all_on_cpu(g)
    maxima = quant_runs.activation_maxima(model, ids)
    assert all(t.device == CPU for t in maxima.values())


def test_lab07_speculative_decoding(cpu_chosen_on_a_cuda_machine):
    import minillm
    from minillm import spec

    model = tiny(torch.float32)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    out = spec.speculative_generate(model, spec.NgramDraft(), prompt, 8, k=3)
    assert out.tokens == minillm.generate(model, prompt, 8)
    from minillm.spec.distill import make_draft

    draft = make_draft(model, layers=(0,))
    assert _all_on_cpu(draft)


def test_lab08_ranks_stay_on_the_cpu(cpu_chosen_on_a_cuda_machine):
    from minillm import dist
    from minillm.dist.launch import default_backend

    assert default_backend(3) == "gloo"  # three "GPUs", but the lab chose the CPU
    assert dist.ranks_device(3) == CPU


def test_lab09_and_10_server_options_and_prices(cpu_chosen_on_a_cuda_machine):
    from minillm import hardware
    from minillm.serve.config import ServeConfig

    assert ServeConfig().load_options()["device"] is None  # resolved by load_model: the CPU
    what, price = hardware.price_of_device()
    assert what.startswith("a CPU VM") and price > 0


def test_lab10_capstone_and_step_model(cpu_chosen_on_a_cuda_machine):
    from widgets import batching, deploy_runs

    model = tiny(torch.float32)
    requests = [(prompt, 3) for prompt, _ in batching.tiny_workload(2)]
    capstone = deploy_runs.Capstone(model, None, requests)
    assert capstone.run(deploy_runs.Deployment(max_num_seqs=2)).output_tokens == 6
    bf16 = capstone.weights("bf16")
    assert _all_on_cpu(bf16) and bf16.dtype == torch.bfloat16
    assert deploy_runs.fit_step_model(model, batch=2).base_s > 0


def test_a_model_defaults_to_the_chosen_device(cpu_chosen_on_a_cuda_machine):
    from minillm.paged import PagedKVCache

    assert PagedKVCache(1, 2, 4, 1, 8).device == CPU


# ----------------------------------------------------------------------------- fresh processes


def _fake_cuda_env(**extra):
    env = {**os.environ, devices.DEVICE_ENV: "cpu", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_CUDA), str(ROOT)])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_the_fake_cuda_process_believes_in_a_gpu_and_keeps_to_the_cpu():
    code = ("import torch, minillm, os; from minillm import devices; "
            "print(torch.cuda.is_available(), devices.default_device(), "
            "os.environ.get('TRITON_INTERPRET'))")
    res = subprocess.run([sys.executable, "-c", code], env=_fake_cuda_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    # the GPU "is there", the course runs on the CPU, and Triton's kernels get CPU tensors
    assert res.stdout.split() == ["True", "cpu", "1"]


@pytest.mark.slow
def test_cli_generate_stays_on_the_chosen_cpu():
    res = subprocess.run([sys.executable, "-m", "minillm", "generate", "The capital of France is",
                          "--max-new-tokens", "4"], env=_fake_cuda_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip()


@pytest.mark.slow
def test_the_server_stays_on_the_chosen_cpu():
    from minillm import serve

    with serve.ServerProcess(max_num_seqs=2, num_blocks=64, startup_timeout_s=300,
                             env=_fake_cuda_env()) as server:
        log = server.log_text()
    assert "(cpu, float32;" in log, log[-2000:]
