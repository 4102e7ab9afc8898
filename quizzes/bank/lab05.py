"""Lab 05 quiz: continuous batching and queueing. Two questions are predictions, each asked in
a ``predict:`` cell before the cell that measures it (``quizzes.record``): q9 the real
LLMEngine's step count (from the student's ``batch_steps``), and q10 the measured mean latency
of the one-slot scheduler at ρ = 0.9 (from the measured service time and M/M/1). The other
numeric questions ask for cases the lab does not print (other lengths, slots, rates)."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 05: continuous batching"


def _calc(name, *args):
    def answer() -> float:
        from minillm import calc

        return getattr(calc, name)(*args)

    return answer


def _work_steps(num_slots: int) -> float:
    from quizzes.checks.lab05 import reference_batch_steps
    from widgets import batching

    return reference_batch_steps([n for _, n in batching.tiny_workload(24)], num_slots, "continuous")


def _static_utilization() -> float:
    from minillm import calc

    lens = [100] * 4 + [300] * 4
    return calc.static_batch_throughput(lens, 0.020) / calc.continuous_batch_ideal_throughput(8, 0.020)


QUESTIONS = [
    Numeric("q1", "A static batch holds 7 requests of 30 output tokens and one of 400. How many slot-steps "
                  "are wasted (a slot idle while the batch runs)?",
            answer=_calc("static_batch_wasted_steps", [30] * 7 + [400]), unit="", rtol=0,
            explanation="The batch runs 400 steps; seven slots idle for 370 each: 7 × 370 = 2,590 "
                        "(calc.static_batch_wasted_steps)."),
    Numeric("q2", "A static batch of 4 requests of 100 tokens and 4 of 300, at 20 ms per step: tokens/s?",
            answer=_calc("static_batch_throughput", [100] * 4 + [300] * 4, 0.020), unit="tok/s", rtol=0.01,
            explanation="1,600 tokens in 300 steps × 20 ms = 6 s: 267 tok/s."),
    Numeric("q3", "... and what fraction of the ideal continuous throughput is that (8 slots always full, "
                  "20 ms per step)?",
            answer=_static_utilization, unit="", rtol=0.01,
            explanation="Ideal: 8 tokens per 20 ms = 400 tok/s; 267 ÷ 400 = 0.667. The four short "
                        "requests idle their slots for the last 200 of 300 steps."),
    Numeric("q4", "A server holds 12 requests on average (queued and running) and receives 4 requests/s. "
                  "How long does a request spend in it on average, in seconds?",
            answer=12 / 4, unit="s", rtol=0.01,
            explanation="Little's law L = λ · W, so W = L ÷ λ = 12 ÷ 4 = 3 s, whatever the scheduling."),
    Numeric("q5", "An M/M/1 server handles μ = 10 requests/s. At what arrival rate does the mean time in "
                  "the system reach 4× the service time, in requests/s?",
            answer=7.5, unit="req/s", rtol=0.01,
            explanation="W = (1 ÷ μ) ÷ (1 − ρ) = 4 ÷ μ gives ρ = 0.75, λ = 0.75 × 10 = 7.5 requests/s. "
                        "From there every step towards ρ = 1 costs more: 10× at 0.9, 20× at 0.95."),
    Numeric("q6", "An answer of 250 tokens: the first arrives after 0.5 s, then one every 40 ms. "
                  "End-to-end latency, in seconds?",
            answer=_calc("e2e_latency_s", 0.5, 0.040, 250), unit="s", rtol=0.01,
            explanation="E2E = TTFT + (n − 1) · ITL = 0.5 + 249 × 0.04 = 10.46 s (calc.e2e_latency_s): "
                        "for long answers the ITL, not the TTFT, decides the total."),
    Numeric("q7", "Your `batch_steps` on the engine's workload (`[n for _, n in work]`) with **16** slots "
                  "instead of 8, continuous: how many steps?",
            answer=lambda: _work_steps(16), unit="", rtol=0,
            explanation="batch_steps([n for _, n in work], 16, \"continuous\"). Doubling the slots does "
                        "not halve the steps: the three 200-token requests set a floor (the last one "
                        "cannot finish before it has run 200 steps)."),
    Choice("q8", "What does chunked prefill (max_num_batched_tokens) buy?",
           options=[
               Option("A long prompt is computed in chunks that share each step with the running decodes, "
                      "so their inter-token latency stays low.", correct=True,
                      why="Without it, one 4,000-token prefill makes every running request wait a whole "
                          "compute-bound step."),
               Option("Fewer FLOPs for the prompt.", why="The same tokens are computed; only the schedule changes."),
               Option("A smaller KV cache.", why="The KV of every prompt token is still stored."),
           ]),
    Numeric("q9", "**Predict, then measure.** Section 3 serves `work` (24 requests; each one's output length "
                  "is its second element) on the real engine with 8 slots, continuous batching, and a "
                  "token budget of 512, which fits every prompt in one chunk: the step that computes a "
                  "prompt also produces its first token. Before running that cell, predict the number of "
                  "engine steps with your `batch_steps`. Marked against the engine's count, within 5%.",
            answer=lambda m: m["engine_steps_continuous"], unit="steps", rtol=0.05,
            needs=("engine_steps_continuous",), predict=True,
            example_measured={"engine_steps_continuous": 274},
            explanation="batch_steps([n for _, n in work], 8, \"continuous\") = 274, and the engine takes "
                        "exactly that many: one token per running request per step, a slot refilled the "
                        "step after it frees. A smaller budget (chunked prefill) would add steps."),
    Numeric("q10", "**Predict, then measure.** Section 5 measured the one-slot server's mean service time "
                   "(1 ÷ μ) at light load. Predict its mean time in the system, in ms, when requests "
                   "arrive at ρ = 0.9 (λ = 0.9 μ), before the next cell measures it with the real "
                   "scheduler. Marked against the measurement, within 20%.",
            answer=lambda m: m["latency_rho09_ms"], unit="ms", rtol=0.2, needs=("latency_rho09_ms",),
            predict=True, example_measured={"latency_rho09_ms": 1996.0},
            explanation="M/M/1: W = (1 ÷ μ) ÷ (1 − ρ) = 10 × the service time, about 2 s for a 202 ms "
                        "service. A guess that grows in proportion to ρ (say twice the service time) is off by 5×: "
                        "queueing delay explodes as ρ → 1."),
]
