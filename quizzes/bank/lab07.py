"""Lab 07 quiz: speculative decoding. Every number comes from ``minillm.calc`` (imported in
the answer functions) except q7 and q10, which read what the lab measured (``quizzes.record`` in the notebook):
the speedup at k = 4 and the plain decoding speed. q7 keeps a 40% tolerance, because the
independence assumption of the formula is broken by copying drafts; q10 is the
predict-then-measure question within 20%."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 07: speculative decoding"


def _calc(name, *args, **kwargs):
    def answer() -> float:
        from minillm import calc

        return getattr(calc, name)(*args, **kwargs)

    return answer


def _speedup_at_best_k() -> float:
    from minillm import calc

    return calc.spec_speedup(0.8, calc.spec_optimal_k(0.8, 0.05), 0.05)


# A draft and a target over three tokens: α = Σ min(p, q).
_P, _Q = (0.5, 0.3, 0.2), (0.2, 0.3, 0.5)

QUESTIONS = [
    Numeric("q1", "The draft proposed a token with probability q = 0.6; the target gives it p = 0.3. "
                  "With what probability is the token accepted?",
            answer=_calc("spec_acceptance_probability", 0.3, 0.6), unit="", rtol=0.01,
            explanation="min(1, p / q) = min(1, 0.3 / 0.6) = 0.5. The draft offers this token twice as "
                        "often as the target would write it, so half of those offers are turned down."),
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
    Numeric("q3", "Per-guess acceptance α = 0.7, k = 5 guesses per pass, acceptances independent. "
                  "Expected tokens per target pass?",
            answer=_calc("spec_expected_tokens", 0.7, 5), unit="", rtol=0.01,
            explanation="(1 − α^(k+1)) / (1 − α) = (1 − 0.7⁶) / 0.3 = 2.94: 1 + 0.7 + 0.49 + 0.343 + "
                        "0.24 + 0.168. The shortcut k·α + 1 would say 4.5."),
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
    Numeric("q5", "α = 0.8, and one draft step costs r = 0.05 of a target step (take the verify pass as one "
                  "step). Which k, from 0 to 16, gives the highest speedup?",
            answer=_calc("spec_optimal_k", 0.8, 0.05), unit="", rtol=0, atol=0,
            explanation="calc.spec_optimal_k: k = 8, where (1 − 0.8⁹)/0.2 = 4.33 tokens per pass cost "
                        "1 + 8 × 0.05 = 1.4 steps. The optimum is flat: k = 6..10 are within 2%."),
    Numeric("q6", "And the speedup at that k?",
            answer=_speedup_at_best_k, unit="x", rtol=0.02,
            explanation="4.33 / 1.4 = 3.09×. With r = 0.1 the best k falls to 6 (2.47×)."),
    Numeric("q7", "**Measured.** From the α, r and c you measured on this device at k = 4 (section 6), "
                  "predict the speedup of speculative over plain decoding with calc.spec_speedup. It is "
                  "marked against the speedup the lab then measured. The formula assumes independent "
                  "acceptances, which copying breaks (section 5), so a prediction within 40% of the "
                  "measurement counts as right.",
            answer=lambda m: m["spec_speedup_k4"], unit="x", rtol=0.4, needs=("spec_speedup_k4",),
            example_measured={"spec_speedup_k4": 2.5},
            explanation="E = (1 − α⁵) / (1 − α) tokens per pass for c + 4·r plain steps. The n-gram "
                        "draft's acceptances come in runs, so it usually gets more tokens per pass than "
                        "E, and the measurement beats the prediction."),
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
    Numeric("q10", "**Predict, then measure.** Section 1 measured one plain decode step after the editing "
                   "prompt. Predict the speed of plain greedy decoding (tok/s, decode only) that section 6 "
                   "times next to the speculative runs. Marked against that measurement, within 20%.",
            answer=lambda m: m["plain_tok_s"], unit="tok/s", rtol=0.2, needs=("plain_tok_s",),
            example_measured={"plain_tok_s": 21.0},
            explanation="One token per step: 1 ÷ step time, e.g. 1 ÷ 45 ms = 22 tok/s. It is the "
                        "denominator of every speedup in this lab; the speculative runs are measured "
                        "against it in the same cell, so the speedups are ratios and survive a "
                        "busy machine better than either time alone."),
]
