"""Lab 06 quiz: quantization. Every number comes from ``minillm.calc`` (imported in the answer
functions) except q7, which reads what the lab measured on this machine: the bandwidth and
the w4 model's weight bytes per token (``quizzes.record(bandwidth_GBps=...,
w4_mb_per_token=...)`` in the notebook's speed section)."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 06: quantization"

_EXAMPLE = (0.12, -0.83, 0.45, -0.21)


def _calc():
    from minillm import calc

    return calc


def _scale() -> float:
    return _calc().symmetric_quantize(_EXAMPLE, 4)[0]


def _max_error() -> float:
    _, _, deq = _calc().symmetric_quantize(_EXAMPLE, 4)
    return max(abs(a - b) for a, b in zip(_EXAMPLE, deq))


def _gb(bits: int | None, group_size=None) -> float:
    calc = _calc()
    if bits is None:
        return calc.weight_bytes(70e9, 2) / 1e9
    return calc.quantized_weight_bytes(70e9, bits, group_size) / 1e9


def _shrink_g128() -> float:
    return _gb(None) / _gb(4, 128)


def _bits_per_weight_asym_g64() -> float:
    # 4-bit values, one fp16 scale and one 8-bit zero per group of 64: 3 bytes of metadata.
    return _calc().quantized_weight_bytes(1e6, 4, 64, scale_bytes=3) * 8 / 1e6


QUESTIONS = [
    Numeric("q1", "Symmetric 4-bit quantization of the group [0.12, −0.83, 0.45, −0.21]: what is "
                  "the scale?",
            answer=_scale, unit="", rtol=0.01,
            explanation="scale = max|w| ÷ (2^(b−1) − 1) = 0.83 ÷ 7 = 0.1186. Then q = round(w ÷ "
                        "scale) = [1, −7, 4, −2] (calc.symmetric_quantize)."),
    Numeric("q2", "... and the largest absolute error after dequantizing (q · scale)?",
            answer=_max_error, unit="", rtol=0.03,
            explanation="ŵ = [0.119, −0.830, 0.474, −0.237]; the errors are 0.001, 0, 0.024 and "
                        "0.027. At most half a step, scale ÷ 2 = 0.059."),
    Numeric("q3", "Weights of a 70B-parameter model in fp16, in GB?",
            answer=lambda: _gb(None), unit="GB", rtol=0.02,
            explanation="70 × 10⁹ × 2 B = 140 GB: two 80 GB GPUs before any KV cache."),
    Numeric("q4", "The same 70B model in int8 with one fp16 scale per group of 128 weights, in GB "
                  "(count the scales)?",
            answer=lambda: _gb(8, 128), unit="GB", rtol=0.005,
            explanation="70 × 10⁹ × 1 B + (70 × 10⁹ ÷ 128) × 2 B = 70 + 1.09 = 71.1 GB "
                        "(calc.quantized_weight_bytes(70e9, 8, 128))."),
    Numeric("q5", "... and in int4 with one fp16 scale per group of 128 (count the scales)?",
            answer=lambda: _gb(4, 128), unit="GB", rtol=0.005,
            explanation="70 × 10⁹ × 0.5 B + 1.09 GB of scales = 36.1 GB: one 80 GB GPU, with room "
                        "for the KV cache. Forgetting the scales says 35."),
    Numeric("q6", "By what factor does int4 with g128 fp16 scales shrink the fp16 weights?",
            answer=_shrink_g128, unit="x", rtol=0.01,
            explanation="16 bits ÷ (4 + 16/128) bits = 16 ÷ 4.125 = 3.88×, not 4×. Memory-bound "
                        "decode can get up to that much faster; the KV cache does not shrink."),
    Numeric("q7", "**Predict.** From the bandwidth you measured and the bytes per token of the "
                  "w4 g64 model (section 6), what is the batch-1 decode ceiling of the w4 model on "
                  "this device, in tok/s? It is marked against bandwidth ÷ bytes as measured "
                  "(within 20%); the cell after the question then times the real decode.",
            answer=lambda m: m["bandwidth_GBps"] * 1e3 / m["w4_mb_per_token"], unit="tok/s",
            rtol=0.2, needs=("bandwidth_GBps", "w4_mb_per_token"),
            example_measured={"bandwidth_GBps": 20.0, "w4_mb_per_token": 171.0},
            explanation="Ceiling = bandwidth ÷ bytes per token, e.g. 20 GB/s ÷ 0.171 GB = 117 tok/s. "
                        "The measured step reaches only part of it: the LM head and norms, the "
                        "attention and a hundred small kernel calls do not shrink with the weights, "
                        "so the speedup over fp32 is smaller than the ratio of bytes."),
    Choice("q8", "Why does quantize_model keep the LM head in floating point by default?",
           options=[
               Option("Its error goes straight into the logits, with no later layer to absorb it, "
                      "at the very step where the next token is chosen", correct=True,
                      why="Section 7 measures both: quantizing the head saves a large share of the "
                          "bytes, and the KL to fp32 grows with it. Keeping it float (or at 8 bits) "
                          "is the usual compromise."),
               Option("The LM head cannot be quantized because it is tied to the embedding",
                      why="It can (lm_head=True): the embedding then keeps its own float table for "
                          "lookups."),
               Option("It is too small to matter",
                      why="In SmolLM2 it is a fifth of the weights (49152 × 576), the largest single "
                          "matrix: it matters a lot for speed."),
               Option("Integer kernels cannot produce a 49,152-wide output",
                      why="The kernels do not care about the width; the question is accuracy."),
           ]),
    Choice("q9", "Which method pushes each weight's rounding error onto the columns not yet rounded?",
           options=[
               Option("GPTQ", correct=True,
                      why="Through the inverse Hessian of the layer's inputs: W[:, i:] −= err · U[i, i:]."),
               Option("AWQ", why="AWQ rescales salient input channels before rounding; each weight is "
                                 "then rounded on its own."),
               Option("RTN", why="Round-to-nearest rounds every weight independently."),
           ]),
    Choice("q10", "Why does the lab use groups of 64 on SmolLM2 instead of the common 128?",
           options=[
               Option("The hidden size is 576 = 9 × 64: 128 does not divide it, so groups of 128 "
                      "cannot tile the rows of q|k|v, o and gate|up", correct=True,
                      why="Only down_proj (1536 inputs) takes g128; quantize_model says so."),
               Option("Smaller groups are always faster",
                      why="More groups mean more scales to read: g64 costs slightly more bytes than "
                          "g128."),
               Option("128 exceeds int4's range", why="The group size counts weights, not levels."),
           ]),
    Choice("q11", "Per-tensor int8 quantization of the activations entering q|k|v loses most channels' "
                  "precision. Why?",
           options=[
               Option("A few outlier channels are tens to hundreds of times larger than the rest; one "
                      "scale sized for them leaves the ordinary channels only a few levels",
                      correct=True,
                      why="That is why LLM.int8() keeps outlier channels in fp16, SmoothQuant moves "
                          "them into the weights, and weight-only schemes leave activations float."),
               Option("int8 cannot represent negative numbers",
                      why="Symmetric int8 spans −127 … 127."),
               Option("Activations change from token to token, so no scale fits",
                      why="Dynamic per-token scales handle that; the outlier channels are a problem "
                          "within every token."),
           ]),
    Numeric("q12", "Asymmetric 4-bit weights with groups of 64, one fp16 scale and one 8-bit zero "
                   "point per group: how many bits per weight, metadata included?",
            answer=_bits_per_weight_asym_g64, unit="", rtol=0.01,
            explanation="4 + (16 + 8) ÷ 64 = 4.375 bits: 9% more than the bare 4 bits. It is what "
                        "quant.packed_bytes counts for this lab's w4 g64 layers."),
]
