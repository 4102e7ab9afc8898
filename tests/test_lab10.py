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
    (lambda p, t, u: p / (t * 3600) * 1e6 * u, "on the wrong side"),
    (lambda p, t, u: p / (t * 3600) * 1e6, "utilization is missing"),
])
def test_dollars_per_million_names_the_mistake(fn, words, seed):
    assert words in failure(check.dollars_per_million, fn, seed)


# ----------------------------------------------------------------------- claim tools


def kv_gb(L, h, d, t, b, dt, shared_prefix=0):
    return 2 * L * h * d * (shared_prefix + b * (t - shared_prefix)) * dt / 1e9


@pytest.mark.parametrize("seed", SEEDS)
def test_kv_cache_gb_accepts_the_formula(seed):
    check.kv_cache_gb(kv_gb, seed=seed)
    check.kv_cache_gb(lambda L, h, d, t, b, dt, shared_prefix=0: calc.kv_cache_bytes(
        L, h, d, shared_prefix + b * (t - shared_prefix), dt) / calc.GB, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda L, h, d, t, b, dt, shared_prefix=0: kv_gb(L, h, d, t, b, dt, shared_prefix) * 1e9 / 2**30, "that is GiB"),
    (lambda L, h, d, t, b, dt, shared_prefix=0: kv_gb(L, h, d, t, b, dt, shared_prefix) / 2, "K and V"),
    (lambda L, h, d, t, b, dt, shared_prefix=0: kv_gb(L, h, d, t, b, dt), "once per sequence"),
    (lambda L, h, d, t, b, dt, shared_prefix=0: 2 * L * h * d * b * (t - shared_prefix) * dt / 1e9,
     "the shared prefix itself is missing"),
    (lambda L, h, d, t, b, dt, shared_prefix=0: kv_gb(L, h, d, t, b, dt, shared_prefix) * 1e9, "that is bytes"),
    (lambda L, h, d, t, b, dt: kv_gb(L, h, d, t, b, dt), "shared_prefix"),  # the old signature
])
def test_kv_cache_gb_names_the_mistake(fn, words, seed):
    assert words in failure(check.kv_cache_gb, fn, seed)


def expectation(alphas):  # the sum over k of P(the first k guesses are all accepted)
    total, p = 1.0, 1.0
    for a in alphas:
        p *= a
        total += p
    return total


@pytest.mark.parametrize("seed", SEEDS)
def test_tokens_per_pass_accepts_the_sum(seed):
    check.tokens_per_pass(expectation, seed=seed)
    check.tokens_per_pass(lambda alphas: 1 + sum(math.prod(alphas[:i + 1]) for i in range(len(alphas))), seed=seed)


def test_the_reference_is_the_closed_form_at_constant_alpha():
    from quizzes.checks.lab10 import reference_tokens_per_pass

    for a, k in ((0.7, 5), (0.35, 1), (0.95, 9), (1.0, 4), (0.0, 3)):
        assert reference_tokens_per_pass([a] * k) == pytest.approx(calc.spec_expected_tokens(a, k))
    assert reference_tokens_per_pass([0.9, 0.5]) == pytest.approx(1 + 0.9 + 0.45)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda alphas: sum(alphas) + 1, "counted every guess as kept"),
    (lambda alphas: sum(alphas), "two slips"),
    (lambda alphas: expectation(alphas) - 1, "target's own token is missing"),
    (lambda alphas: expectation(alphas[:-1]), "one term short"),
    (lambda alphas: calc.spec_expected_tokens(sum(alphas) / len(alphas), len(alphas)), "mean acceptance"),
])
def test_tokens_per_pass_names_the_mistake(fn, words, seed):
    msgs = [failure(check.tokens_per_pass, fn, s) for s in (seed, seed + 10)]
    assert any(words in m for m in msgs), msgs


def ring(m, n, q, lat):
    return 2 * (n - 1) * (lat + m / n / (q / 2))


@pytest.mark.parametrize("seed", SEEDS)
def test_allreduce_seconds_accepts_the_formula(seed):
    check.allreduce_seconds(ring, seed=seed)
    check.allreduce_seconds(lambda m, n, q, lat: calc.allreduce_time_s(m, n, q / 2, lat), seed=seed)


