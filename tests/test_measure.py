"""minillm.measure on the tiny model and small kernels: every result is finite and positive,
and its FLOPs and bytes are exactly the formulas of minillm.calc.

No timing thresholds: the machines are shared and noisy. Everything here runs in ~2 s.
"""
import math

import pytest
import torch

from minillm import ModelConfig, calc, measure, perf

FP32 = 4


def _finite_positive(op):
    for value in (op.seconds, op.flops, op.bytes_moved, op.flops_per_s, op.bytes_per_s, op.intensity):
        assert math.isfinite(value) and value > 0, f"{op.name}: {value!r} should be finite and > 0"


def test_decode_steps_counts_match_calc(tiny_model):
    cfg = tiny_model.config
    ops = measure.measure_decode_steps(tiny_model, batch_sizes=(1, 3), context_len=8,
                                       repeats=1, warmup=0)
    assert [op.batch for op in ops] == [1, 3]
    n = cfg.num_params()  # tied embeddings: the embedding matrix is the LM head
    assert measure.matmul_params(cfg) == n
    for op in ops:
        _finite_positive(op)
        assert op.kind == "decode" and op.dtype == "float32" and op.device == "cpu"
        seq = 8 + 1  # the cached context plus the new token
        attn_dim = cfg.num_heads * cfg.head_dim
        assert op.flops == pytest.approx(op.batch * calc.decode_flops(n, seq, cfg.num_layers, attn_dim))
        assert op.bytes_moved == pytest.approx(
            calc.weight_bytes(n, FP32)
            + calc.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, seq, FP32, op.batch))
        assert op.intensity == pytest.approx(op.flops / op.bytes_moved)
        assert op.details["context_len"] == 8 and op.details["model"] == "tiny"
    # Batching shares the weight reads: intensity grows with the batch.
    assert ops[1].intensity > ops[0].intensity


def test_decode_steps_leave_the_model_working(tiny_model):
    """Measuring must not change the model: same logits before and after."""
    ids = torch.tensor([[5, 6, 7, 8]])
    before = tiny_model(ids)
    measure.measure_decode_steps(tiny_model, (2,), context_len=4, repeats=1, warmup=0, progress=True)
    torch.testing.assert_close(tiny_model(ids), before, rtol=0, atol=0)


def test_untied_model_does_not_count_the_embedding_table():
    cfg = ModelConfig.tiny(tie_word_embeddings=False)
    assert measure.matmul_params(cfg) == cfg.num_params() - cfg.vocab_size * cfg.hidden_size


def test_prefill_counts_match_calc(tiny_model):
    cfg = tiny_model.config
    op = measure.measure_prefill(tiny_model, num_tokens=12, batch=2, repeats=1, warmup=0)
    _finite_positive(op)
    n = cfg.num_params()
    assert op.flops == pytest.approx(2 * calc.prefill_flops(n, 12, cfg.num_layers, cfg.num_heads * cfg.head_dim))
    assert op.bytes_moved == pytest.approx(
        calc.weight_bytes(n, FP32) + calc.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 12, FP32, 2))


def test_kernel_intensities_match_calc():
    mm = measure.measure_matmul(32, 48, 40, repeats=2)
    mv = measure.measure_matvec(96, 40, repeats=2)
    at = measure.measure_attention_decode(batch=3, context_len=50, num_heads=4, num_kv_heads=2,
                                          head_dim=16, repeats=2)
    for op in (mm, mv, at):
        _finite_positive(op)
    assert mm.flops == 2 * 32 * 48 * 40
    assert mm.intensity == pytest.approx(calc.matmul_intensity(32, 48, 40, FP32))
    assert mv.intensity == pytest.approx(calc.matvec_intensity(96, 40, FP32))
    assert at.flops == 4 * 3 * 4 * 50 * 16
    # Each sequence reads its own cache: the intensity does not depend on the batch.
    assert at.intensity == pytest.approx(calc.attention_intensity(50, 16, 4, 2, FP32))


