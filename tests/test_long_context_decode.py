"""benchmarks/long_context_decode.py: each way really takes (or avoids) the C++ kernel, the
measured choice comes back after the context (an error included), and both ways are timed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from minillm.attention import cpu_decode
from test_cpu_decode import record_kernel_lengths

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("long_context_decode",
                                              REPO / "benchmarks" / "long_context_decode.py")
long_context_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(long_context_decode)


@pytest.mark.parametrize("way", ["kernel", "sdpa"])
def test_each_way_is_the_attention_it_names(way, tiny_model, monkeypatch):
    kernel_calls = record_kernel_lengths(monkeypatch)
    with long_context_decode.attention(way):
        seconds, tokens = long_context_decode.step_seconds(tiny_model, list(range(3, 40)), 4)
    assert seconds > 0 and len(tokens) == 5
    layers = tiny_model.config.num_layers
    assert kernel_calls == ([n for n in range(38, 42) for _ in range(layers)]
                            if way == "kernel" else [])


def test_the_measured_choice_is_restored_after_an_error():
    real = cpu_decode.contiguous_preferred
    with pytest.raises(RuntimeError, match="inside"):
        with long_context_decode.attention("sdpa"):
            assert cpu_decode.contiguous_preferred(64) is False
            raise RuntimeError("inside")
    assert cpu_decode.contiguous_preferred is real
    with pytest.raises(ValueError, match="way must be one of"):
        with long_context_decode.attention("flash"):
            pass


def test_both_ways_are_timed_on_the_same_prompt(tiny_model):
    row = long_context_decode.compare(tiny_model, list(range(3, 70)), steps=3, rounds=1)
    assert row["kernel_ms"] > 0 and row["sdpa_ms"] > 0
    assert row["tokens"] == 4 and 1 <= row["same_tokens"] <= 4