@pytest.mark.parametrize("fn, words", [
    (lambda m, n, q, lat: 2 * (n - 1) * (lat + m / n / q), "counts both directions"),
    (lambda m, n, q, lat: calc.allreduce_time_s(m, n, q / 2), "the latency is missing"),
    (lambda m, n, q, lat: calc.allreduce_time_s(m, n, q / 2) + lat, "once per ring step"),
    (lambda m, n, q, lat: calc.allreduce_time_s(m, n, q / 2) + (n - 1) * lat, "two phases"),
    (lambda m, n, q, lat: m / (q / 2) + 2 * (n - 1) * lat, "the bytes are off"),
])
def test_allreduce_seconds_names_the_mistake(fn, words):
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


def test_replicas_needed_tells_the_two_bounds_apart_whatever_the_seed():
    # Cases 0 and 1 hold at least 4 batches in flight, so Little's law alone fails case 1
    # and the utilization bound alone fails case 0 on every seed (a fresh seed once drew a
    # rate so low that both bounds were 1 replica, and a half-solved lab passed).
    little = lambda lam, e2e, b, w, rho: math.ceil(lam * e2e / b)  # noqa: E731
    utilization = lambda lam, e2e, b, w, rho: math.ceil(lam * w / rho)  # noqa: E731
    for seed in range(0, 4000, 10):
        with pytest.raises(CheckFailed, match="case 2 of 2"):
            check.replicas_needed(little, seed=seed, cases=2)
        with pytest.raises(CheckFailed, match="case 1 of 2"):
            check.replicas_needed(utilization, seed=seed, cases=2)


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
    out = capsys.readouterr().out
    assert "✓ claim_verdicts: every verdict agrees with calc" in out
    assert "309.2 GB" in out and "forgets the batch" in out  # the values and slips, once all are right
    flipped = {**claims.truth(), "gpt3_kv": True, "nvlink_900": True, "pp_bubble": False}
    msg = failure(check.claim_verdicts, lambda: flipped, 0)
    assert "3 of 14 verdicts disagree" in msg
    assert "gpt3_kv: you say right" in msg and "nvlink_900: you say right" in msg
    assert "pp_bubble: you say wrong" in msg and "llama70b_weights" not in msg
    assert "no verdict yet" in failure(check.claim_verdicts, lambda: {"gpt3_kv": False}, 0)
    assert "unknown claim ids ['gpt4']" in failure(check.claim_verdicts, lambda: {"gpt4": True}, 0)
    assert "True or False" in failure(check.claim_verdicts, lambda: {**claims.truth(), "gpt3_kv": "no"}, 0)
    lines = claims.verdict_lines(flipped)
    assert len(lines) == len(claims.CLAIMS)
    assert lines[1].startswith("✗ gpt3_kv") and "you: right" in lines[1] and "calc: wrong" in lines[1]


def computed_values_as_text() -> set[str]:
    """Every way the claims' computed values are written (as `shown` and the lessons print them)."""
    out = set()
    for c in claims.CLAIMS:
        v = c.value()
        out |= {f"{v:.4g}", f"{v:.3g}", f"{v:.1f}", f"{v:g}"}
    return {t for t in out if t not in {"1", "2", "4", "0"}}  # bare digits appear in any text


@pytest.mark.parametrize("wrong", [
    {"gpt3_kv": True},
    {c.id: not claims.truth()[c.id] for c in claims.CLAIMS},   # every verdict wrong
    {"h100_peak": True, "llama3_kv_128k": True, "w4a16_4x": True, "pp_bubble": False},
])
def test_the_verdict_check_never_prints_calcs_values_on_a_wrong_submission(wrong, capsys):
    verdicts = {**claims.truth(), **wrong}
    msg = failure(check.claim_verdicts, lambda: verdicts, 0) + capsys.readouterr().out
    shown = sorted(t for t in computed_values_as_text() if t in msg)
    assert not shown, f"the failure output shows calc's values {shown}:\n{msg}"
    assert all(f"{cid}: you say" in msg for cid in wrong)


# ----------------------------------------------------------------------- the capstone


class FakeCapstone:
    """The capstone's interface without a model: fixed KLs and fixed throughputs."""
    kl_budget, min_gain, repeats = 0.05, 0.05, 2

    def __init__(self, speed=None):
        self.speed = speed or {}

    def kl(self, weights):
        return {"fp32": 0.0, "int8": 0.001, "int4": 0.4, "bf16": 0.0001}[weights]

    def compare(self, d, baseline=deploy_runs.Deployment()):
        run = lambda dep: type("R", (), {"throughput": self.speed.get(dep, 50.0)})()  # noqa: E731
        return run(d), run(baseline)


