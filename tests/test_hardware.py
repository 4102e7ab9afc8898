"""The accelerator catalog: datasheet numbers, ridge points, and lookups that fail loudly."""

import dataclasses

import pytest

from minillm import calc, hardware
from minillm.hardware import CATALOG, get


def test_catalog_has_the_course_machines():
    assert set(CATALOG) == {"A100-40GB", "A100-80GB", "H100-SXM", "H200", "RTX-4090", "A10", "L40S", "M2-Max"}
    for key, hw in CATALOG.items():
        assert hw.name == key
        for value in (hw.memory_bytes, hw.bandwidth_bytes_per_s, hw.fp16_flops, hw.bf16_flops, hw.price_per_hour):
            assert value > 0
        assert hw.fp8_flops is None or hw.fp8_flops > hw.bf16_flops
        assert hw.interconnect


def test_datasheet_numbers():
    h100 = get("H100-SXM")
    assert (h100.memory_bytes, h100.bandwidth_bytes_per_s, h100.bf16_flops) == (80e9, 3.35e12, 989e12)
    assert (get("H200").memory_bytes, get("H200").bandwidth_bytes_per_s) == (141e9, 4.8e12)
    assert get("A100-40GB").bandwidth_bytes_per_s == 1.555e12
    assert get("A100-80GB").bandwidth_bytes_per_s == 2.039e12
    assert get("A100-80GB").fp16_flops == 312e12 and get("A100-80GB").fp8_flops is None
    assert get("M2-Max").bandwidth_bytes_per_s == 400e9
    assert get("H100-SXM").interconnect_bytes_per_s == 900e9
    assert get("L40S").interconnect_bytes_per_s == 64e9


def test_ridge_points():
    assert round(get("H100-SXM").ridge_point("bf16")) == 295
    assert round(get("A100-80GB").ridge_point("fp16")) == 153  # 156 with the rounded 2 TB/s
    assert calc.ridge_point(get("A100-80GB").fp16_flops, 2e12) == 156
    assert get("H100-SXM").ridge_point("fp8") == pytest.approx(2 * get("H100-SXM").ridge_point(), rel=1e-3)
    assert get("H100-SXM").peak_flops("torch.bfloat16") == 989e12


def test_peak_flops_errors():
    with pytest.raises(ValueError, match="A100-80GB has no fp8"):
        get("A100-80GB").peak_flops("fp8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        get("H100-SXM").peak_flops("int3")


def test_decode_ceiling_from_catalog():
    h100 = get("H100-SXM")
    assert calc.decode_tokens_per_s(70e9, 2, h100.bandwidth_bytes_per_s) == pytest.approx(23.93, rel=1e-3)
    assert calc.cost_per_million_tokens(get("A100-80GB").price_per_hour, 800) == pytest.approx(0.868, rel=1e-3)


def test_entries_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get("A10").memory_bytes = 1


def test_get_is_case_insensitive_and_fails_loudly():
    assert get("h100-sxm") is CATALOG["H100-SXM"]
    with pytest.raises(KeyError) as info:
        get("H1000")
    message = str(info.value)
    assert "H1000" in message and "H100-SXM" in message and "M2-Max" in message
    with pytest.raises(ValueError):
        get("TPU-v5")
    assert issubclass(hardware.UnknownHardwareError, KeyError)
