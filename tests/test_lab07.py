"""Lab 07 (speculative decoding): its checks fed right and deliberately wrong code, the stubs
of the released lab, the measuring helpers of ``widgets.spec_runs`` on a tiny random model,
and the quiz bank. The simulator widget's tests are in test_widgets.py.

Each wrong version must fail with a message that names its mistake. No real model: the
whole file runs in a few seconds.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import minillm  # noqa: E402
from minillm import LlamaModel, ModelConfig, calc, spec  # noqa: E402
from minillm.spec.drafts import cached_logits  # noqa: E402
from quizzes import check  # noqa: E402
from quizzes.checks import CheckFailed, NotImplementedYet  # noqa: E402
from quizzes.checks.lab07 import reference_verify_step  # noqa: E402
from quizzes.questions import answer, expected, load_bank  # noqa: E402
from widgets import spec_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


def failure(fn, student, seed) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(student, seed=seed)
    return str(info.value)


@pytest.fixture(scope="module")
def tiny():
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()


# ----------------------------------------------------------------------- exercise 1: acceptance


def accept(p, q):
    return torch.clamp(p / q, max=1.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_acceptance_probability_accepts_the_rule(seed, capsys):
    check.acceptance_probability(accept, seed=seed)
    check.acceptance_probability(lambda p, q: torch.minimum(torch.ones_like(p), p / q), seed=seed)
    assert "✓ acceptance_probability: matches the reference on 4 random cases" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda p, q: p / q, "some values are above 1"),
    (lambda p, q: torch.clamp(q / p, max=1.0), "upside down"),
    (lambda p, q: torch.minimum(p, q), "once it has been proposed"),
    (lambda p, q: p, "ignores the draft"),
    (lambda p, q: torch.clamp(p / q, min=1.0), "The limit is at the top"),
    (lambda p, q: min(1, p / q), "raised RuntimeError"),
    (lambda p, q: float((p / q).clamp(max=1).mean()), "expected a tensor of shape"),
])
def test_acceptance_probability_names_the_mistake(fn, words, seed):
    msg = failure(check.acceptance_probability, fn, seed)
    assert words in msg, msg


def test_acceptance_probability_states_the_worked_example():
    """Case 1 holds p = 0.3, q = 0.6; a function wrong only there is told so in those terms."""
    def wrong_at_half(p, q):
        out = accept(p, q)
        out[0] = 0.25 if abs(float(p[0]) - 0.3) < 1e-6 else out[0]
        return out

    msg = failure(check.acceptance_probability, wrong_at_half, 0)
    assert "for p = 0.3 and q = 0.6 (element 0) you give 0.25" in msg and "kept: 0.5." in msg


# ----------------------------------------------------------------------- exercise 2: residual


def residual(p, q):
    r = (p - q).clamp(min=0)
    return r / r.sum(-1, keepdim=True)


@pytest.mark.parametrize("seed", SEEDS)
def test_residual_accepts_the_rule_and_matches_the_sampler(seed, capsys):
    check.residual_distribution(residual, seed=seed)
    assert "✓ residual_distribution" in capsys.readouterr().out


def test_accept_plus_residual_is_exactly_p():
    """The lab's table: min(p, q) + P(reject) · residual == p, for random p and q."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        p, q = (torch.randn(2, 30, generator=g, dtype=torch.float64) * 2).softmax(-1)
        beta = (q - p).clamp(min=0).sum()
        assert torch.allclose(q * accept(p, q) + beta * residual(p, q), p)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda p, q: (p - q).clamp(min=0), "not normalized"),
    (lambda p, q: residual(q, p), "the tokens the DRAFT over-proposed"),
    (lambda p, q: (p - q) / (p - q).sum(-1, keepdim=True), "negative entries"),
    (lambda p, q: p, "counts twice"),
])
def test_residual_names_the_mistake(fn, words, seed):
    msg = failure(check.residual_distribution, fn, seed)
    assert words in msg, msg


