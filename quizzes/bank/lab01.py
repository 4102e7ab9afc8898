"""Lab 01 quiz: the memory wall and the roofline, and the launch wall.

Numeric answers come from ``minillm.calc`` and ``minillm.hardware`` (imported inside the
answer functions, so importing this bank stays cheap). q9, q12 and q13 read what the lab
recorded on its device (``quizzes.record``): the bandwidth of section 1 and the bytes per
weight of the lab's dtype (fp32 on a CPU, bf16 on a GPU), the batch-1 decode speed of
section 5, and the launch cost and launches per step of section 8. q12 is the
predict-then-measure question of the memory wall (the ceiling predicted in q9 against the
fraction of it the real step reaches), q13 the launch wall's.
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


def _weight_bytes(dtype_bytes: float) -> float:
    """Bytes of SmolLM2-135M's weights that one token multiplies through, at dtype_bytes per
    weight (4 in fp32, 2 in bf16)."""
    from minillm import ModelConfig, measure

    return measure.matmul_params(ModelConfig.smollm2_135m()) * dtype_bytes


def _ceiling(m: dict) -> float:
    """The batch-1 ceiling from the recorded bandwidth and the lab's dtype, in tok/s."""
    return m["bandwidth_GBps"] * 1e9 / _weight_bytes(m["dtype_bytes"])


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
        "**Predict.** From the bandwidth you measured in section 1, what is the batch-1 decode "
        "ceiling of SmolLM2-135M in this lab's dtype (the first cell's: fp32 on a CPU, bf16 on a "
        "GPU) on this device, in tok/s? Count the weights a token multiplies through (section "
        "2's `measure.matmul_params` × the dtype's bytes: 538 MB in fp32, 269 MB in bf16) and "
        "leave the few MB of KV cache out. It is marked against your measured bandwidth ÷ those "
        "bytes, within 5%.",
        answer=_ceiling, unit="tok/s", rtol=0.05,
        needs=("bandwidth_GBps", "dtype_bytes"),
        example_measured={"bandwidth_GBps": 20.6, "dtype_bytes": 4},
        explanation="Ceiling = bandwidth ÷ bytes per token, e.g. 20.6 GB/s ÷ 0.538 GB = 38 tok/s "
                    "in fp32 on a CPU; 3,000 GB/s ÷ 0.269 GB = 11,000 tok/s in bf16 on an H100. "
                    "Section 5 then measures how much of it a real decode step reaches (q12).",
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
        "On a CPU without native bf16 arithmetic, a large bf16 matmul is several times slower than "
        "fp32, yet the bf16 LM-head matrix-vector product is faster. What explains both?",
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
        "**Predict, then measure.** Section 5 measured the batch-1 decode step. What percentage of "
        "your q9 ceiling did it reach (measured tok/s ÷ ceiling)? Work it out from the table's "
        "batch-1 step time and your ceiling; it is marked against the measured step and your "
        "measured bandwidth, within 20% (relative).",
        answer=lambda m: 100 * m["decode_tok_s"] / _ceiling(m),
        unit="%", rtol=0.2,
        needs=("decode_tok_s", "bandwidth_GBps", "dtype_bytes"),
        example_measured={"decode_tok_s": 20.4, "bandwidth_GBps": 20.6, "dtype_bytes": 4},
        explanation="Measured ÷ ceiling, e.g. 20.4 ÷ 38.3 = 53%. A real step reaches only part of the "
                    "ceiling: the bandwidth test streams one long array, while a decode step runs "
                    "~120 matrix products, each with its own start-up cost, plus norms, RoPE and "
                    "attention, over a thousand operations in all. On a CPU that is often 40–80% "
                    "(less when other programs compete for the cores). On a GPU the same step reaches "
                    "a few percent at most: reading the weights takes a fraction of a millisecond, "
                    "issuing the thousand operations several milliseconds (section 8, the launch "
                    "wall). gpt-fast-style engines report this fraction (achieved GB/s ÷ peak GB/s) "
                    "next to tok/s.",
    ),
    Numeric(
        "q13",
        "**Predict, then measure.** Section 8 measured what one launch costs on this device and "
        "counted the launches of one eager decode step with the profiler. Predict the step's "
        "launch floor, launches per step × the cost of one launch, in ms. It is marked against "
        "your measured launch cost and launch count, within 10%; section 8 then measures the "
        "step itself.",
        answer=lambda m: m["launches_per_step"] * m["launch_us"] / 1e3, unit="ms", rtol=0.1,
        needs=("launches_per_step", "launch_us"),
        example_measured={"launches_per_step": 1223, "launch_us": 3.2},
        explanation="Launch floor = launches × cost of one, e.g. 1,223 × 3.2 µs = 3.9 ms on a "
                    "2-core CPU, where it adds to the 14 ms the fp32 weights take (one core issues "
                    "each operation, then runs it). On an H100 about 900 kernel launches at ~5 µs "
                    "are 4.5 ms against 0.09 ms for the bf16 weights: the GPU waits for the host, "
                    "and decode there is launch-bound. The measured eager step is larger still: "
                    "Python runs around every module and dispatches view operations that launch "
                    "nothing (the ops column).",
    ),
    Choice(
        "q14",
        "On a GPU, SmolLM2's eager batch-1 decode reaches about 1% of its bandwidth ceiling "
        "(69 tok/s against 11,000 on an H100). Which change brings it closest to the ceiling?",
        options=[
            Option("Replay the whole step as a CUDA graph: one launch per step instead of ~900",
                   correct=True,
                   why="The step is bound by what the host issues, not by bytes or FLOPs. A graph "
                       "keeps every kernel but launches them all at once, so the step falls "
                       "toward its bytes floor (torch.compile's fusion helps too, by fewer "
                       "kernels)."),
            Option("A GPU with twice the memory bandwidth",
                   why="The bytes floor is already ~50× below the launch floor: halving it "
                       "changes the step by well under 1%."),
            Option("Store the weights in int4",
                   why="Fewer bytes shrink the bytes floor, which is not the one that binds; the "
                       "dequantizing kernels are launches like any other."),
            Option("A GPU with twice the FLOP/s",
                   why="Batch-1 decode uses well under 1% of a GPU's compute; FLOP/s is the "
                       "roof no decode step touches."),
        ],
    ),
]
