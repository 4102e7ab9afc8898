"""minillm.calc's cost and capacity modules: the worked numbers of the syllabus (section 10)
and of Lab 10, checked exactly, and the design of a 70B deployment validated against Lab 05's
simulator, which runs the real scheduler on a clock driven by the same step-time model."""

import math

import pytest

from minillm import calc
from minillm.calc import GB
from minillm.hardware import get

A100 = get("A100-80GB")


def approx(x, rel=1e-9):
    return pytest.approx(x, rel=rel)


# --------------------------------------------------------------------------- cost


def test_cost_per_million_tokens_and_utilization():
    assert round(calc.cost_per_million_tokens(2.50, 800), 2) == 0.87
    assert calc.cost_per_million_tokens(2.50, 800, utilization=0.5) == approx(2 * calc.cost_per_million_tokens(2.50, 800))
    assert calc.cost_per_million_tokens(3.6, 1000, 0.25) == approx(4.0)
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="utilization"):
            calc.cost_per_million_tokens(2.5, 800, bad)


def test_monthly_cost_tokens_and_break_even():
    assert calc.gpu_dollars_per_month(2.50) == 1825
    assert calc.gpu_dollars_per_month(2.50, num_gpus=8) == 8 * 1825
    assert calc.tokens_per_month(800) == approx(800 * 3600 * 730)
    assert calc.tokens_per_month(800, 0.5) == approx(400 * 3600 * 730)
    assert calc.break_even_tokens_per_month(1825, 0.50) == approx(3.65e9)
    # The break-even utilization is the one where renting costs what the API does ...
    u = calc.break_even_utilization(2.50, 800, 2.0)
    assert round(u, 3) == 0.434
    assert calc.cost_per_million_tokens(2.50, 800, u) == approx(2.0)
    # ... and the break-even tokens are what the GPU serves at that utilization.
    assert calc.tokens_per_month(800, u) == approx(calc.break_even_tokens_per_month(1825, 2.0))
    assert calc.break_even_utilization(2.50, 800, 0.5) > 1  # the API wins even at full load


def test_gpus_for_load():
    assert calc.gpus_for_load(20_000, 800, 0.8) == 32
    assert calc.gpus_for_load(20_000, 800) == 25
    assert calc.gpus_for_load(800, 800) == 1
    assert calc.gpus_for_load(801, 800) == 2
    assert calc.gpus_for_load(1, 800) == 1


# --------------------------------------------------------------------------- memory budget


def test_activation_bytes_llama2_70b():
    acts = calc.activation_bytes(512, 8192, 28672, 32000)
    assert acts == 512 * (2 * 8192 + 3 * 28672) * 2 + 512 * 32000 * 4
    assert round(acts / 1e6, 1) == 170.4
    assert calc.activation_bytes(512, 8192, 28672, 32000, num_logit_rows=1) < acts


def test_memory_budget_70b_on_a100s():
    b = calc.memory_budget(70e9, 80, 8, 128, 4096, A100.memory_bytes, num_gpus=4)
    assert b.usable_bytes == approx(288 * GB)
    assert b.weight_bytes == 140 * GB
    assert b.kv_bytes_per_seq == calc.kv_cache_bytes(80, 8, 128, 4096)
    assert b.max_concurrent == 110 == calc.max_concurrent_sequences(288 * GB, 140 * GB, b.kv_bytes_per_seq)
    assert b.kv_budget_bytes == approx(148 * GB)
    assert calc.memory_budget(70e9, 80, 8, 128, 4096, A100.memory_bytes, num_gpus=2).max_concurrent == 2
    # One GPU cannot even hold the weights: no KV budget at all.
    one = calc.memory_budget(70e9, 80, 8, 128, 4096, A100.memory_bytes)
    assert (one.max_concurrent, one.kv_budget_bytes) == (0, 0)
    # An int8 KV cache doubles the requests (to the floor); activations come off the top.
    int8 = calc.memory_budget(70e9, 80, 8, 128, 4096, A100.memory_bytes, num_gpus=4, kv_dtype_bytes=1)
    assert int8.max_concurrent == 220
    acts = calc.memory_budget(70e9, 80, 8, 128, 4096, A100.memory_bytes, num_gpus=4, activation_bytes=10 * GB)
    assert acts.max_concurrent == math.floor(138 / 1.342177280)
    assert "requests at once" in b.lines()[-1]