def test_residual_normalized_over_everything_is_named_on_a_2d_case():
    msg = failure(check.residual_distribution,
                  lambda p, q: (p - q).clamp(min=0) / (p - q).clamp(min=0).sum(), 0)
    assert "normalize each row" in msg, msg


# ----------------------------------------------------------------------- exercise 3: verify step


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_step_accepts_the_reference(seed, capsys):
    check.verify_step(reference_verify_step, seed=seed)
    assert "✓ verify_step: matches the reference on 4 random cases" in capsys.readouterr().out


def no_rollback(model, cache, n, last, guesses):
    emitted, _ = reference_verify_step(model, cache, n, last, guesses)
    return emitted, n + len(guesses) + 1


def no_bonus(model, cache, n, last, guesses):
    emitted, m = reference_verify_step(model, cache, n, last, guesses)
    return emitted[:-1], m


def one_pass_per_token(model, cache, n, last, guesses):
    best = [int(cached_logits(model, cache, [t], n + i)[0].argmax())
            for i, t in enumerate([last] + guesses)]
    j = 0
    while j < len(guesses) and guesses[j] == best[j]:
        j += 1
    return guesses[:j] + [best[j]], n + j + 1


def wrong_position(model, cache, n, last, guesses):
    return reference_verify_step(model, cache, n + 1, last, guesses)[0], n + 1


def keeps_everything(model, cache, n, last, guesses):
    best = cached_logits(model, cache, [last] + guesses, n).argmax(-1).tolist()
    return list(guesses) + [best[-1]], n + len(guesses) + 1


def counts_one_short(model, cache, n, last, guesses):
    emitted, m = reference_verify_step(model, cache, n, last, guesses)
    return emitted, m - 1


def counts_the_new_token(model, cache, n, last, guesses):
    emitted, m = reference_verify_step(model, cache, n, last, guesses)
    return emitted, m + 1


def emits_the_rejected_guess(model, cache, n, last, guesses):
    emitted, m = reference_verify_step(model, cache, n, last, guesses)
    k = len(emitted) - 1
    return (emitted[:-1] + [guesses[k]] if k < len(guesses) else emitted), m


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (no_rollback, "the cache was not rolled back"),
    (no_bonus, "the target's own token is missing"),
    (one_pass_per_token, "The whole point is ONE pass"),
    (wrong_position, "run the pass at start = num_cached"),
    (keeps_everything, "you kept every guess"),
    (counts_one_short, "last_token's K/V was written by this pass too"),
    (counts_the_new_token, "its K/V is written by the next pass"),
    (emits_the_rejected_guess, "the draft's rejected guess"),
    (lambda model, cache, n, last, guesses: guesses, "return a pair (emitted, num_cached)"),
])
def test_verify_step_names_the_mistake(fn, words, seed):
    msg = failure(check.verify_step, fn, seed)
    assert words in msg, msg


def test_reference_verify_step_is_speculative_generate(tiny):
    """The exercise's step, looped, gives plain greedy decoding's tokens in the same passes as
    minillm.spec.speculative_generate, with guesses right, wrong and in between."""
    for prompt in ([5, 6, 7, 8] * 4, list(range(3, 40, 3)), [9] * 6):
        plain = minillm.generate(tiny, prompt, 24)
        for k in (1, 3, 5):
            tokens, passes = spec_runs.run_with_verify_step(reference_verify_step, tiny,
                                                            spec.NgramDraft(), prompt, 24, k)
            lib = spec.speculative_generate(tiny, spec.NgramDraft(), prompt, 24, k=k)
            assert tokens == plain == lib.tokens
            assert passes == lib.num_target_passes


def test_the_loop_names_a_step_that_does_not_roll_back(tiny):
    with pytest.raises(ValueError, match=r"must hold \d+ \(all but the newest\)"):
        spec_runs.run_with_verify_step(no_rollback, tiny, spec.NgramDraft(), [5, 6, 7, 8] * 4, 16, 3)


