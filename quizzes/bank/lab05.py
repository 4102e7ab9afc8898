"""Lab 05 quiz: continuous batching and queueing. q7 and q9 read what the lab measured with
the real LLMEngine (``quizzes.record`` in the notebook): the throughput ratio, and the step
count that q9 asks the student to predict with their own ``batch_steps``."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 05: continuous batching"


def _calc(name, *args):
    def answer() -> float:
        from minillm import calc

        return getattr(calc, name)(*args)

    return answer


QUESTIONS = [
    Numeric("q1", "A static batch holds 7 requests of 20 output tokens and one of 500. How many slot-steps "
                  "are wasted (a slot idle while the batch runs)?",
            answer=_calc("static_batch_wasted_steps", [20] * 7 + [500]), unit="", rtol=0,
            explanation="The batch runs 500 steps; seven slots idle for 480 each: 7 × 480 = 3,360."),
    Numeric("q2", "A static batch of 7 requests of 50 tokens and one of 500 at 10 ms per step: tokens/s?",
            answer=_calc("static_batch_throughput", [50] * 7 + [500], 0.010), unit="tok/s", rtol=0.01,
            explanation="850 tokens in 500 steps × 10 ms = 5 s: 170 tok/s."),
    Numeric("q3", "With 8 slots always full (a queue never empty), 10 ms per step: the ideal continuous tok/s?",
            answer=_calc("continuous_batch_ideal_throughput", 8, 0.010), unit="tok/s", rtol=0.01,
            explanation="8 tokens per 10 ms step = 800 tok/s, against 170 static: utilization 0.2125."),
    Numeric("q4", "A server receives 20 requests/s and each spends 2 s in it. How many are in it on average?",
            answer=_calc("littles_law_L", 20, 2.0), unit="", rtol=0.01,
            explanation="Little's law L = λ · W = 20 × 2 = 40, whatever the scheduling."),
    Numeric("q5", "An M/M/1 server handles μ = 10 requests/s. Mean time in the system at λ = 9 requests/s?",
            answer=_calc("mm1_mean_latency", 9, 10), unit="s", rtol=0.01,
            explanation="W = 1 / (μ − λ) = 1 s: ten times the 0.1 s service time, at ρ = 0.9. At λ = 5 "
                        "(ρ = 0.5) it is 0.2 s."),
    Numeric("q6", "A request's first token arrives after 200 ms, then 100 more tokens come every 30 ms. "
                  "End-to-end latency?",
            answer=0.2 + 100 * 0.030, unit="s", rtol=0.01,
            explanation="E2E = TTFT + n · ITL = 0.2 + 100 × 0.03 = 3.2 s: good TTFT (< 200 ms) and ITL "
                        "(< 30 ms) still add up to seconds for long answers."),
    Numeric("q7", "On the lab's workload, what throughput ratio (continuous ÷ static, tokens per second) did "
                  "the real LLMEngine reach, as measured?",
            answer=lambda m: m["engine_speedup"], unit="x", rtol=0.03, needs=("engine_speedup",),
            example_measured={"engine_speedup": 1.6},
            explanation="Continuous batching refills a slot the step after it frees; static batching "
                        "idles it until the longest member finishes."),
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
            answer=lambda m: m["engine_steps_continuous"], unit="", rtol=0.05,
            needs=("engine_steps_continuous",), example_measured={"engine_steps_continuous": 274},
            explanation="batch_steps([n for _, n in work], 8, \"continuous\") = 274, and the engine takes "
                        "exactly that many: one token per running request per step, a slot refilled the "
                        "step after it frees. A smaller budget (chunked prefill) would add steps."),
]
