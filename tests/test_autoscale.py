"""The scale rule on queue depth (`minillm.serve.autoscale`) and the fleet simulator that tests
it (`widgets.autoscale_sim`): the rule's formula and stabilization window on hand-made
readings; the fleet simulator against Lab 05's single-replica simulator (the plain
reference); and the rule against a fixed fleet under a surge of load."""
from __future__ import annotations

import math

import numpy as np
import pytest

from minillm.serve.autoscale import ScaleRule
from widgets.autoscale_sim import piecewise_poisson, simulate_fleet
from widgets.batching_sim import simulate
from widgets.serving_sim import StepModel

STEP = StepModel(20.0, 1.0)   # ms: capacity of 8 slots, 32 + 16 tokens ≈ 7.6 req/s


def test_recommend_is_the_hpa_formula_clamped_with_a_tolerance():
    rule = ScaleRule(target_per_replica=8, min_replicas=1, max_replicas=5, tolerance=0.1)
    assert rule.recommend(2, 16) == 2            # on target
    assert rule.recommend(2, 17.5) == 2          # within 10%
    assert rule.recommend(2, 25) == 4            # ceil(25 / 8)
    assert rule.recommend(3, 9) == 2             # ceil(9 / 8)
    assert rule.recommend(3, 0) == 1             # min
    assert rule.recommend(1, 400) == 5           # max
    with pytest.raises(ValueError, match="target_per_replica"):
        ScaleRule(target_per_replica=0)
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        ScaleRule(8, min_replicas=3, max_replicas=2)


def test_scale_up_at_once_scale_down_only_after_the_window():
    rule = ScaleRule(target_per_replica=8, min_replicas=1, max_replicas=6, scale_down_window_s=10)
    history = []
    assert rule.desired(1, 40, history, now=0.0) == 5     # a surge: up at once
    assert rule.desired(5, 8, history, now=1.0) == 5      # a lull inside the window: stay
    assert rule.desired(5, 8, history, now=9.0) == 5
    assert rule.desired(5, 8, history, now=11.5) == 1     # the surge left the window: down
    assert rule.desired(1, 7.5, history, now=12.0) == 1


def test_one_fixed_replica_is_lab05s_simulator():
    arrivals = piecewise_poisson([(5.0, 8.0)], seed=3)
    fleet = simulate_fleet(arrivals, STEP, max_num_seqs=8, prompt_len=32, output_len=16,
                           replicas=1, num_blocks=97)
    ref = simulate([(32, 16)] * len(arrivals), arrivals, max_num_seqs=8, num_blocks=97,
                   step_ms=STEP.base_ms, ms_per_token=STEP.ms_per_token)
    np.testing.assert_allclose(fleet.ttft, ref.ttft, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fleet.e2e, ref.e2e, rtol=0, atol=1e-9)


def test_piecewise_poisson_follows_its_rates():
    t = np.array(piecewise_poisson([(2.0, 100.0), (20.0, 50.0)], seed=1))
    assert np.all(np.diff(t) > 0) and t[-1] < 150
    assert abs((t < 100).sum() - 200) < 4 * math.sqrt(200)
    assert abs((t >= 100).sum() - 1000) < 4 * math.sqrt(1000)


def test_the_rule_holds_the_tail_at_a_fraction_of_the_fixed_fleets_cost():
    mu = STEP.service_rate(8, 32, 16)
    arrivals = piecewise_poisson([(0.5 * mu, 10), (2.5 * mu, 20), (0.5 * mu, 20)], seed=0)
    one = simulate_fleet(arrivals, STEP, replicas=1)
    four = simulate_fleet(arrivals, STEP, replicas=4)
    rule = ScaleRule(target_per_replica=8, min_replicas=1, max_replicas=4, scale_down_window_s=5)
    scaled = simulate_fleet(arrivals, STEP, rule=rule, startup_s=2.0)
    for r in (one, four, scaled):
        assert len(r.e2e) == len(arrivals) and all(x is not None and x > 0 for x in r.e2e)
    assert scaled.p("e2e", 99) < one.p("e2e", 99) / 3        # the surge no longer queues for long
    assert scaled.replica_seconds < 0.8 * four.replica_seconds  # and the quiet phases cost less
    assert scaled.replicas.min() >= 1 and scaled.replicas.max() <= 4
    assert scaled.replicas.max() > 1 and scaled.replicas[-1] < scaled.replicas.max()  # up, then down
    # a replica asked for takes traffic only after its start-up: ready lags asked
    first_up = int(np.argmax(scaled.replicas > 1))
    assert scaled.ready[first_up] < scaled.replicas[first_up]


def test_a_replica_is_never_sent_traffic_before_it_is_ready():
    rule = ScaleRule(target_per_replica=4, min_replicas=1, max_replicas=3, scale_down_window_s=5)
    arrivals = piecewise_poisson([(40.0, 3.0)], seed=2)
    slow = simulate_fleet(arrivals, STEP, rule=rule, startup_s=1e6)  # new replicas never get ready
    one = simulate_fleet(arrivals, STEP, replicas=1)
    np.testing.assert_allclose(slow.e2e, one.e2e, atol=1e-9)  # so everything ran on the first
    assert slow.replicas.max() == 3 and slow.ready.max() == 1
