"""Lab 01 quiz: the memory wall and the roofline, the launch wall, and a profiled step.

Numeric answers come from ``minillm.calc`` (imported inside the answer functions, so
importing this bank stays cheap). No answer is a number the lab prints: the textbook
questions ask for a new case or the inverse of a printed one.

Two questions are predictions (``predict=True``), asked in the notebook's ``predict:<id>``
cells before the measurement they predict, and marked against it:

- q13: the eager decode step of section 8 (``eager_step_ms``), predicted from its two floors
  (bytes and launches) measured just before (on a GPU also at least its kernel floor, which
  an eager step never reaches);
- q9: the compiled decode step of section 8 (``compiled_step_ms``; measured outside quick
  mode), predicted from the floors of its counts, as q13 from eager's (on a CPU it issues a
  fraction of eager's operator calls: the bytes floor decides; on a GPU its generated
  code's launches, priced at their own measured cost, join its launch floor).

Section 5's batch-1 step against the section-1 matvec ceiling is printed, not predicted: on
a machine with fast memory the per-step overhead is a third of the step, and the 121 small
matrices stream slower than section 1's single large one (section 8 measures both).

q12 and q15 are computed from the student's own measurements (the prefill against a
decode step; the profile of section 9), which the lab prints only as their ingredients.
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 01 quiz: the memory wall and the roofline"


def _calc():
    from minillm import calc

    return calc


def _weights_13b_gb() -> float:
    return _calc().weight_bytes(13e9, 2) / 1e9


def _matmul_b64_fp16() -> float:
    return _calc().matmul_intensity(64, 8192, 8192, 2)


def _prefill_7b_tflop() -> float:
    return _calc().prefill_flops(7e9, 1000) / 1e12


def _required_tb_s() -> float:
    """Bandwidth (TB/s) for 70B fp16 weights at 50 tok/s, batch 1."""
    return _calc().weight_bytes(70e9, 2) * 50 / 1e12


def _bits_405b_10tok() -> float:
    """Bits per weight that let 405B decode at 10 tok/s on 2 TB/s (weights only)."""
    return 2e12 / 10 / 405e9 * 8


def _ridge_mi300x() -> float:
    return _calc().ridge_point(1307e12, 5.3e12)


def _crossover_a100_512() -> float:
    """Llama-2-70B fp16 on an A100 (312 TFLOP/s, 2 TB/s), 512 cached tokens per sequence."""
    calc = _calc()
    kv = calc.kv_cache_bytes(80, 8, 128, 512, 2)
    return calc.decode_crossover_batch(2 * 70e9, 70e9 * 2, kv, calc.ridge_point(312e12, 2e12))


def _matvec_int8() -> float:
    return _calc().matvec_intensity(11008, 4096, 1)


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
        "A 70B model in fp16 must decode at 50 tokens per second at batch 1 (weights only, no KV "
        "cache). How much memory bandwidth does that take, in TB/s?",
        answer=_required_tb_s, unit="TB/s", rtol=0.05,
        explanation="Each token reads all 140 GB of weights, so 50 tok/s needs 140 × 10⁹ B × 50 /s = "
                    "7 × 10¹² B/s = 7 TB/s: twice an H100's 3.35 TB/s. At batch 1 the only ways there "
                    "are fewer bytes per weight (Lab 06) or the weights spread over several GPUs, each "
                    "reading its share in parallel (Lab 08).",
    ),
    Numeric(
        "q3",
        "A 405B model should decode at 10 tokens per second at batch 1 on an A100 (take 2 TB/s), "
        "weights only. How many bits per weight can it afford at most?",
        answer=_bits_405b_10tok, unit="", rtol=0.05,
        explanation="10 tok/s at 2 TB/s allows 2 × 10¹² ÷ 10 = 200 GB per token; over 405 × 10⁹ weights "
                    "that is 0.49 bytes = 3.95 bits each. So about 4-bit weights (Lab 06), and even "
                    "then 200 GB do not fit on one 80 GB card: the arithmetic only says what the "
                    "bandwidth allows.",
    ),
    Numeric(
        "q4",
        "An AMD MI300X offers about 1,307 TFLOP/s of dense fp16 compute and 5.3 TB/s of memory "
        "bandwidth. Where is its ridge point, in FLOPs per byte?",
        answer=_ridge_mi300x, unit="", rtol=0.03,
        explanation="The roofs meet where intensity × bandwidth = peak: 1307 × 10¹² ÷ 5.3 × 10¹² = 247 "
                    "FLOP/byte, between an A100 (156) and an H100 (295). Batch-1 decode at about 1 "
                    "FLOP/byte is far left of all three.",
    ),
    Numeric(
        "q5",
        "Llama-2-70B in fp16 (2·N = 140 GFLOPs per sequence per step, 140 GB of weights) decodes on "
        "an A100 (312 TFLOP/s, 2 TB/s). Each sequence has 512 cached tokens, 0.168 GB of KV cache "
        "(80 layers, 8 KV heads, head_dim 128). From which batch size is the decode step "
        "compute-bound? Use your decode_crossover_batch reasoning.",
        answer=_crossover_a100_512, unit="", rtol=0.05,
        explanation="Intensity B·f ÷ (W + B·k) reaches the ridge 156 when B = 156·W ÷ (f − 156·k) = "
                    "156 × 140 ÷ (140 − 26.2) ≈ 192. With 4,096 cached tokens (k = 1.34 GB) f ÷ k = 104 "
                    "is below the ridge, and no batch gets there: long contexts keep decode memory-bound.",
    ),
    Numeric(
        "q6",
        "Arithmetic intensity of one batch-1 matrix-vector product through a Llama-7B MLP weight of "
        "11008 × 4096 stored in **int8** (1 byte per weight, and take 1 byte for x and y too)?",
        answer=_matvec_int8, unit="", rtol=0.02,
        explanation="2·11008·4096 FLOPs over (11008·4096 + 4096 + 11008) × 1 byte = 2.0 FLOP/byte: one "
                    "multiply-add per 1-byte weight. Halving the bytes per weight doubles the intensity "
                    "(fp32 0.5, fp16 1, int8 2), and still leaves decode far left of any GPU's ridge.",
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
        "**Predict, then measure.** Section 8 measured the bytes floor of a decode step and the cost "
        "of a launch. `torch.compile` fuses the glue between the weight products. On a CPU the "
        "compiled step issues a fraction of eager's operator calls (its generated code runs the "
        "glue and calls only the products and attention); on a GPU it still launches each "
        "fused kernel, unless a CUDA graph replays them. Predict the compiled step's time in ms "
        "before the cell measures it, from its floors. Marked against the measured compiled "
        "step, within 20%.",
        answer=lambda m: m["compiled_step_ms"], unit="ms", rtol=0.2, predict=True,
        needs=("compiled_step_ms",), example_measured={"compiled_step_ms": 13.8},
        explanation="Its floors, from its counts: on a CPU its operator calls (its few from Python, "
                    "the products and attention its generated code calls) add a few hundred "
                    "microseconds, so the bytes floor decides. E.g. 538 MB ÷ 38.7 GB/s = 13.9 ms, "
                    "plus 165 calls × 2.0 µs = 0.34 ms: 14.2 ms predicted, 13.8 ms measured on a "
                    "2-core EPYC (+3%). Adding the eager step's launch floor instead predicts "
                    "eager, not compiled. On a GPU the compiled step without a CUDA graph still "
                    "launches each fused kernel from its generated code (each priced at what one "
                    "launch from compiled code costs, measured) and calls the products through "
                    "PyTorch, so its launch floor should rule; the CUDA-graph rows replay them with "
                    "one launch.",
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
        "Section 5's table timed a 128-token prefill and a batch-1 decode step. How many times more "
        "tokens per second does the prefill process than batch-1 decode? Compute it from the two "
        "rows of your table.",
        answer=lambda m: m["prefill_tok_s"] / m["decode_tok_s"], unit="x", rtol=0.05,
        needs=("prefill_tok_s", "decode_tok_s"),
        example_measured={"prefill_tok_s": 629.0, "decode_tok_s": 36.2},
        explanation="Prefill tok/s = 128 ÷ its time, decode tok/s = 1 ÷ the batch-1 step: e.g. "
                    "128 ÷ 0.203 s = 629 tok/s against 36.2, 17×. Both read the weights once, but the "
                    "prefill spends each weight read on 128 tokens: it sits far right on the roofline, "
                    "against the compute roof, while batch-1 decode waits for memory.",
    ),
    Numeric(
        "q13",
        "**Predict, then measure.** Section 8 measured the cost of one launch, counted the "
        "operations of one eager decode step (on a GPU also its Triton launches, and the cost of "
        "one) and computed its bytes floor. Predict the eager step's time in ms before the next "
        "cell measures it: on a CPU the launch floor (operator calls × the cost of one) plus the "
        "bytes floor, on a GPU the larger of the bytes floor and the launch floor (operator "
        "calls × the cost of one, plus Triton launches × the cost of one Triton launch; the "
        "step also takes at least its kernels × one kernel's cost, which an eager step never "
        "reaches). Marked against the measured step, within 20%.",
        answer=lambda m: m["eager_step_ms"], unit="ms", rtol=0.2, predict=True,
        needs=("eager_step_ms",), example_measured={"eager_step_ms": 24.9},
        explanation="E.g. 1,223 launches × 2.06 µs = 2.5 ms, plus 538 MB ÷ 22.0 GB/s = 24.5 ms: 27.0 ms "
                    "predicted, 24.9 ms measured on a 2-core CPU (one core issues each operation, then "
                    "runs it, so the floors add). On an H100 (2026-11-27) 1,252 operator calls at "
                    "9.5 µs were 11.9 ms of a 19.5 ms eager step and its ~95 Triton launches the "
                    "rest, ~80 µs each (Triton's launcher is Python too), against 0.09 ms of bf16 "
                    "weights: the step waits for the host. Counting only the launches the "
                    "profiler lists (158 at 9.5 µs) predicts 1.5 ms: views launch nothing but cost "
                    "the host a dispatch, and a Triton launch costs it several.",
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
    Numeric(
        "q15",
        "Section 9's profile split one decode step into the weight products, attention and the "
        "rest. Suppose the weights were stored in half the bytes (bf16 instead of fp32; on a GPU, "
        "int8 instead of bf16) and the weight products took exactly half their profiled time, "
        "everything else unchanged. How many times faster would the step be? Compute it from your "
        "profile's numbers.",
        answer=lambda m: m["profile_step_ms"] / (m["profile_step_ms"] - m["profile_weights_ms"] / 2),
        unit="x", rtol=0.05,
        needs=("profile_step_ms", "profile_weights_ms"),
        example_measured={"profile_step_ms": 32.0, "profile_weights_ms": 25.0},
        explanation="Amdahl's law: new step = step − weights ÷ 2, e.g. 32 − 12.5 = 19.5 ms, 1.64× "
                    "faster, not 2×: the part that does not shrink caps the gain. Section 6 measured "
                    "the bf16 step itself; the profile says how much of that gain was possible. On a "
                    "GPU the weight products are a small share of an eager step, so halving their "
                    "bytes barely moves it: the launches are the bin to shrink (section 8).",
    ),
]