def test_on_cuda_operators_replay_a_graph_over_copies_that_fill_twice_the_l2(monkeypatch):
    # Timed alone, a µs kernel is mostly the host's launch, and repeats re-read operands
    # the L2 holds. The CUDA branch is driven here with a stand-in time_graph.
    from minillm.measure import operators

    seen = {}

    def fake_time_graph(fns, replays, device):
        seen.update(calls=len(fns), distinct=len(set(map(id, fns))), replays=replays)
        return 1e-6

    made = []
    monkeypatch.setattr(operators, "time_graph", fake_time_graph)
    monkeypatch.setattr(operators, "_l2_bytes", lambda dev: 1000)
    cuda = torch.device("cuda", 0)
    make = lambda i: made.append(i) or (lambda: None)  # noqa: E731
    assert operators._op_seconds(make, 300, cuda, warmup=1, repeats=3) == 1e-6
    assert made == list(range(7)) and seen == {"calls": 20, "distinct": 7, "replays": 3}
    made.clear()
    operators._op_seconds(make, 10, cuda, warmup=1, repeats=3)
    assert len(made) == operators.MAX_COPIES and seen["calls"] == operators.MAX_COPIES
    made.clear()
    operators._op_seconds(make, 10, torch.device("cpu"), warmup=1, repeats=3)
    assert made == [0]  # a CPU times the operands made first, call by call
    x = torch.ones(3)
    copies = operators._copies(x)
    assert copies(0)[0] is x and copies(1)[0] is not x and torch.equal(copies(1)[0], x)


def test_kernels_in_bfloat16_count_two_bytes():
    op = measure.measure_matvec(64, 32, dtype=torch.bfloat16, repeats=1)
    assert op.dtype == "bfloat16" and op.dtype_bytes == 2
    assert op.intensity == pytest.approx(calc.matvec_intensity(64, 32, 2))


def test_measure_operations_and_table(tiny_model):
    ops = measure.measure_operations(tiny_model, batch_sizes=(1, 2), context_len=8,
                                     prefill_tokens=16, repeats=1, progress=False)
    kinds = [op.kind for op in ops]
    assert kinds == ["decode", "decode", "prefill", "matvec", "matmul", "attention", "attention"]
    for op in ops:
        _finite_positive(op)
    profile = perf.MachineProfile(
        device="cpu", device_name="Test CPU", num_threads=2, bandwidth_bytes_per_s=20e9,
        bandwidth_by_kernel={"copy": 20e9}, matvec_by_path={"blas": 15e9}, matmul_flops={"float32": 100e9},
        measured_at="2026-01-01T00:00:00+00:00", measurement_s=0.0, torch_version="x", settings={})
    table = measure.format_table(ops, profile)
    assert "decode B=2" in table and "% roof" in table and "Test CPU" in table
    frac = measure.roofline_fraction(ops[0], 100e9, 20e9)
    assert frac == pytest.approx(ops[0].flops_per_s / calc.roofline_flops(ops[0].intensity, 100e9, 20e9))


def test_round_trip_through_dict():
    op = measure.measure_matvec(16, 8, repeats=1)
    d = op.to_dict()
    assert d["intensity"] == pytest.approx(op.intensity)
    assert measure.OpMeasurement.from_dict(d) == op


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_sizes=()), "batch_sizes is empty"),
    (dict(batch_sizes=(0,)), r"batch_sizes\[\] must be an integer >= 1"),
    (dict(context_len=256), "context_len must be below the model's context length 256"),
])
def test_decode_steps_reject_bad_arguments(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure.measure_decode_steps(tiny_model, **kwargs)


def test_kernels_reject_bad_arguments():
    with pytest.raises(ValueError, match="m must be an integer >= 1"):
        measure.measure_matmul(0, 4, 4)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        measure.measure_attention_decode(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        measure.measure_matvec(4, 4, dtype=torch.int32)