# ----------------------------------------------------------------------- the released stubs


def test_every_stub_reports_not_implemented():
    import nbformat

    from quizzes.release import build_lab, tag_value

    name = "07-speculative-decoding.ipynb"
    lab = build_lab(nbformat.read(ROOT / "solutions" / name, as_version=4), name)
    cells = {tag_value(c, "exercise"): c.source for c in lab.cells if tag_value(c, "exercise")}
    assert set(cells) == {"acceptance_probability", "residual_distribution", "verify_step"}
    ns = {"torch": torch, "cached_logits": cached_logits}
    for src in cells.values():
        exec(src, ns)
    for cid in cells:
        with pytest.raises(NotImplementedYet, match=f"✗ {cid}: not implemented yet") as info:
            getattr(check, cid)(ns[cid])
        assert "Hint: " in str(info.value)


def test_stubs_and_feedback_do_not_give_the_rules_away():
    """The lab has the student derive both rules: no stub, check message, nudge or concept
    spells the formula or the code (tests/test_hints.py checks every lab's solution lines;
    this names Lab 07's formulas as the issue quoted them)."""
    import ast

    import nbformat

    import quizzes.checks.lab07 as lab07
    from quizzes.release import build_lab, tag_value

    name = "07-speculative-decoding.ipynb"
    lab = build_lab(nbformat.read(ROOT / "solutions" / name, as_version=4), name)
    stubs = "\n".join(c.source for c in lab.cells if tag_value(c, "exercise"))
    tree = ast.parse(Path(lab07.__file__).read_text(encoding="utf-8"))
    texts = "\n".join(node.value for node in ast.walk(tree)  # every message, nudge, concept, docstring
                      if isinstance(node, ast.Constant) and isinstance(node.value, str))
    for formula in ("clamp(ratio, max=1.0)", "clamp(p / q, max=1.0)", "min(1, p / q)",
                    "max(0, p − q)", "max(0, p - q)", "keepdim=True", "clamp(min=0)"):
        assert formula not in stubs, formula
        assert formula not in texts, formula


# ----------------------------------------------------------------------- measuring helpers


def test_expected_tokens_by_position_is_the_formula_with_one_alpha_each():
    """1 + α₁ + α₁α₂ + …: equal α gives calc.spec_expected_tokens; acceptances in runs are
    counted right where one α is not; an unreached position (NaN in the trace) counts as 0."""
    assert calc.spec_expected_tokens_by_position([0.7] * 5) == pytest.approx(calc.spec_expected_tokens(0.7, 5))
    assert calc.spec_expected_tokens_by_position([0.5, 1.0, 1.0]) == pytest.approx(1 + 0.5 * 3)
    assert calc.spec_expected_tokens_by_position([]) == 1.0
    # all-or-nothing passes (runs): one pass keeps all 4 guesses, the other none. The single α,
    # 4 of 8 = 0.5, gives 1.94 tokens per pass; by position (1/2, 1, 1, 1) gives the true 3.
    runs = spec_runs.SpecTrace(10, 4, [spec_runs.PassRecord([1, 2, 3, 4], 4, [1, 2, 3, 4, 5]),
                                       spec_runs.PassRecord([6, 7, 8, 9], 0, [5])], [1, 2, 3, 4, 5, 5], 0.0)
    assert runs.acceptance_rate == 0.5 and runs.tokens_per_pass == 3
    assert runs.expected_tokens_by_position() == pytest.approx(3)
    assert calc.spec_expected_tokens(runs.acceptance_rate, 4) == pytest.approx(1.9375)
    with pytest.raises(ValueError, match=r"alphas\[1\] must be a probability"):
        calc.spec_expected_tokens_by_position([0.5, 1.5])
    trace = spec_runs.SpecTrace(10, 3, [spec_runs.PassRecord([1, 2], 2, [1, 2, 3]),
                                        spec_runs.PassRecord([4, 5], 0, [6])], [1, 2, 3, 6], 0.0)
    # position 1: 2 judged, 1 kept; position 2: 1 judged, 1 kept; position 3: never proposed
    assert trace.expected_tokens_by_position() == pytest.approx(1 + 0.5 + 0.5)


