"""benchmarks/decode_overhead.py: the products are replaced only inside the context and put
back after it (an error included), and both ways of the step are timed."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minillm.layers import cpu_linear

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("decode_overhead",
                                              REPO / "benchmarks" / "decode_overhead.py")
decode_overhead = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decode_overhead)


def test_products_are_replaced_inside_only(tiny_model):
    x, w = torch.randn(1, 1, 64), torch.randn(96, 64)
    default = cpu_linear.load_kernel()
    with pytest.raises(RuntimeError, match="inside"):
        with decode_overhead.without_products():
            y = default.small_m_linear(x, w)
            assert y.shape == (1, 1, 96)  # the shape, not the product
            raise RuntimeError("an error inside")
    torch.testing.assert_close(default.small_m_linear(x, w), F.linear(x, w))


def test_both_ways_of_the_step_are_timed(tiny_model, monkeypatch):
    """Both ways run (the overhead way inside `without_products`, warm-up and round) and give
    a finite time per step. Not its sign: on a 2-layer model a step is a fraction of a
    millisecond, and a difference of two single timings can come out below zero on a busy
    machine (a fresh-clone `make test` saw it once); the benchmark takes the best of rounds."""
    real, entered = decode_overhead.without_products, []

    def counted():
        entered.append(1)
        return real()
    monkeypatch.setattr(decode_overhead, "without_products", counted)
    t = decode_overhead.step_seconds(tiny_model, [5, 9, 3], new_tokens=4, rounds=1)
    assert set(t) == {"step", "overhead"} and all(math.isfinite(v) for v in t.values())
    assert len(entered) == 2  # the warm-up and the one round
    torch.testing.assert_close(tiny_model.lm_head(torch.ones(1, 64)),
                               F.linear(torch.ones(1, 64), tiny_model.lm_head.weight))
