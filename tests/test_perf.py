"""minillm.perf on tiny sizes: positive finite numbers, a JSON cache that is reused, refresh.

No timing thresholds: the machines are shared and noisy.
"""

import json
import math

import pytest
import torch

from minillm import perf
from minillm.layers import cpu_linear

TINY = dict(bandwidth_bytes=1 << 20, matmul_n=32, repeats=2, matvec_bytes=1 << 20)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(perf.CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def counted(monkeypatch):
    """Count calls to the measuring function while still measuring."""
    calls = []
    real = perf._measure_profile

    def wrapper(dev, settings):
        calls.append(settings)
        return real(dev, settings)

    monkeypatch.setattr(perf, "_measure_profile", wrapper)
    return calls


def test_time_fn_calls_and_median():
    calls = []
    seconds = perf.time_fn(lambda: calls.append(1), warmup=3, repeats=5)
    assert len(calls) == 8
    assert seconds >= 0 and math.isfinite(seconds)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1; got 0"):
        perf.time_fn(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup must be an integer >= 0; got -1"):
        perf.time_fn(lambda: None, warmup=-1)


def test_default_dtype():
    assert perf.default_dtype("cpu") == torch.float32
    assert perf.default_dtype(torch.device("cuda")) == torch.bfloat16


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv(perf.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert perf.cache_dir() == tmp_path / "xdg" / "minillm"
    monkeypatch.setenv(perf.CACHE_ENV, str(tmp_path / "mine"))
    assert perf.cache_dir() == tmp_path / "mine"


def test_measure_machine_tiny_is_positive_and_cached(cache, counted):
    profile = perf.measure_machine("cpu", **TINY)
    assert len(counted) == 1
    rates = [profile.bandwidth_bytes_per_s, *profile.bandwidth_by_kernel.values(), *profile.matmul_flops.values()]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    assert set(profile.matmul_flops) == {"float32", "bfloat16", "float16"}
    assert profile.bandwidth_bytes_per_s == max(profile.bandwidth_by_kernel.values())
    # the matvec stream: BLAS always, the package's kernel where it is built
    assert "blas" in profile.matvec_by_path
    assert ("minillm" in profile.matvec_by_path) == (cpu_linear.load_kernel() is not None)
    assert all(math.isfinite(r) and r > 0 for r in profile.matvec_by_path.values())
    assert profile.matvec_bytes_per_s == max(profile.matvec_by_path.values())
    assert "matvec stream" in str(profile)
    assert profile.num_threads == torch.get_num_threads()
    assert profile.ridge_point() == profile.matmul_flops["float32"] / profile.bandwidth_bytes_per_s
    assert profile.ridge_point(torch.float16) == profile.matmul_flops["float16"] / profile.bandwidth_bytes_per_s
    assert "GB/s" in str(profile)

    files = list(cache.glob("*.json"))
    assert len(files) == 1 and f"{torch.get_num_threads()}threads" in files[0].name
    assert json.loads(files[0].read_text())["measured_at"] == profile.measured_at

    again = perf.measure_machine("cpu", **TINY)
    assert len(counted) == 1  # read back from the cache, not measured
    assert again == profile

    fresh = perf.measure_machine("cpu", refresh=True, **TINY)
    assert len(counted) == 2
    assert fresh.measured_at != profile.measured_at
    assert perf.measure_machine("cpu", **TINY) == fresh  # the cache now holds the new one


def test_other_settings_or_corrupt_cache_measure_again(cache, counted):
    perf.measure_machine("cpu", **TINY)
    perf.measure_machine("cpu", **{**TINY, "matmul_n": {"float32": 32, "bfloat16": 32, "float16": 16}})
    assert len(counted) == 2
    next(cache.glob("*.json")).write_text("{not json")
    perf.measure_machine("cpu", **TINY)
    assert len(counted) == 3


def test_matvec_paths_compute_the_product_they_time():
    # the ceiling is only honest if each timed path really is W x
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, perf.MATVEC_K, generator=g), torch.randn(perf.MATVEC_K, generator=g)
    paths = perf.matvec_paths(w, x)
    assert "blas" in paths
    for name, fn in paths.items():
        torch.testing.assert_close(fn(), w @ x, rtol=1e-4, atol=1e-4, msg=name)


def test_matvec_stream_counts_the_matrix_bytes(monkeypatch):
    # rates are W's bytes over the median time: with the timer fixed at 1 ms, a 1 MiB
    # request (455 rows of 576 fp32) must report 455 * 576 * 4 bytes per ms
    monkeypatch.setattr(perf, "_budgeted_median", lambda fn, dev, repeats: 1e-3)
    rates = perf.measure_matvec_bandwidth("cpu", num_bytes=1 << 20, repeats=1)
    rows = (1 << 20) // (4 * perf.MATVEC_K)
    assert rates["blas"] == pytest.approx(rows * perf.MATVEC_K * 4 / 1e-3)


def test_bad_matmul_size_key(cache):
    with pytest.raises(ValueError, match="matmul_n keys"):
        perf.measure_machine("cpu", matmul_n={"int8": 4})


def test_decode_tok_s_takes_the_best_of_each_time():
    from minillm.timing import decode_tok_s
    # a stall in the first 1-token run: the best of each time gives 31 / (0.41 - 0.10)
    assert decode_tok_s([0.40, 0.10, 0.11], [0.41, 0.42, 0.41], 32) == pytest.approx(100)
    # times in the wrong order: the prefill cannot be cancelled, n / t(n) is reported
    assert decode_tok_s([0.50], [0.40], 32) == pytest.approx(80)
    with pytest.raises(ValueError, match="at least 2"):
        decode_tok_s([0.1], [0.2], 1)