class OracleDraft:
    """Proposes the target's own greedy tokens, except at positions in `wrong` (offsets into
    the generated text): a draft with a known, mixed acceptance pattern."""

    def __init__(self, prompt_len, greedy, wrong=()):
        self.prompt_len, self.greedy, self.wrong = prompt_len, greedy, set(wrong)

    def reset(self, *args):
        pass

    def rollback(self, n):
        pass

    def propose(self, context, k):
        start = len(context) - self.prompt_len
        out = self.greedy[start:start + k]
        return [(t + 1) % 128 if start + i in self.wrong else t for i, t in enumerate(out)], None


def test_trace_records_every_pass(tiny):
    prompt = list(range(3, 15))
    greedy = minillm.generate(tiny, prompt, 20, ignore_eos=True)
    assert tiny.config.eos_token_id not in greedy  # so speculative_generate runs all 20 tokens
    draft = OracleDraft(len(prompt), greedy, wrong={2, 9, 10})
    trace = spec_runs.trace_speculation(tiny, draft, prompt, 20, k=4, reference=greedy)
    assert trace.tokens == greedy and sum(len(p.emitted) for p in trace.passes) == 20
    for p in trace.passes:
        assert p.emitted[:p.accepted] == p.guesses[:p.accepted]
        assert p.accepted == len(p.guesses) or p.guesses[p.accepted] != p.emitted[p.accepted]
    # Hand count: passes accept 2 (guess 3 wrong), 4, 1 (guess 2 wrong), 0 (wrong), 4, ...
    assert [p.accepted for p in trace.passes][:4] == [2, 4, 1, 0]
    assert trace.acceptance_rate == pytest.approx(sum(p.accepted for p in trace.passes) / trace.num_guesses)
    s = trace.position_stats()
    assert s.accepted[0] == sum(p.accepted >= 1 for p in trace.passes)
    assert all(s.judged <= s.proposed) and all(s.accepted <= s.judged)
    assert s.judged[1] == sum(len(p.guesses) >= 2 and p.accepted >= 1 for p in trace.passes)
    with pytest.raises(AssertionError, match="changed the text"):
        spec_runs.trace_speculation(tiny, spec.NgramDraft(), prompt, 20, 4, reference=greedy[::-1])


def test_trace_html_marks_accepted_rejected_and_target_tokens(tiny):
    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    prompt = list(range(3, 15))
    greedy = minillm.generate(tiny, prompt, 8, ignore_eos=True)
    trace = spec_runs.trace_speculation(tiny, OracleDraft(len(prompt), greedy, {1}), prompt, 8, 3,
                                        reference=greedy)
    page = spec_runs.trace_html(trace, Tok())
    assert page.count("background:#c8e6c9") == sum(p.accepted for p in trace.passes)
    assert page.count("line-through") - 1 == sum(p.accepted < len(p.guesses) for p in trace.passes)
    assert "&lt;" in page  # token text is escaped


