"""Lab 10 (from a model to a deployment): its checks fed right code and deliberately wrong
versions, the claims of "check the claim", the stubs of the released lab, the cost widget's
data function and view, the capstone's runner on a tiny random model, and the quiz bank.

Each wrong version must fail with a message that names its mistake. No real model: the
whole file runs in a few seconds.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minillm import LlamaModel, ModelConfig, calc  # noqa: E402
from quizzes import check, claims  # noqa: E402
from quizzes.checks import CheckFailed, NotImplementedYet  # noqa: E402
from quizzes.questions import answer, expected, load_bank  # noqa: E402
from widgets import cost, deploy_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


def failure(fn, student, seed, *extra) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(student, *extra, seed=seed)
    return str(info.value)


# ----------------------------------------------------------------------- cost


@pytest.mark.parametrize("seed", SEEDS)
def test_dollars_per_million_accepts_the_formula(seed, capsys):
    check.dollars_per_million(lambda p, t, u: calc.cost_per_million_tokens(p, t, u), seed=seed)
    check.dollars_per_million(lambda p, t, u: p / (t * 3600 * u) * 1e6, seed=seed)
    assert "✓ dollars_per_million: matches the reference on 4 random cases" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda p, t, u: p / (t * u) * 1e6, "tokens per SECOND"),
    (lambda p, t, u: p / (t * 3600 * u) * 1e3, "price of 1,000 tokens"),
    (lambda p, t, u: p / (t * 3600) * 1e6 * u, "Divide by it"),
    (lambda p, t, u: p / (t * 3600) * 1e6, "utilization is missing"),
])
def test_dollars_per_million_names_the_mistake(fn, words, seed):
    assert words in failure(check.dollars_per_million, fn, seed)


# ----------------------------------------------------------------------- claim tools


def kv_gb(L, h, d, t, b, dt):
    return 2 * L * h * d * t * b * dt / 1e9


@pytest.mark.parametrize("seed", SEEDS)
def test_kv_cache_gb_accepts_the_formula(seed):
    check.kv_cache_gb(kv_gb, seed=seed)
    check.kv_cache_gb(lambda L, h, d, t, b, dt: calc.kv_cache_bytes(L, h, d, t, dt, b) / calc.GB, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda L, h, d, t, b, dt: 2 * L * h * d * t * b * dt / 2**30, "that is GiB"),
    (lambda L, h, d, t, b, dt: L * h * d * t * b * dt / 1e9, "factor 2 for K and V is missing"),
    (lambda L, h, d, t, b, dt: L * h * d * t * b * dt / 2**30, "two slips"),
    (lambda L, h, d, t, b, dt: 2 * L * h * d * t * dt / 1e9, "that is one sequence"),
    (lambda L, h, d, t, b, dt: 2 * L * h * d * t * b * dt, "that is bytes"),
])
def test_kv_cache_gb_names_the_mistake(fn, words, seed):
    assert words in failure(check.kv_cache_gb, fn, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_tokens_per_pass_accepts_the_sum(seed):
    check.tokens_per_pass(lambda a, k: sum(a ** i for i in range(k + 1)), seed=seed)
    check.tokens_per_pass(calc.spec_expected_tokens, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda a, k: k * a + 1, "k·α + 1 counts every guess"),
    (lambda a, k: k * a, "k·α forgets"),
    (lambda a, k: sum(a ** i for i in range(1, k + 1)), "target's own token is missing"),
    (lambda a, k: (1 - a ** k) / (1 - a), "one term short"),
])
def test_tokens_per_pass_names_the_mistake(fn, words, seed):
    assert words in failure(check.tokens_per_pass, fn, seed)


def ring(m, n, q):
    return 2 * (n - 1) / n * m / (q / 2)


@pytest.mark.parametrize("seed", SEEDS)
def test_allreduce_seconds_accepts_the_formula(seed):
    check.allreduce_seconds(ring, seed=seed)
    check.allreduce_seconds(lambda m, n, q: calc.allreduce_time_s(m, n, q / 2), seed=seed)


@pytest.mark.parametrize("fn, words", [
    (lambda m, n, q: 2 * (n - 1) / n * m / q, "counts both directions"),
    (lambda m, n, q: m / (q / 2), "the ring factor is missing"),
    (lambda m, n, q: m / q, "two slips"),
])
def test_allreduce_seconds_names_the_mistake(fn, words):
    # Seeds whose cases include more than 2 GPUs (at N = 2 the ring factor is 1).
    messages = [failure(check.allreduce_seconds, fn, seed) for seed in (0, 1, 2, 3)]
    assert any(words in m for m in messages), messages


# ----------------------------------------------------------------------- design


def replicas(lam, e2e, b, work, rho):
    return max(math.ceil(lam * e2e / b), math.ceil(lam * work / rho))


@pytest.mark.parametrize("seed", SEEDS)
def test_replicas_needed_accepts_both_bounds(seed, capsys):
    check.replicas_needed(replicas, seed=seed)
    assert "✓ replicas_needed" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda lam, e2e, b, w, rho: math.ceil(lam * e2e / b), "Little's law alone"),
    (lambda lam, e2e, b, w, rho: math.ceil(lam * w / rho), "the utilization bound alone"),
    (lambda lam, e2e, b, w, rho: max(math.floor(lam * e2e / b), math.floor(lam * w / rho)), "rounded down"),
    (lambda lam, e2e, b, w, rho: lam * e2e / b, "round UP to an integer"),
])
def test_replicas_needed_names_the_mistake(fn, words, seed):
    assert words in failure(check.replicas_needed, fn, seed)


def test_the_design_exercise_agrees_with_calc():
    a100 = __import__("minillm.hardware", fromlist=["get"]).get("A100-80GB")
    step = calc.StepModel.from_roofline(70e9, 2, a100.bandwidth_bytes_per_s, a100.bf16_flops, 4)
    for b in (16, 64, 256):
        d = calc.design_deployment(100, 500, 200, step, b, gpus_per_replica=4)
        work = calc.replica_seconds_per_request(step, 500, 200, b)
        assert replicas(100, d.e2e_s, b, work, 0.8) == d.replicas


# ----------------------------------------------------------------------- the claims


def test_the_claims_are_the_issue_s():
    values = {c.id: c.value() for c in claims.CLAIMS}
    truth = claims.truth()
    assert round(values["gpt3_kv"]) == 309 and not truth["gpt3_kv"]
    assert round(values["spec_speedup"], 2) == 2.18 and not truth["spec_speedup"]
    assert values["h100_peak"] == 989 and not truth["h100_peak"]
    assert round(values["llama3_kv_128k"], 1) == 17.2 and not truth["llama3_kv_128k"]
    assert values["kv_exceeds_int4"] < 1 and not truth["kv_exceeds_int4"]
    assert values["int4_4x_requests"] == 2.25 and not truth["int4_4x_requests"]
    assert values["tp_allreduces"] == 2 and not truth["tp_allreduces"]
    assert values["nvlink_900"] == 450 and not truth["nvlink_900"]
    assert round(values["w4a16_4x"], 2) == 3.88 and not truth["w4a16_4x"]
    right = {i for i, t in truth.items() if t}
    assert right == {"llama70b_weights", "a100_cost", "llama70b_kv_4k", "pp_bubble", "gqa_llama3"}


def test_claim_verdicts_accepts_the_truth_and_names_each_wrong_verdict(capsys):
    check.claim_verdicts(claims.truth)
    assert "✓ claim_verdicts: every verdict agrees with calc" in capsys.readouterr().out
    flipped = {**claims.truth(), "gpt3_kv": True, "nvlink_900": True}
    msg = failure(check.claim_verdicts, lambda: flipped, 0)
    assert "2 of 14 verdicts disagree" in msg
    assert "309.2 GB" in msg and "forgets the batch" in msg and "both directions" in msg
    assert "no verdict yet" in failure(check.claim_verdicts, lambda: {"gpt3_kv": False}, 0)
    assert "unknown claim ids ['gpt4']" in failure(check.claim_verdicts, lambda: {"gpt4": True}, 0)
    assert "True or False" in failure(check.claim_verdicts, lambda: {**claims.truth(), "gpt3_kv": "no"}, 0)
    lines = claims.verdict_lines(flipped)
    assert len(lines) == len(claims.CLAIMS)
    assert lines[1].startswith("✗ gpt3_kv") and "you: right" in lines[1] and "calc: wrong" in lines[1]


# ----------------------------------------------------------------------- the capstone


class FakeCapstone:
    kl_budget = 0.05

    def kl(self, weights):
        return {"fp32": 0.0, "int8": 0.001, "int4": 0.4}[weights]


def test_capstone_check():
    D = deploy_runs.Deployment
    check.capstone_deployment(lambda: D(max_num_seqs=16), FakeCapstone())
    check.capstone_deployment(lambda: D(weights="int8"), FakeCapstone())
    assert "over the budget" in failure(check.capstone_deployment, lambda: D(weights="int4"), 0, FakeCapstone())
    assert "that is the defaults" in failure(check.capstone_deployment, lambda: D(), 0, FakeCapstone())
    assert "return a Deployment" in failure(check.capstone_deployment, lambda: {"weights": "fp32"}, 0,
                                            FakeCapstone())


def test_deployment_rejects_bad_choices():
    with pytest.raises(ValueError, match="weights must be one of"):
        deploy_runs.Deployment(weights="int3")
    with pytest.raises(ValueError, match="max_num_seqs"):
        deploy_runs.Deployment(max_num_seqs=0)
    with pytest.raises(ValueError, match="spec_k"):
        deploy_runs.Deployment(spec_k=-1)


def test_capstone_workload_shares_one_system_prompt():
    reqs = deploy_runs.capstone_requests(49152, num_requests=5, max_output=8, system_tokens=20)
    assert len(reqs) == 5
    assert len({tuple(p[:20]) for p, _ in reqs}) == 1  # one shared system prompt
    assert len({tuple(p[20:]) for p, _ in reqs}) == 5  # distinct questions
    assert all(n <= 8 for _, n in reqs)


@pytest.fixture(scope="module")
def tiny():
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()


def test_runs_on_a_tiny_model_give_the_same_tokens_and_rank(tiny):
    import torch

    g = torch.Generator().manual_seed(0)
    reqs = [(torch.randint(3, 128, (int(n),), generator=g).tolist(), 6) for n in (5, 9, 14, 7)]
    cap = deploy_runs.Capstone(tiny, None, reqs)
    D = deploy_runs.Deployment
    base = cap.run(D())
    for d in (D(max_num_seqs=2), D(enable_prefix_caching=False, max_num_batched_tokens=16), D(spec_k=3)):
        r = cap.run(d)
        assert r.same_tokens, d.label()  # batching and speculation never change greedy tokens
        assert r.output_tokens == 4 * 6 and len(r.ttft_s) == 4
    assert base.same_tokens and base.throughput > 0 and base.p99_ttft_s() > 0
    board = cap.leaderboard()
    assert len(board) == 1 + 4 + 1
    assert sum(line.startswith("·") for line in board[1:-1]) == 1  # the defaults, marked
    speeds = [float(line[2:10]) for line in board[1:-1]]
    assert speeds == sorted(speeds, reverse=True)


# ----------------------------------------------------------------------- the released stubs


def test_every_stub_reports_not_implemented():
    import nbformat

    from quizzes.release import build_lab, tag_value

    name = "10-capstone.ipynb"
    lab = build_lab(nbformat.read(ROOT / "solutions" / name, as_version=4), name)
    cells = {tag_value(c, "exercise"): c.source for c in lab.cells if tag_value(c, "exercise")}
    assert set(cells) == {"dollars_per_million", "replicas_needed", "kv_cache_gb", "tokens_per_pass",
                          "allreduce_seconds", "claim_verdicts", "capstone"}
    ns = {"math": math, "deploy_runs": deploy_runs}
    for src in cells.values():
        exec(src, ns)
    fns = {"dollars_per_million": "dollars_per_million", "replicas_needed": "replicas_needed",
           "kv_cache_gb": "kv_cache_gb", "tokens_per_pass": "tokens_per_pass",
           "allreduce_seconds": "allreduce_seconds", "claim_verdicts": "claim_verdicts"}
    for cid, fn in fns.items():
        with pytest.raises(NotImplementedYet, match=f"✗ {cid}: not implemented yet") as info:
            getattr(check, cid)(ns[fn])
        assert "Hint: " in str(info.value)
    with pytest.raises(NotImplementedYet, match="capstone_deployment: not implemented yet"):
        check.capstone_deployment(ns["my_deployment"], FakeCapstone())


# ----------------------------------------------------------------------- the cost widget


def test_cost_data_is_calc():
    d = cost.cost_data(70, "A100-80GB", utilization=0.5, tokens_per_s=800, target_tokens_per_s=20_000,
                       api_dollars_per_million=2.0)
    assert d.dollars_per_hour == 2.50  # the catalog's price
    assert d.dollars_per_million == pytest.approx(calc.cost_per_million_tokens(2.5, 800, 0.5))
    assert (d.gpus_per_replica, d.gpus_for_load, d.gpus_needed) == (4, 25, 28)
    assert d.dollars_per_month == 28 * 2.5 * 730
    assert d.break_even_tokens_per_month == pytest.approx(calc.break_even_tokens_per_month(28 * 2.5 * 730, 2.0))
    assert d.break_even_utilization == pytest.approx(calc.break_even_utilization(2.5, 800, 2.0))
    assert d.curve[-1] == pytest.approx(calc.cost_per_million_tokens(2.5, 800))
    assert "renting wins above 43% utilization" in d.summary[2]
    cheap_api = cost.cost_data(api_dollars_per_million=0.5)
    assert "the API wins even at full load" in cheap_api.summary[2]
    assert cost.gpus_per_replica(0.135, "A10") == 1
    assert cost.gpus_per_replica(70, "H200") == 2
    with pytest.raises(ValueError, match="does not fit"):
        cost.gpus_per_replica(1e4, "A10")


def test_cost_view_reacts_and_reports_bad_input():
    v = cost.view()
    before, renders = v.data.summary[0], v.renders
    v.controls["utilization"].value = 0.9
    assert v.renders == renders + 1 and v.data.summary[0] != before
    assert "90% utilization" in v.summary.value
    v.controls["gpu"].value = "H100-SXM"
    assert v.controls["price"].value == 3.0 and v.data.dollars_per_hour == 3.0
    v.controls["tokens_per_s"].value = 0
    assert "must be > 0" in v.error
    assert v.png.startswith(b"\x89PNG")


# ----------------------------------------------------------------------- the quiz


def test_bank_accepts_its_computed_answers():
    bank = load_bank("lab10")
    assert len(bank.questions) >= 15
    for qid, q in bank.questions.items():
        m = getattr(q, "example_measured", None) or None
        got = expected(f"lab10.{qid}", m)
        assert answer(f"lab10.{qid}", got if isinstance(got, str) else f"{got}", m).correct, qid


def test_bank_numbers_are_the_books():
    assert expected("lab10.q2") == pytest.approx(2.17, abs=0.005)
    assert expected("lab10.q3") == pytest.approx(43.4, abs=0.05)
    assert expected("lab10.q4") == 2
    assert expected("lab10.q5") == 48
    assert expected("lab10.q6") == 26
    assert expected("lab10.q7") == pytest.approx(14.29, abs=0.005)
    assert expected("lab10.q9") == 0.5
    assert expected("lab10.q11") == pytest.approx(27.27, abs=0.01)
    assert not answer("lab10.q15", "1.0 GB").correct  # GiB read as GB


def test_measured_cost_question_predicts_within_20_percent():
    q = load_bank("lab10").questions["q1"]
    assert q.needs == ("smollm_tok_s", "dollars_per_hour") and q.rtol <= 0.2
    m = {"smollm_tok_s": 40.0, "dollars_per_hour": 0.10}
    right = calc.cost_per_million_tokens(0.10, 40.0)
    assert answer("lab10.q1", f"${right * 1.15:.4f}", m).correct
    assert not answer("lab10.q1", f"${right * 1.3:.4f}", m).correct
    assert not answer("lab10.q1", "$0.87", m).correct  # the A100's figure, not this machine's
