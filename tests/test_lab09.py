"""Lab 09 (serving): its checks fed right and deliberately wrong code, the stubs of the
released lab, the calc formulas it adds, the serving simulator (Little's law, p99 growing
with ρ, the step model), the measuring helpers of ``widgets.serve_runs`` (on synthetic data,
and, marked slow, against an in-process server over the real model), and the quiz bank.

Each wrong version must fail with a message that names its mistake.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minillm import calc  # noqa: E402
from minillm.serve.sse import iter_events  # noqa: E402
from quizzes import check  # noqa: E402
from quizzes.checks import CheckFailed, NotImplementedYet  # noqa: E402
from quizzes.checks.lab09 import reference_should_admit, sse_lines  # noqa: E402
from quizzes.questions import answer, expected, load_bank  # noqa: E402
from widgets import serve_runs, serving_sim  # noqa: E402
from widgets.serving_sim import StepModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


def failure(fn, student, seed) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(student, seed=seed)
    return str(info.value)


# ----------------------------------------------------------------------- exercise 1: SSE


def parse_sse(lines):
    out, data = [], []
    for line in list(lines) + [""]:
        if line == "":
            if data:
                text = "\n".join(data)
                out.append(text if text == "[DONE]" else json.loads(text))
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    return out


def no_prefix_strip(lines):
    return [json.loads(line) for line in lines if line]


def drops_done(lines):
    return [p for p in parse_sse(lines) if p != "[DONE]"]


def json_done(lines):
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def breaks_on_comment(lines):
    out = []
    for line in lines:
        if line.startswith(":"):
            break
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def slices_six(lines):
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in lines if line.startswith("data:")]


def one_line_per_event(lines):
    out = []
    for line in lines:
        if line.startswith("data:"):
            v = line[5:].removeprefix(" ")
            out.append(v if v == "[DONE]" else json.loads(v))
    return out


def stops_at_blank(lines):
    return parse_sse(lines[:lines.index("") + 1])


def ignores_fields_wrongly(lines):  # treats every "name: value" line as data
    return parse_sse(["data:" + line.partition(":")[2] if line and not line.startswith(("data", ":")) else line
                      for line in lines])


@pytest.mark.parametrize("seed", SEEDS)
def test_parse_sse_accepts_the_rule_and_the_reference(seed, capsys):
    check.parse_sse(parse_sse, seed=seed)
    check.parse_sse(lambda lines: list(iter_events(lines)), seed=seed)
    assert "✓ parse_sse: matches the reference on 4 random cases" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (no_prefix_strip, "strip them and json.loads"),
    (drops_done, "do not drop it"),
    (json_done, "which is not JSON"),
    (breaks_on_comment, "lines starting with ':' are comments"),
    (slices_six, "the space after 'data:' is optional"),
    (one_line_per_event, "may span several data: lines"),
    (stops_at_blank, "a blank line ends one event, not the stream"),
    (ignores_fields_wrongly, "only data: lines hold the payload"),
    (lambda lines: 3, "return a list"),
])
def test_parse_sse_names_the_mistake(fn, words, seed):
    msg = failure(check.parse_sse, fn, seed)
    assert words in msg, msg


def test_sse_lines_round_trip_through_the_reference():
    rng = np.random.default_rng(0)
    payloads = [{"a": "x\ny", "b": [1, 2]}, {"c": "é"}, "[DONE]"]
    for style in ({}, {"comments": True, "fields": True}, {"multiline": True, "no_space": True}):
        assert list(iter_events(sse_lines(payloads, rng=rng, **style))) == payloads


# ----------------------------------------------------------------------- exercise 2: percentile


def nearest_rank(xs, p):
    return sorted(xs)[math.ceil(p * len(xs) / 100) - 1]


@pytest.mark.parametrize("seed", SEEDS)
def test_percentile_accepts_nearest_rank(seed, capsys):
    check.percentile(nearest_rank, seed=seed)
    check.percentile(lambda xs, p: float(np.percentile(xs, p, method="inverted_cdf")), seed=seed)
    assert "✓ percentile" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda xs, p: float(np.mean(xs)), "that is the mean"),
    (lambda xs, p: xs[math.ceil(p * len(xs) / 100) - 1], "positions count in the SORTED latencies"),
    (lambda xs, p: sorted(xs)[int(p * len(xs) / 100)], "one position too high"),
    (lambda xs, p: sorted(xs)[math.ceil(p * len(xs) / 100) - 2], "one position too low"),
    (lambda xs, p: float(np.percentile(xs, p)), "you interpolated"),
    (lambda xs, p: max(xs), "that is the maximum"),
    (lambda xs, p: sorted(xs)[math.ceil(p * len(xs)) - 1], "raised IndexError"),
    (lambda xs, p: "fast", "return one number"),
])
def test_percentile_names_the_mistake(fn, words, seed):
    msg = failure(check.percentile, fn, seed)
    assert words in msg, msg


# ----------------------------------------------------------------------- exercise 3: admission


@pytest.mark.parametrize("seed", SEEDS)
def test_should_admit_accepts_the_rule(seed, capsys):
    check.should_admit(reference_should_admit, seed=seed)
    check.should_admit(lambda p, w, f, r, q, b: w < q and math.ceil(p / b) + r <= f, seed=seed)
    assert "✓ should_admit" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda p, w, f, r, q, b: w <= q and -(-p // b) <= f - r, "the queue limit is off by one"),
    (lambda p, w, f, r, q, b: w < q and p // b <= f - r, "rounded down"),
    (lambda p, w, f, r, q, b: w < q and p <= f - r, "you compared tokens with blocks"),
    (lambda p, w, f, r, q, b: w < q and -(-p // b) <= f, "those blocks are not free for it"),
    (lambda p, w, f, r, q, b: w < q and -(-p // b) < f - r, "needs exactly the blocks that are left"),
    (lambda p, w, f, r, q, b: -(-p // b) <= f - r, "the queue limit is never applied"),
    (lambda p, w, f, r, q, b: w < q, "the KV check is missing"),
    (lambda *a: not reference_should_admit(*a), "every answer is inverted"),
    (lambda *a: 1, "return True (admit) or False (shed)"),
])
def test_should_admit_names_the_mistake(fn, words, seed):
    msg = failure(check.should_admit, fn, seed)
    assert words in msg, msg


# ----------------------------------------------------------------------- the released stubs


def test_every_stub_reports_not_implemented():
    import nbformat

    from quizzes.release import build_lab, tag_value

    name = "09-serving.ipynb"
    lab = build_lab(nbformat.read(ROOT / "solutions" / name, as_version=4), name)
    cells = {tag_value(c, "exercise"): c.source for c in lab.cells if tag_value(c, "exercise")}
    assert set(cells) == {"parse_sse", "percentile", "should_admit"}
    ns = {}
    for src in cells.values():
        exec(src, ns)
    for cid in cells:
        with pytest.raises(NotImplementedYet, match=f"✗ {cid}: not implemented yet") as info:
            getattr(check, cid)(ns[cid])
        assert "Hint: " in str(info.value)


# ----------------------------------------------------------------------- calc


def test_percentile_is_nearest_rank_on_random_data():
    rng = np.random.default_rng(0)
    for n in (1, 7, 100, 333):
        xs = rng.lognormal(size=n).tolist()
        for p in (1, 50, 90, 95, 99, 99.9, 100):
            assert calc.percentile(xs, p) == float(np.percentile(xs, p, method="inverted_cdf"))
    assert calc.percentile(list(range(100, 0, -1)), 99) == 99
    with pytest.raises(ValueError, match="99 for p99, not 0.99"):
        calc.percentile([1.0, 2.0], 990)
    with pytest.raises(ValueError, match="non-empty list"):
        calc.percentile([], 50)


def test_mm1_percentile_and_the_m_m_1_style_curve():
    # M/M/1 time in system is exponential with rate μ − λ: check against sampled times.
    rng = np.random.default_rng(1)
    sample = rng.exponential(1 / (10 - 8), 200_000)
    assert calc.mm1_latency_percentile(8, 10, 99) == pytest.approx(np.quantile(sample, 0.99), rel=0.03)
    assert calc.mm1_latency_percentile(8, 10, 99) == pytest.approx(math.log(100) / 2)
    assert calc.queueing_latency_s(1 / 10, 8, 10) == pytest.approx(calc.mm1_mean_latency(8, 10))
    assert calc.queueing_latency_s(0.5, 9, 10) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="ρ = 1.2 >= 1"):
        calc.queueing_latency_s(0.5, 12, 10)


def test_replicas_by_littles_law():
    assert calc.replicas_needed(50, 4, 32) == 7            # 200 in flight / 32
    assert calc.replicas_needed(50, 4, 32, 0.8) == 8       # 7.8 -> 8
    assert calc.replicas_needed(8, 4, 32) == 1
    assert calc.replicas_needed(32, 1, 32) == 1            # exactly full: no rounding up
    with pytest.raises(ValueError, match="max_utilization"):
        calc.replicas_needed(1, 1, 1, 1.5)


def test_transfer_lora_and_fragmentation():
    kv = calc.kv_cache_bytes_per_token(80, 8, 128, 2)
    assert calc.kv_transfer_time_s(4096, kv, 50e9) == pytest.approx(0.02684, rel=1e-3)
    shapes = [(576, 576), (576, 192), (576, 192), (576, 576)]
    import torch

    rank = 16  # count the parameters of real A (r × d_in) and B (d_out × r) matrices
    params = sum(torch.empty(rank, i).numel() + torch.empty(o, rank).numel() for i, o in shapes)
    assert calc.lora_adapter_bytes(30, rank, shapes, 4) == 30 * params * 4
    with pytest.raises(ValueError, match=r"matrix_shapes\[1\]"):
        calc.lora_adapter_bytes(30, 16, [(576, 576), 576], 4)
    assert calc.kv_fragmentation(1000, 80, 16) == pytest.approx(0.21875)
    assert calc.kv_fragmentation(0, 0, 16) == 0.0
    with pytest.raises(ValueError, match="cannot fit"):
        calc.kv_fragmentation(100, 2, 16)


# ----------------------------------------------------------------------- the simulator

MODEL = StepModel(20.0, 1.0)


def test_step_model_fit_recovers_a_line():
    rng = np.random.default_rng(0)
    tokens = np.array([1, 4, 8, 32, 128, 1, 8, 128])
    seconds = (25 + 1.5 * tokens) * (1 + rng.normal(0, 0.01, tokens.size)) / 1e3
    fit = StepModel.fit(tokens, seconds)
    assert fit.base_ms == pytest.approx(25, rel=0.1) and fit.ms_per_token == pytest.approx(1.5, rel=0.05)
    with pytest.raises(ValueError, match="at least two sizes"):
        StepModel.fit([8, 8], [0.1, 0.1])
    with pytest.raises(ValueError, match="base_ms > 0"):
        StepModel(0, 1)


def test_service_rate_is_the_saturated_throughput():
    from widgets.batching_sim import simulate

    for model, b in ((MODEL, 8), (StepModel(40, 0.2), 4)):
        r = simulate([(32, 16)] * 96, None, max_num_seqs=b, step_ms=model.base_ms, ms_per_token=model.ms_per_token)
        assert 96 / r.makespan == pytest.approx(model.service_rate(b, 32, 16), rel=0.02)


@pytest.mark.parametrize("rate, replicas", [(2.0, 1), (12.0, 1), (20.0, 3)])
def test_simulator_obeys_littles_law_and_counts_every_gap(rate, replicas):
    d = serving_sim.serving_sim_data(rate, 8, MODEL, replicas=replicas, num_requests=150, prompt_len=24,
                                     output_len=12, seed=3)
    # L (time-average number in the system, integrated from the arrival/finish events)
    # equals the completion rate times the mean time in the system, over the same window.
    assert d.mean_in_system == pytest.approx(d.throughput * np.mean(d.e2e), rel=1e-9)
    assert len(d.itl) == 150 * (12 - 1)
    assert len(d.ttft) == len(d.e2e) == 150
    assert all(e >= t for t, e in zip(sorted(d.ttft), sorted(d.e2e)))
    assert (d.running <= 8).all() and (d.queue_len >= 0).all()
    assert d.ttft_p[50] <= d.ttft_p[95] <= d.ttft_p[99]
    assert d.rho == pytest.approx(rate / (replicas * MODEL.service_rate(8, 24, 12)))


def test_p99_grows_with_rho_and_the_queue_appears_past_capacity():
    mu = MODEL.service_rate(8, 32, 16)
    runs = [serving_sim.serving_sim_data(f * mu, 8, MODEL, num_requests=300, prompt_len=32, seed=5)
            for f in (0.2, 0.5, 0.8, 1.1, 1.4)]
    p99 = [d.e2e_p[99] for d in runs]
    assert all(a < b for a, b in zip(p99, p99[1:])), p99
    assert runs[0].queue_len.max() <= 1 and runs[-1].queue_len.max() > 20
    assert p99[-1] > 3 * p99[0]
    # more replicas at the same total rate: the queue goes away
    spread = serving_sim.serving_sim_data(1.4 * mu, 8, MODEL, replicas=3, num_requests=300, prompt_len=32, seed=5)
    assert spread.e2e_p[99] < p99[-1] / 2


def test_simulator_is_deterministic_and_checks_its_arguments():
    a = serving_sim.serving_sim_data(5, 4, MODEL, num_requests=40, seed=2)
    b = serving_sim.serving_sim_data(5, 4, MODEL, num_requests=40, seed=2)
    assert a.e2e == b.e2e and a.itl == b.itl and (a.queue_len == b.queue_len).all()
    assert 0 <= a.fragmentation.min() and a.fragmentation.max() < 1
    with pytest.raises(ValueError, match="at least one request per replica"):
        serving_sim.serving_sim_data(5, 4, MODEL, replicas=3, num_requests=2)


def test_load_curve_and_the_view():
    curve = serving_sim.sim_load_curve([2, 8, 14], 8, MODEL, num_requests=60)
    assert curve.p99_e2e[0] < curve.p99_e2e[-1]
    view = serving_sim.view(step_model=MODEL, arrival_rate=4, max_num_seqs=4)
    first = view.data.e2e_p[99]
    view.controls["arrival_rate"].value = 32
    assert view.renders == 2 and view.data.e2e_p[99] > first and view.png
    view.controls["replicas"].value = 8
    assert view.data.replicas == 8 and view.error is None
    view.controls["base_ms"].value = 0  # rejected by StepModel: the view says so, keeps the plot
    assert "base_ms > 0" in view.error and view.renders == 3


# ----------------------------------------------------------------------- measuring helpers


def test_knee_rate_interpolates_in_log_latency():
    rates, p99 = [1, 2, 3, 4], [1.0, 1.2, 4.0, 9.0]
    k = serve_runs.knee_rate(rates, p99, 2.0)
    assert 2 < k < 3
    assert k == pytest.approx(2 + math.log(2 / 1.2) / math.log(4 / 1.2))
    assert serve_runs.knee_rate(rates, p99, 0.5) == 1
    assert serve_runs.knee_rate(rates, p99, 50) == 4
    assert serve_runs.knee_rate(rates[::-1], p99[::-1], 2.0) == k


def test_service_rate_counts_only_the_full_server():
    reply = lambda done, status=200: serve_runs.Reply(status, None, 0.0, done, 16, None)  # noqa: E731
    # 4 slots, 16 completed: from the 4th completion (1.5 s) to the 12th (6 s), 8 in 4.5 s.
    replies = [reply(t) for t in (1, 1, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 9, 10)] + [reply(0.1, 503)]
    assert serve_runs.service_rate(replies, 4) == pytest.approx(8 / (6 - 1.5))
    with pytest.raises(ValueError, match="too small"):
        serve_runs.service_rate(replies[:8], 4)


def test_helpers_refuse_a_non_loopback_url():
    with pytest.raises(ValueError, match="only targets loopback"):
        serve_runs.burst("http://example.com:8000", [[5, 6]])
    with pytest.raises(ValueError, match="at least one prompt"):
        serve_runs.burst("http://127.0.0.1:9", [])


@pytest.mark.slow
def test_stream_burst_and_metrics_against_a_real_server(smollm):
    from serve_utils import start_server

    from minillm import serve

    srv, _ = start_server(smollm, max_num_seqs=2, max_queue_len=2, num_blocks=64)
    try:
        timing = serve_runs.stream_completion(srv.url, "Say hello.", max_tokens=8)
        assert timing.usage["completion_tokens"] == len(timing.pieces) or timing.finish_reason == "stop"
        assert 0 < timing.ttft_s <= timing.e2e_s and len(timing.itl_s) == len(timing.pieces) - 1
        assert list(iter_events(timing.lines))[-1] == "[DONE]"
        # k tokens per SSE event (what sse_buffering streams): the same greedy text in fewer
        # events; the first token goes at once (time to first token), then 5 at a time: at
        # most 1 + ceil(11 / 5) = 4 events carry text (a token may carry none alone)
        one = serve_runs._greedy_stream(srv.url, "Count to ten.", 12, 1, 60)
        five = serve_runs._greedy_stream(srv.url, "Count to ten.", 12, 5, 60)
        assert five.text == one.text and len(five.pieces) <= 4 < len(one.pieces)
        assert one.usage["completion_tokens"] == five.usage["completion_tokens"] == 12
        replies = serve_runs.burst(srv.url, [list(range(5 + i, 37 + i)) for i in range(12)], max_tokens=4)
        assert {r.status for r in replies} == {200, 503}
        assert all(r.retry_after for r in replies if r.status == 503)
        assert all(r.completion_tokens == 4 for r in replies if r.status == 200)
        # streamed: every event read, the tokens counted from the final usage event, 503s the same
        replies = serve_runs.burst(srv.url, [list(range(40 + i, 72 + i)) for i in range(12)], max_tokens=4,
                                   stream=True)
        assert {r.status for r in replies} == {200, 503}
        assert all(r.retry_after and r.error for r in replies if r.status == 503)
        assert all(r.completion_tokens == 4 and r.done_s > r.sent_s for r in replies if r.status == 200)
        with serve_runs.MetricsWatcher(srv.url, interval_s=0.05) as watch:
            serve.run_load(srv.url, 20, 0.5, prompts=[list(range(5, 21))], max_tokens=4)
        t, running = watch.series("minillm:num_requests_running")
        assert len(t) >= 3 and running.max() >= 1
        assert watch.draw() is not None
    finally:
        srv.stop()


# ----------------------------------------------------------------------- the quiz


def test_bank_accepts_its_computed_answers():
    bank = load_bank("lab09")
    assert len(bank.questions) >= 10
    for qid, q in bank.questions.items():
        m = getattr(q, "example_measured", None) or None
        got = expected(f"lab09.{qid}", m)
        assert answer(f"lab09.{qid}", got if isinstance(got, str) else f"{got}", m).correct, qid


def test_bank_numbers_and_the_measured_knee():
    assert expected("lab09.q1") == 7
    assert expected("lab09.q2") == pytest.approx(5.0)
    assert expected("lab09.q4") == pytest.approx(2.303, abs=1e-3)
    assert expected("lab09.q9") == pytest.approx(42.9, abs=0.1)
    assert expected("lab09.q10") == pytest.approx(2.74, abs=0.01)
    assert expected("lab09.q11") == pytest.approx(0.125, abs=1e-3)
    assert expected("lab09.q15") == 7
    assert not answer("lab09.q1", "6").correct  # 6.25 rounded down: not enough replicas
    m = {"overload_completed_rate": 4.0}
    assert answer("lab09.q3", "4.5 req/s", m).correct and answer("lab09.q3", "3.3", m).correct
    # 1 / unloaded latency, the mistake of ignoring the batch: wildly wrong
    assert not answer("lab09.q3", "0.9", m).correct
    assert not answer("lab09.q3", "5.2", m).correct
    assert not answer("lab09.q3", "6.0", m).correct  # 1.5 μ: capacity forgotten
    m = {"unloaded_latency_ms": 450.0}
    assert answer("lab09.q12", "0.5 s", m).correct and not answer("lab09.q12", "30 ms", m).correct


def test_no_quiz_answer_is_printed_by_the_solution_notebook():
    """A question that is not a prediction must not be answerable by copying a printed value
    (counts, whose small integers appear everywhere, are left out)."""
    from notebook_answers import printed_answers

    assert printed_answers("09-serving.ipynb", "lab09") == {}