def test_costs_and_timings_on_the_tiny_model(tiny):
    prompt = [5, 6, 7, 8] * 4
    costs = spec_runs.verify_costs(tiny, prompt, ks=(1, 3), repeats=3)
    assert set(costs.pass_s) == {1, 3} and costs.step_s > 0 and costs.repeats == 3
    assert costs.verify_cost[3] == pytest.approx(costs.pass_s[3] / costs.step_s)
    run = spec_runs.measure_speedup(tiny, spec.NgramDraft, prompt, (1, 2), 8, repeats=1)
    assert [r.k for r in run.rows] == [1, 2] and run.num_tokens == 8
    for row in run.rows:
        assert row.speedup == pytest.approx(run.plain_decode_s / row.decode_s)  # one repeat: one ratio
        assert row.predicted == pytest.approx(calc.spec_speedup(row.alpha, row.k, row.r, row.c))
    assert run.row(2).k == 2
    trace = spec_runs.trace_speculation(tiny, spec.NgramDraft(), prompt, 8, k=2)
    report = spec_runs.prediction_report(run, trace, c=costs.verify_cost[3], r=0.001)
    assert len(report) == 4 and report[0].startswith(f"k = 2: the measured speedup, {run.row(2).speedup:.2f}×")
    assert all(("within 20%" in line) != ("outside 20%" in line) for line in report[:2])
    steps = spec_runs.engine_step_times(tiny, (1, 2, 4), prompt_len=4, steps=2)
    assert steps.batch_sizes.tolist() == [1, 2, 4] and (steps.step_s > 0).all()
    assert steps.verify_cost(1, 1) == pytest.approx(steps.step_s[1] / steps.step_s[0])
    assert steps.step_at(2) == steps.step_s[1]
    with pytest.raises(ValueError, match="outside the measured batch sizes"):
        steps.verify_cost(2, 3)


def test_plain_decoding_is_timed_eagerly_like_the_speculative_passes(tiny, monkeypatch):
    # On CUDA generate replays a graph by default, while the speculative loop's passes and
    # verify_costs run eagerly: the plain side must run eagerly too, or the lab compares
    # launch overheads (a speedup of ~0.1x on an H100), not speculation.
    from minillm import decode_graph

    asked, real = [], decode_graph.use_cuda_graph
    monkeypatch.setattr(decode_graph, "use_cuda_graph",
                        lambda requested, *a: asked.append(requested) or real(requested, *a))
    prompt = [5, 6, 7, 8] * 4
    spec_runs.measure_speedup(tiny, spec.NgramDraft, prompt, (1,), 4, repeats=1)
    spec_runs.trace_speculation(tiny, spec.NgramDraft(), prompt, 4, k=1)
    assert asked and all(a is False for a in asked), asked


# ----------------------------------------------------------------------- the quiz


def test_bank_accepts_its_computed_answers():
    bank = load_bank("lab07")
    assert len(bank.questions) >= 8
    for qid, q in bank.questions.items():
        m = getattr(q, "example_measured", None) or None
        got = expected(f"lab07.{qid}", m)
        assert answer(f"lab07.{qid}", got if isinstance(got, str) else f"{got}", m).correct, qid


def test_bank_numbers_are_worked_by_hand():
    """New cases of the lab's formulas (the lab prints α = 0.7 at k = 5 and α = 0.8 with
    r = 0.05; the quiz asks others), worked by hand."""
    assert expected("lab07.q1") == pytest.approx(0.4)                     # 0.12 / 0.3
    assert expected("lab07.q3") == pytest.approx(1 + 0.75 + 0.75 ** 2 + 0.75 ** 3)  # 2.73
    assert expected("lab07.q5") == 4
    assert expected("lab07.q6") == pytest.approx((1 - 0.7 ** 5) / 0.3 / 1.4)  # 1.98
    assert expected("lab07.q8") == pytest.approx(0.7)
    assert not answer("lab07.q3", "3.25").correct  # the shortcut k·α + 1
    assert not answer("lab07.q5", "3").correct
    m = {"spec_speedup_k4": 2.0}  # within 20%, not 40% as before
    assert answer("lab07.q7", "2.35x", m).correct and not answer("lab07.q7", "2.5", m).correct
    m = {"plain_tok_s": 21.0}  # predicted from a 45 ms plain step: 22.2 tok/s
    assert answer("lab07.q10", "22.2 tok/s", m).correct and not answer("lab07.q10", "30", m).correct