def test_int4_does_not_let_four_times_the_requests_fit():
    # A 7B MHA model (Llama-2-7B) at 4K on a 24 GB GPU: int4 weights free memory, but the KV
    # per request is the same, so the requests do not grow 4x.
    kw = dict(num_layers=32, num_kv_heads=32, head_dim=128, context_len=4096,
              gpu_memory_bytes=24e9, gpu_memory_utilization=1.0)
    fp16 = calc.memory_budget(7e9, dtype_bytes=2, **kw)
    int4 = calc.memory_budget(7e9, dtype_bytes=0.5, **kw)
    assert (fp16.max_concurrent, int4.max_concurrent) == (4, 9)
    assert fp16.kv_bytes_per_seq == int4.kv_bytes_per_seq


# --------------------------------------------------------------------------- step time and design


def test_step_model_from_the_roofline():
    step = calc.StepModel.from_roofline(70e9, 2, A100.bandwidth_bytes_per_s, A100.bf16_flops, num_gpus=4)
    assert step.base_s == approx(140e9 / (4 * 2.039e12))
    assert step.per_token_s == approx(140e9 / (4 * 312e12))
    assert round(step.base_s * 1e3, 1) == 17.2
    assert step.step_s(64) == approx(step.base_s + 64 * step.per_token_s)
    with pytest.raises(ValueError, match="base_s"):
        calc.StepModel(-1.0, 0.0)


def test_batching_does_not_shorten_a_request():
    flat = calc.StepModel(0.020, 0.0)  # 20 ms a step whatever the batch
    for b in (1, 8, 64, 256):
        assert calc.request_latency_s(flat, 1, 200, b) == approx(4.0)
    real = calc.StepModel(0.017, 0.0001)
    lat = [calc.request_latency_s(real, 500, 200, b) for b in (1, 16, 256)]
    assert lat == sorted(lat)  # a bigger batch makes every step, so every request, longer


def test_the_design_s_in_flight_bound_is_littles_law():
    # design_deployment's first bound is calc.replicas_needed (Lab 09) at full slots.
    step = calc.StepModel(0.017, 0.0001)
    for rate, b in ((100, 64), (3, 8), (500, 256)):
        d = calc.design_deployment(rate, 500, 200, step, b, max_utilization=1.0)
        assert d.replicas >= calc.replicas_needed(rate, d.e2e_s, b)
        assert d.replicas * b >= d.in_flight


def test_the_syllabus_design_70b_at_100_requests_per_s():
    step = calc.StepModel.from_roofline(70e9, 2, A100.bandwidth_bytes_per_s, A100.bf16_flops, num_gpus=4)
    d = calc.design_deployment(100, 500, 200, step, 256, gpus_per_replica=4, dollars_per_gpu_hour=2.50)
    assert (d.replicas, d.num_gpus, d.dollars_per_hour) == (12, 48, 120.0)
    assert round(d.utilization, 2) == 0.77 and d.utilization < 0.8
    assert round(d.dollars_per_million_output_tokens, 2) == 1.67
    assert round(d.itl_s * 1e3, 1) == 45.9
    assert d.in_flight == approx(100 * d.e2e_s)
    assert d.replicas * d.batch_size >= d.in_flight
    # The KV of 256 requests of 700 tokens fits one replica's budget.
    budget = calc.memory_budget(70e9, 80, 8, 128, 700, A100.memory_bytes, num_gpus=4)
    assert budget.max_concurrent >= 256
    # Smaller batches buy latency with GPUs.
    costs = [calc.design_deployment(100, 500, 200, step, b, gpus_per_replica=4,
                                    dollars_per_gpu_hour=2.5).num_gpus for b in (16, 64, 256)]
    assert costs == sorted(costs, reverse=True)


@pytest.mark.slow
def test_the_design_holds_in_the_simulator():
    from widgets.batching_sim import poisson_arrivals, simulate

    step = calc.StepModel.from_roofline(70e9, 2, A100.bandwidth_bytes_per_s, A100.bf16_flops, num_gpus=4)
    d = calc.design_deployment(100, 500, 200, step, 64, gpus_per_replica=4, dollars_per_gpu_hour=2.5)
    rate = 100 / d.replicas  # one replica's share of the load
    n = 300
    r = simulate([(500, 200)] * n, poisson_arrivals(n, rate, seed=1), max_num_seqs=64,
                 step_ms=step.base_s * 1e3, ms_per_token=step.per_token_s * 1e3)
    ttft = sorted(r.ttft)
    assert ttft[int(0.99 * n)] < 1.0  # the P99 target holds
    # Overload the replica (rho > 1): TTFT grows without bound.
    over = simulate([(500, 200)] * n, poisson_arrivals(n, 2 * rate / d.utilization, seed=1),
                    max_num_seqs=64, step_ms=step.base_s * 1e3, ms_per_token=step.per_token_s * 1e3)
    assert sorted(over.ttft)[int(0.99 * n)] > 5 * ttft[int(0.99 * n)]