def test_capstone_check_requires_a_measured_gain_within_the_kl_budget(capsys):
    D = deploy_runs.Deployment
    fast = FakeCapstone({D(weights="int8"): 80.0, D(max_num_seqs=16): 51.0})
    check.capstone_deployment(lambda: D(weights="int8"), fast)
    assert "1.60×" in capsys.readouterr().out
    msg = failure(check.capstone_deployment, lambda: D(max_num_seqs=16), 0, fast)
    assert "1.02×" in msg and "at least 1.05×" in msg  # measured, not enough
    assert "over the budget" in failure(check.capstone_deployment, lambda: D(weights="int4"), 0, fast)
    assert "that is the defaults" in failure(check.capstone_deployment, lambda: D(), 0, fast)
    assert "return a Deployment" in failure(check.capstone_deployment, lambda: {"weights": "fp32"}, 0, fast)


def test_deployment_rejects_bad_choices():
    with pytest.raises(ValueError, match="weights must be one of"):
        deploy_runs.Deployment(weights="int3")
    with pytest.raises(ValueError, match="max_num_seqs"):
        deploy_runs.Deployment(max_num_seqs=0)
    with pytest.raises(ValueError, match="spec_k"):
        deploy_runs.Deployment(spec_k=-1)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be an int >= 1 or None"):
        deploy_runs.Deployment(max_num_batched_tokens=0)
    # The token budget defaults to the engine's for the device (512 on a CPU, 8192 on CUDA).
    assert deploy_runs.Deployment().max_num_batched_tokens is None
    assert "max_num_batched_tokens=default" in deploy_runs.Deployment().label()


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
    mine, defaults = cap.compare(D(max_num_seqs=2))  # alternating, best of `repeats` each
    assert mine.deployment == D(max_num_seqs=2) and defaults.deployment == D()
    assert len(cap.results) == 4 + 2 * cap.repeats
    assert "1.05×" in cap.rules() and "0.05" in cap.rules()
    cap.results = cap.results[:4]
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
    assert expected("lab10.q3") == pytest.approx(83.3, abs=0.05)
    assert expected("lab10.q4") == calc.memory_budget(70e9, 80, 8, 128, 2048, 80e9, num_gpus=4).max_concurrent
    assert expected("lab10.q5") == 72
    assert expected("lab10.q6") == 26
    assert expected("lab10.q7") == pytest.approx(14.29, abs=0.005)
    assert expected("lab10.q8") == 8
    assert expected("lab10.q9") == 0.5
    assert expected("lab10.q11") == pytest.approx(27.27, abs=0.01)
    assert not answer("lab10.q15", "1.0 GB").correct  # GiB read as GB


def test_measured_cost_question_reads_this_machines_price_and_throughput():
    q = load_bank("lab10").questions["q1"]
    assert q.needs == ("smollm_tok_s", "dollars_per_hour")
    m = {"smollm_tok_s": 40.0, "dollars_per_hour": 0.10}
    right = calc.cost_per_million_tokens(0.10, 40.0, 0.3)
    assert answer("lab10.q1", f"${right * 1.01:.4f}", m).correct
    assert not answer("lab10.q1", f"${calc.cost_per_million_tokens(0.10, 40.0):.4f}", m).correct  # always busy
    assert not answer("lab10.q1", "$0.87", m).correct  # the A100's figure, not this machine's


def test_kv_pool_bytes_is_the_formula(tiny):
    from minillm import LLMEngine

    cfg = tiny.config
    engine = LLMEngine(tiny, num_blocks=12, block_size=16)
    formula = calc.kv_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 12 * 16, 4)
    assert formula <= deploy_runs.kv_pool_bytes(engine) <= formula * 1.05  # plus the trash slot


def test_no_quiz_answer_is_printed_by_the_solution_notebook():
    from notebook_answers import printed_answers

    assert printed_answers("10-capstone.ipynb", "lab10") == {}


def test_validation_says_which_way_the_real_server_differed():
    v = deploy_runs.Validation(1.0, 0.6, {"simulator": {"e2e p50": 1.22, "ttft p99": 1.9, "tok/s": 5},
                                          "real server": {"e2e p50": 0.67, "ttft p99": 2.1, "tok/s": 6}})
    text = v.verdict()
    assert "median e2e 0.67 s against 1.22 s: faster" in text and "p99 TTFT 2.10 s against 1.90 s: slower" in text
