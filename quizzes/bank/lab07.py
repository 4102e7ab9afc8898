"""Lab 07 quiz: speculative decoding. Every number comes from ``minillm.calc`` (imported in
the answer functions) except q7 and q10, the lab's two predictions, which read what the lab
measured (``quizzes.record`` in the notebook): the speedup at k = 4 and the plain decoding
speed. Both are asked in the lab (``quizzes.predict``) before the cell that measures them,
and marked within 20%. The calc questions apply the lab's formulas to cases the lab does
not print (α = 0.75 at k = 3, α = 0.7 with r = 0.1, p = 0.12 against q = 0.3), so no answer
can be copied from an output above the quiz."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 07: speculative decoding"


def _calc(name, *args, **kwargs):
    def answer() -> float:
        from minillm import calc

        return getattr(calc, name)(*args, **kwargs)

    return answer


# q5/q6: a draft of the lab's kind but a case the lab does not print.
_ALPHA, _R = 0.7, 0.1


def _speedup_at_best_k() -> float:
    from minillm import calc

    return calc.spec_speedup(_ALPHA, calc.spec_optimal_k(_ALPHA, _R), _R)


# A draft and a target over three tokens: α = Σ min(p, q).
_P, _Q = (0.5, 0.3, 0.2), (0.2, 0.3, 0.5)

QUESTIONS = [
    Numeric("q1", "The draft proposed a token with probability q = 0.3; the target gives it p = 0.12. "
                  "With what probability is the token accepted?",
            answer=_calc("spec_acceptance_probability", 0.12, 0.3), unit="", rtol=0.01,
            explanation="min(1, p / q) = min(1, 0.12 / 0.3) = 0.4. The draft offers this token 2.5 "
                        "times as often as the target would write it, so only 40% of those offers "
                        "may be kept."),
    Choice("q2", "After a rejection, what is the replacement token drawn from?",
           options=[
               Option("norm(max(0, p − q)): the mass the target wants and the accepted guesses did not "
                      "deliver", correct=True,
                      why="Accepting delivers min(p, q) of each token; the residual adds exactly "
                          "max(0, p − q), so the total is p."),
               Option("p, the target's own distribution",
                      why="Tokens the acceptance step already let through would then come out too often."),
               Option("q, the draft's distribution", why="The output would drift towards the draft."),
               Option("norm(max(0, q − p))",
                      why="That is what the draft over-proposed: the mass that had to be rejected."),
           ]),
    Numeric("q3", "Per-guess acceptance α = 0.75, k = 3 guesses per pass, acceptances independent. "
                  "Expected tokens per target pass?",
            answer=_calc("spec_expected_tokens", 0.75, 3), unit="", rtol=0.01,
            explanation="(1 − α^(k+1)) / (1 − α) = (1 − 0.75⁴) / 0.25 = 2.73: 1 + 0.75 + 0.5625 + "
                        "0.42. The shortcut k·α + 1 would say 3.25."),
    Choice("q4", "Why does the shortcut k·α + 1 overestimate the tokens per pass?",
           options=[
               Option("A guess counts only if every guess before it was accepted: the first rejection "
                      "discards the rest, so guess i survives with probability α^i, not α",
                      correct=True,
                      why="The later guesses were conditioned on the rejected one, so they are thrown away."),
               Option("It forgets the target's own token that every pass adds",
                      why="The + 1 is that token; both counts include it."),
               Option("It ignores the cost of running the draft",
                      why="Cost is the other half of the speedup, c + k·r; the token count is wrong on "
                          "its own."),
               Option("α should be squared because two models are involved",
                      why="α already is the probability that one guess survives the comparison."),
           ]),
    Numeric("q5", "α = 0.7, and one draft step costs r = 0.1 of a target step (take the verify pass as one "
                  "step). Which k, from 0 to 16, gives the highest speedup?",
            answer=_calc("spec_optimal_k", _ALPHA, _R), unit="", rtol=0, atol=0,
            explanation="calc.spec_optimal_k: k = 4, where (1 − 0.7⁵)/0.3 = 2.77 tokens per pass cost "
                        "1 + 4 × 0.1 = 1.4 steps. The optimum is flat: k = 3 and 5 are within 2%."),
    Numeric("q6", "And the speedup at that k?",
            answer=_speedup_at_best_k, unit="x", rtol=0.02,
            explanation="2.77 / 1.4 = 1.98×. A cheaper draft (r = 0.05) would want k = 6 (2.35×)."),
    Numeric("q7", "**Predict, then measure.** Predict the speedup of speculative over plain decoding at "
                  "k = 4 on the editing prompt, before section 6 times it: E ÷ (c + 4·r), with c and r "
                  "at k = 4 from the table of section 6, and E from the acceptance measured at each "
                  "draft position in section 5 (α₁ … α₄, each given the earlier guesses kept): E = 1 + "
                  "α₁ + α₁α₂ + α₁α₂α₃ + α₁α₂α₃α₄ (calc.spec_expected_tokens_by_position). Marked "
                  "against the speedup the lab then measures, within 20%.",
            answer=lambda m: m["spec_speedup_k4"], unit="x", rtol=0.2, predict=True,
            needs=("spec_speedup_k4",),
            example_measured={"spec_speedup_k4": 2.2},
            explanation="A pass yields E tokens for c + 4·r plain steps. The single-α formula (1 − α⁵) ÷ "
                        "(1 − α) assumes independent acceptances; a copying draft's acceptances come in "
                        "runs (section 5), which the per-position α captures. The lab prints how far "
                        "each prediction fell from your measurement, and why."),
    Numeric("q8", "A draft's distribution at some position is q = (0.2, 0.3, 0.5) over three tokens; the "
                  "target's is p = (0.5, 0.3, 0.2). What is the probability that the draft's proposal is "
                  "accepted (α at this position)?",
            answer=lambda: sum(min(a, b) for a, b in zip(_P, _Q)), unit="", rtol=0.01,
            explanation="α = Σ q(x) · min(1, p(x)/q(x)) = Σ min(p(x), q(x)) = 0.2 + 0.3 + 0.2 = 0.7, "
                        "which is 1 minus the total variation distance between p and q."),
    Choice("q9", "Speculative decoding speeds up a batch-1 decode but not a server running a large batch. "
                 "Why?",
           options=[
               Option("At batch 1 the step is memory-bound, so extra rows to verify are nearly free; a "
                      "large batch already saturates compute, so verifying k guesses per sequence costs "
                      "close to generating them", correct=True,
                      why="The verify pass multiplies the rows by k + 1; that is free only while the "
                          "weights' reads, not arithmetic, set the step time."),
               Option("The acceptance rate falls as the batch grows",
                      why="α depends on the draft and the text, not on how many sequences share a step."),
               Option("Large batches cannot roll back their KV caches",
                      why="Each sequence rolls back its own cache (in a paged cache, its own blocks)."),
               Option("The draft model does not fit in memory next to a large batch",
                      why="An n-gram draft needs no memory at all, and it stops paying too."),
           ]),
    Numeric("q10", "**Predict, then measure.** Section 1 measured one decode step (a pass over one token) "
                   "after the editing prompt. Predict the speed of plain greedy decoding (tok/s, decode "
                   "only) that section 6 times next to the speculative runs, before it runs. Marked "
                   "against that measurement, within 20%.",
            answer=lambda m: m["plain_tok_s"], unit="tok/s", rtol=0.2, predict=True,
            needs=("plain_tok_s",),
            example_measured={"plain_tok_s": 21.0},
            explanation="One token per step: 1 ÷ step time, e.g. 1 ÷ 45 ms = 22 tok/s. It is the "
                        "denominator of every speedup in this lab; the speculative runs are measured "
                        "against it in the same cell, so the speedups are ratios and survive a "
                        "busy machine better than either time alone."),
]
