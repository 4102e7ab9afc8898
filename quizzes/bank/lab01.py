"""Lab 01 quiz: the memory wall and the roofline.

Numeric answers come from ``minillm.calc`` and ``minillm.hardware`` (imported inside the
answer functions, so importing this bank stays cheap); q9 reads this machine's measured
batch-1 decode speed, which the lab's measurement cell stores with
``quizzes.record(decode_tok_s=...)``.
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 01 quiz: the memory wall and the roofline"


def _calc():
    from minillm import calc

    return calc


def _weights_13b_gb() -> float:
    return _calc().weight_bytes(13e9, 2) / 1e9


def _tok_s_70b_a100() -> float:
    return _calc().decode_tokens_per_s(70e9, 2, 2e12)


def _tok_s_405b_a100() -> float:
    return _calc().decode_tokens_per_s(405e9, 2, 2e12)


def _ridge_a100() -> float:
    return _calc().ridge_point(312e12, 2e12)


def _ridge_h100() -> float:
    from minillm import hardware

    return hardware.get("H100-SXM").ridge_point("bf16")


def _matvec_fp16() -> float:
    return _calc().matvec_intensity(8192, 8192, 2)


def _matmul_b64_fp16() -> float:
    return _calc().matmul_intensity(64, 8192, 8192, 2)


def _prefill_7b_tflop() -> float:
    return _calc().prefill_flops(7e9, 1000) / 1e12


def _spec_accept() -> float:
    return _calc().spec_acceptance_probability(0.3, 0.6)


def _static_waste() -> float:
    return _calc().static_batch_wasted_steps([20] * 7 + [500])


QUESTIONS = [
    Numeric(
        "q1",
        "How many GB do the weights of a 13B-parameter model take in fp16?",
        answer=_weights_13b_gb, unit="GB", rtol=0.02,
        explanation="fp16 stores each parameter in 2 bytes: 13 × 10⁹ × 2 B = 26 × 10⁹ B = 26 GB "
                    "(24.2 GiB). Every decode step reads all of it.",
    ),
    Numeric(
        "q2",
        "A 70B model in fp16 decodes at batch 1 on an A100 (take 2 TB/s). What is the "
        "bandwidth-bound ceiling, in tokens per second?",
        answer=_tok_s_70b_a100, unit="tok/s", rtol=0.05,
        explanation="Each token reads all 140 GB of weights: 2 × 10¹² B/s ÷ 140 × 10⁹ B = 14.3 tok/s. "
                    "With the A100-80GB's exact 2.039 TB/s it is 14.6; the KV cache read on top makes "
                    "the real ceiling a little lower still. No kernel beats it at batch 1.",
    ),
    Numeric(
        "q3",
        "Same A100 (2 TB/s), same fp16: the ceiling for a 405B model at batch 1?",
        answer=_tok_s_405b_a100, unit="tok/s", rtol=0.05,
        explanation="810 GB per token: 2 × 10¹² ÷ 810 × 10⁹ = 2.47 tok/s (7B: 143 tok/s). It would "
                    "not even fit on one A100: the arithmetic only says what the bandwidth allows.",
    ),
    Numeric(
        "q4",
        "The ridge point of an A100: 312 TFLOP/s of fp16 tensor-core compute over 2 TB/s. "
        "How many FLOPs per byte?",
        answer=_ridge_a100, unit="", rtol=0.03,
        explanation="312 × 10¹² ÷ 2 × 10¹² = 156 FLOP/byte (153 with the exact 2.039 TB/s). A kernel "
                    "needs more than 156 FLOPs per byte it moves to keep the tensor cores busy.",
    ),
    Numeric(
        "q5",
        "The ridge point of an H100 SXM: about 989 TFLOP/s dense bf16 over 3.35 TB/s. "
        "How many FLOPs per byte?",
        answer=_ridge_h100, unit="", rtol=0.03,
        explanation="989 ÷ 3.35 = 295 FLOP/byte. Compute grew faster than bandwidth from A100 to H100, "
                    "so the ridge moved right: batch-1 decode is even further below it.",
    ),
    Numeric(
        "q6",
        "Arithmetic intensity of one batch-1 decode matrix-vector product, y = W·x, with W of "
        "8192 × 8192 in fp16 (read W and x once, write y once)?",
        answer=_matvec_fp16, unit="", rtol=0.02,
        explanation="2·8192² FLOPs over (8192² + 2·8192) × 2 bytes = 0.9998 ≈ 1 FLOP/byte: one "
                    "multiply-add per 2-byte weight. In fp32 (this lab's engine on a CPU) it is 0.5. "
                    "Both sit two orders of magnitude left of any GPU's ridge.",
    ),
    Numeric(
        "q7",
        "Now decode a batch of 64 sequences through the same 8192 × 8192 fp16 weight "
        "(a 64 × 8192 by 8192 × 8192 matmul). Its arithmetic intensity?",
        answer=_matmul_b64_fp16, unit="", rtol=0.03,
        explanation="2·64·8192² FLOPs over (64·8192 + 8192² + 64·8192) × 2 bytes = 62 FLOP/byte. Each "
                    "weight read now serves 64 tokens, so intensity grows almost linearly with the "
                    "batch until it reaches the ridge (156 on an A100): then decode is compute-bound.",
    ),
    Numeric(
        "q8",
        "Prefill of a 1,000-token prompt through a 7B model costs about 2·N·L FLOPs. How many TFLOPs?",
        answer=_prefill_7b_tflop, unit="TFLOP", rtol=0.03,
        explanation="2 × 7 × 10⁹ × 1000 = 1.4 × 10¹³ FLOPs = 14 TFLOP, while the weights are read "
                    "once (14 GB): 1000 FLOPs per byte, far right of the ridge. Prefill is compute-bound, "
                    "decode (2·N per token over the same 14 GB) memory-bound.",
    ),
    Numeric(
        "q9",
        "**Measured.** From the bandwidth you measured on this machine, predict your batch-1 decode "
        "speed of SmolLM2-135M in fp32 (about 538 MB of weights read per token, plus a few MB of "
        "KV cache). It is marked against the real decode step measured in section 5. A real step "
        "reaches only part of the bandwidth ceiling (often 40–80%), so any prediction up to 2.5 times "
        "the measured speed counts as right.",
        answer=lambda m: m["decode_tok_s"], unit="tok/s", rtol=1.5,
        needs=("decode_tok_s",), example_measured={"decode_tok_s": 25.0},
        explanation="Ceiling = bandwidth ÷ bytes per token, e.g. 25 GB/s ÷ 0.54 GB ≈ 46 tok/s. The "
                    "measured step reaches part of it (often 40–80%; less when other programs "
                    "compete for the cores): the bandwidth test streams one long array, while "
                    "a decode step runs ~120 matrix products, each with its own start-up cost, plus "
                    "norms, RoPE and attention. gpt-fast-style engines report this fraction "
                    "(achieved GB/s ÷ peak GB/s) next to tok/s.",
    ),
    Choice(
        "q10",
        "On this lab's roofline, the measured decode step moves right and up as the batch grows. Why?",
        options=[
            Option("Each weight read is shared by more tokens, so FLOPs per byte grow with the batch",
                   correct=True,
                   why="Bytes stay ≈ the weights (plus a small KV cache per sequence) while FLOPs grow "
                       "as 2·N·B: intensity ≈ B × (batch-1 intensity), until the compute roof."),
            Option("Larger batches make the memory faster",
                   why="Bandwidth is a property of the machine; the slope of the roof does not move."),
            Option("The KV cache shrinks when the batch grows",
                   why="Each sequence has its own cache, so KV bytes grow with the batch: that is what "
                       "eventually bends decode away from the ideal B× line."),
            Option("Decode becomes a matrix-vector product at large batch",
                   why="It is the other way round: batch 1 is a matrix-vector product; a batch turns "
                       "it into a matrix-matrix product."),
        ],
    ),
    Choice(
        "q11",
        "On this CPU (no native bf16), a large bf16 matmul is several times slower than fp32, yet "
        "the bf16 LM-head matrix-vector product is faster. What explains both?",
        options=[
            Option("The matmul is compute-bound (bf16 arithmetic is emulated), the matvec memory-bound "
                   "(bf16 reads half the bytes)", correct=True,
                   why="Which roof binds decides which property of the dtype matters: FLOP rate on the "
                       "right of the ridge, bytes per element on the left."),
            Option("bf16 has fewer exponent bits, so it overflows in the matmul",
                   why="bf16 has fp32's 8 exponent bits; the slowdown is arithmetic throughput, not "
                       "overflow."),
            Option("The matvec is cached in L1, the matmul is not",
                   why="The 49152 × 576 LM head is 113 MB in fp32, far beyond any cache: it streams "
                       "from DRAM, which is exactly why halving its bytes helps."),
        ],
    ),
    Numeric(
        "q12",
        "**Looking ahead (Lab 07).** Speculative decoding exists because verifying k drafted "
        "tokens costs about one memory-bound step. A draft proposes a token with probability "
        "q = 0.6; the target model gives it p = 0.3. With what probability is it accepted?",
        answer=_spec_accept, unit="", rtol=0.01,
        explanation="Accept with min(1, p / q) = min(1, 0.3 / 0.6) = 0.5. On rejection, resample from "
                    "norm(max(0, p − q)): the output then follows the target's distribution exactly.",
    ),
    Numeric(
        "q13",
        "**Looking ahead (Lab 05).** Batching is the cure for the memory wall, but a static batch runs "
        "until its longest member is done. 7 requests need 20 output tokens and one needs 500. How "
        "many slot-steps are wasted (a finished request's slot idling for one step)?",
        answer=_static_waste, unit="", rtol=0.0, atol=0.5,
        explanation="The batch lasts 500 steps; each short request idles 500 − 20 = 480 of them: "
                    "7 × 480 = 3,360 slot-steps, 84% of the 4,000. Continuous batching (Lab 05) refills "
                    "a slot as soon as it frees.",
    ),
]
