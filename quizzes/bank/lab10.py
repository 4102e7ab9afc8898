"""Lab 10 quiz: cost, capacity and design, then a review of the course.

q1 reads the throughput the lab measured on its device and the hourly price it took for that
device (``quizzes.record(smollm_tok_s=..., dollars_per_hour=...)`` in the notebook). Two are
predictions, each asked in a ``predict:`` cell before the measurement it is marked against:
q18 (the bytes of this device's KV pool, ``quizzes.record(kv_pool_mb=...)``) and q17 (a
decode step of 8 sequences, ``quizzes.record(decode_step_ms_batch8=...)``). Every other answer
comes from ``minillm.calc`` (imported in the answer functions). q6-q15 are the ten review
questions of the syllabus (section 10), one per lab or two, each answered with a formula of
``calc``. No answer is printed by the lab: the cases asked for differ from the ones its cells
compute.
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 10: from a model to a deployment"

def _calc(name, *args, scale=1.0, **kwargs):
    def answer() -> float:
        from minillm import calc

        return getattr(calc, name)(*args, **kwargs) * scale

    return answer


MACHINE_UTILIZATION = 0.3


def _machine_cost(m) -> float:
    from minillm import calc

    return calc.cost_per_million_tokens(m["dollars_per_hour"], m["smollm_tok_s"], MACHINE_UTILIZATION)


def _design_gpus() -> float:
    from minillm import calc, hardware

    a100 = hardware.get("A100-80GB")
    step = calc.StepModel.from_roofline(70e9, 2, a100.bandwidth_bytes_per_s, a100.bf16_flops, num_gpus=4)
    return calc.design_deployment(150, 500, 200, step, 256, gpus_per_replica=4,
                                  dollars_per_gpu_hour=a100.price_per_hour).num_gpus


def _four_a100_requests() -> float:
    from minillm import calc

    return calc.memory_budget(70e9, 80, 8, 128, 2048, 80e9, num_gpus=4).max_concurrent


QUESTIONS = [
    Numeric("q1", "**Measured.** Section 1 priced the device this lab runs on by the hour (the "
                  "catalog's indicative figure for its GPU or for a CPU VM of its size, or your own "
                  "`MY_DOLLARS_PER_HOUR`) and printed what 1M tokens cost when it is always busy. A "
                  "service keeps it busy only 30% of the hours you pay for: what do 1M generated "
                  "tokens cost then? It is marked against the price and the throughput this notebook "
                  "recorded, within 2%.",
            answer=_machine_cost, unit="$", rtol=0.02, needs=("smollm_tok_s", "dollars_per_hour"),
            example_measured={"smollm_tok_s": 150.0, "dollars_per_hour": 0.10},
            explanation="$/h ÷ (tok/s × 3600 × 0.3) × 1e6: the always-busy figure ÷ 0.3, 3.3 times "
                        "dearer. A 2-vCPU VM at $0.10/h serving 150 tok/s: $0.62. Idle hours are paid "
                        "too, so utilization, set by the traffic, matters as much as the device."),
    Numeric("q2", "One A100 rents for $2.50/h and serves 800 tok/s when busy, but it is busy only 40% "
                  "of the hours you pay for. What do 1M tokens cost?",
            answer=_calc("cost_per_million_tokens", 2.50, 800, 0.4), unit="$", rtol=0.02,
            explanation="$2.50 ÷ (800 × 3600 × 0.4) × 1e6 = $2.17: idle hours are paid too, so "
                        "utilization divides the throughput you are billed for."),
    Numeric("q3", "One H100 rents for $3.00/h and serves 2,000 tok/s when busy. Against an API at $0.50 "
                  "per 1M tokens, above what utilization does renting win?",
            answer=_calc("break_even_utilization", 3.00, 2000, 0.5, scale=100), unit="%", rtol=0.02,
            explanation="At full load it costs $3 ÷ (2,000 × 3600) × 1e6 = $0.417 per 1M; $0.417 ÷ "
                        "$0.50 = 83%. Below that the API is cheaper."),
    Numeric("q4", "Llama-2-70B in fp16 on four A100-80GB (90% of memory usable): how many requests of "
                  "2048 tokens fit at once?",
            answer=_four_a100_requests, unit="", rtol=0, atol=0,
            explanation="288 GB usable − 140 GB of weights (less the activations) leaves about 148 GB; "
                        "each 2K request holds 0.67 GB of KV: about 220. Halving the context doubles "
                        "the requests that fit."),
    Numeric("q5", "The syllabus design, at 150 requests/s instead of 100: Llama-2-70B on replicas of 4 "
                  "A100s (17.2 ms + 0.112 ms per token a step), 500 tokens in and 200 out, batches of "
                  "256, each replica at most 80% busy. How many GPUs (calc.design_deployment)?",
            answer=_design_gpus, unit="", rtol=0, atol=0,
            explanation="Each request costs a replica 92 ms of work, so 150 req/s needs 13.8 replicas at "
                        "100%, 18 at ≤ 80%: 72 GPUs. Little's law (150 × 9.2 s = 1,385 in flight, 6 "
                        "replicas' worth) asks for fewer: the work, not the waiting, sets the size."),
    Numeric("q6", "Review (Lab 01). A 13B model's weights in fp16?",
            answer=_calc("weight_bytes", 13e9, 2, scale=1e-9), unit="GB", rtol=0.02,
            explanation="13e9 × 2 bytes = 26 GB."),
    Numeric("q7", "Review (Lab 01). The batch-1 decode ceiling of a 70B fp16 model on 2 TB/s?",
            answer=_calc("decode_tokens_per_s", 70e9, 2, 2e12), unit="tok/s", rtol=0.02,
            explanation="Each token reads 140 GB of weights: 2e12 ÷ 140e9 = 14.3 tok/s."),
    Numeric("q8", "Review (Lab 03). Llama-2-70B's grouped-query attention: 64 query heads sharing 8 KV "
                  "heads. How many times smaller is its KV cache than with full multi-head attention?",
            answer=_calc("gqa_reduction", 64, 8), unit="x", rtol=0.01,
            explanation="64 ÷ 8 = 8: each KV head serves a group of 8 query heads (Llama-3-8B's 32/8: 4)."),
    Numeric("q9", "Review (Lab 07). The target gives a drafted token p = 0.3, the draft had q = 0.6: "
                  "the probability it survives verification?",
            answer=_calc("spec_acceptance_probability", 0.3, 0.6), unit="", rtol=0.01,
            explanation="min(1, p ÷ q) = 0.5."),
    Numeric("q10", "Review (Lab 05). One server handles μ = 4 requests/s. At λ = 3.6 requests/s, how "
                   "many times its 0.25 s service time is the mean time in the system (M/M/1)?",
            answer=_calc("mm1_mean_latency", 3.6, 4, scale=1 / 0.25),
            unit="x", rtol=0.02,
            explanation="W = 1 ÷ (μ − λ) = 2.5 s = 10 × 0.25 s, at ρ = 0.9: why a design keeps ρ "
                        "well below 1."),
    Numeric("q11", "Review (Lab 08). A pipeline of 4 stages runs 8 microbatches: what fraction of the "
                   "time does a stage sit idle (the bubble)?",
            answer=_calc("pp_bubble_fraction", 4, 8, scale=100), unit="%", rtol=0.02,
            explanation="(N − 1) ÷ (N − 1 + M) = 3 ÷ 11 = 27%."),
    Choice("q12", "Review (Lab 06). GPTQ decides how to round each column using …",
           options=[
               Option("the inverse Hessian of the layer's inputs, pushing each column's rounding error "
                      "onto the columns not yet rounded", correct=True,
                      why="H = 2·XᵀX from calibration data; its inverse weights the error updates."),
               Option("the magnitudes of the activations, to scale salient channels up",
                      why="That is AWQ."),
               Option("the weights' own largest values only", why="That is round-to-nearest (RTN)."),
           ]),
    Choice("q13", "Review (Lab 06). AWQ protects the weights that matter most by looking at …",
           options=[
               Option("the activations' magnitudes per input channel", correct=True,
                      why="Channels with large activations are scaled up before rounding, so their "
                          "relative error shrinks."),
               Option("the inverse Hessian", why="That is GPTQ."),
               Option("the gradients of the loss", why="AWQ needs no gradients, only activations."),
           ]),
    Choice("q14", "Review (Labs 04 and 09). Every request to your service starts with the same "
                  "2,000-token system prompt. What helps most?",
           options=[
               Option("prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention): "
                      "the shared prompt's KV blocks are computed once and reused", correct=True,
                      why="Each request then prefills only its own tokens: TTFT and compute drop."),
               Option("a larger max_num_seqs", why="More requests at once still prefill 2,000 tokens each."),
               Option("speculative decoding", why="It speeds up decoding, not the prompt's prefill."),
               Option("int4 weights", why="Smaller weights do not avoid recomputing the same prompt."),
           ]),
    Numeric("q15", "Review (Lab 02). Llama-3-8B (32 layers, 8 KV heads of 128) at 8192 tokens in fp16: "
                   "the KV cache of one sequence?",
            answer=_calc("kv_cache_bytes", 32, 8, 128, 8192, scale=1e-9), unit="GB", rtol=0.02,
            explanation="2 × 32 × 8 × 128 × 8192 × 2 bytes = 1.07 GB (exactly 1 GiB)."),
    Choice("q16", "Batching 64 requests instead of 1 on the same GPU. What happens to ONE request's "
                  "end-to-end latency?",
           options=[
               Option("it stays about the same or grows: each of its tokens still needs its own step, "
                      "and a bigger batch makes every step a little longer", correct=True,
                      why="200 steps of 20 ms take 4 s at any batch size; batching buys throughput."),
               Option("it falls about 64-fold", why="The batch shares each step; it does not skip steps."),
               Option("it falls by the square root of 64", why="No step is skipped at any batch size."),
           ]),
    Numeric("q17", "**Predict, then measure.** Section 3 fitted this machine's step model from a "
                   "decode step with 1 sequence and one with 32: base + per_token × n. Before you run "
                   "the cell that times it, predict one decode step with 8 sequences, in ms. It is "
                   "marked against the step the notebook then measures, within 20%.",
            answer=lambda m: m["decode_step_ms_batch8"], unit="ms", rtol=0.2,
            needs=("decode_step_ms_batch8",), example_measured={"decode_step_ms_batch8": 45.0},
            predict=True,
            explanation="base + 8 × per_token (per_token = (t(32) − t(1)) / 31). A decode step "
                        "is mostly one read of the weights, shared by every row, plus a cost per "
                        "row. On a CPU that cost grows once the products turn compute-bound (Lab "
                        "01's table), so the line through the two measured points runs a little "
                        "above the steps in between: the measurement cell prints the ratio here. "
                        "The straight line is also the step-time model Lab 05's simulator and "
                        "this lab's designs run on."),
    Numeric("q18", "**Predict, then measure.** Section 2 printed how many KV blocks of how many tokens "
                   "the engine gave this device's replica, and SmolLM2's shape (layers, KV heads, head "
                   "size, fp32). Predict the bytes its KV pool takes, in MB, before the cell that "
                   "measures the engine's tensors. Within 20% counts as right.",
            answer=lambda m: m["kv_pool_mb"], unit="MB", rtol=0.2, needs=("kv_pool_mb",),
            example_measured={"kv_pool_mb": 500.0}, predict=True,
            explanation="blocks × block size tokens × 2 (K and V) × layers × KV heads × head size × 4 "
                        "bytes: the pool is allocated up front, whatever the load, which is why a "
                        "server's memory gauge says nothing about its load."),
]
