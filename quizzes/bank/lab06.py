"""Lab 06 quiz: quantization. The computed answers come from ``minillm.calc`` and
``minillm.quant.gguf_types`` (imported in the answer functions). Three questions are
predictions, each asked in a ``predict:`` cell before the cell that measures it and marked
against that measurement (``quizzes.record`` in the notebook): q13 the tensor bytes of the
shipped GGUF file (section 6), q14 the bytes per token of w4 with an 8-bit LM head and q7
the decode speed with a 4-bit head (section 8). No other answer is printed in the lab: the
computed questions ask for a new case (3 bits instead of 4, g128 instead of g64, Q5_K
instead of Q4_K)."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 06: quantization"

_EXAMPLE = (0.12, -0.83, 0.45, -0.21)


def _calc():
    from minillm import calc

    return calc


def _scale() -> float:
    return _calc().symmetric_quantize(_EXAMPLE, 3)[0]


def _max_error() -> float:
    _, _, deq = _calc().symmetric_quantize(_EXAMPLE, 3)
    return max(abs(a - b) for a, b in zip(_EXAMPLE, deq))


def _gb(bits: int | None, group_size=None) -> float:
    calc = _calc()
    if bits is None:
        return calc.weight_bytes(70e9, 2) / 1e9
    return calc.quantized_weight_bytes(70e9, bits, group_size) / 1e9


def _shrink_g64() -> float:
    return _gb(None) / _gb(4, 64)


def _bits_per_weight_asym_g128() -> float:
    # 4-bit values, one fp16 scale and one 8-bit zero per group of 128: 3 bytes of metadata.
    return _calc().quantized_weight_bytes(1e6, 4, 128, scale_bytes=3) * 8 / 1e6


def _q5_k_bits() -> float:
    from minillm.quant import gguf_types

    return gguf_types.bits_per_weight("Q5_K")


QUESTIONS = [
    Numeric("q1", "The lab's worked example [0.12, −0.83, 0.45, −0.21] at **3 bits**, symmetric: what "
                  "is the scale?",
            answer=_scale, unit="", rtol=0.01,
            explanation="scale = max|w| ÷ (2^(b−1) − 1) = 0.83 ÷ 3 = 0.2767: at 3 bits the symmetric "
                        "levels are −3 … 3. Then q = round(w ÷ scale) = [0, −3, 2, −1] "
                        "(calc.symmetric_quantize(..., 3))."),
    Numeric("q2", "... and the largest absolute error after dequantizing (q · scale), still at 3 bits?",
            answer=_max_error, unit="", rtol=0.03,
            explanation="ŵ = [0, −0.830, 0.553, −0.277]; the errors are 0.12, 0, 0.103 and 0.067. "
                        "0.12 rounds to 0 because it is under half a step (scale ÷ 2 = 0.138): at 3 "
                        "bits small weights vanish, which is why 3-bit RTN falls apart in section 5."),
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
    Numeric("q6", "By what factor does symmetric int4 with one fp16 scale per group of **64** shrink "
                  "the fp16 weights?",
            answer=_shrink_g64, unit="x", rtol=0.01,
            explanation="16 bits ÷ (4 + 16/64) bits = 16 ÷ 4.25 = 3.76×, not 4× (with groups of 128: "
                        "16 ÷ 4.125 = 3.88×). Memory-bound decode can get at most that much faster; "
                        "the KV cache does not shrink."),
    Numeric("q7", "**Predict, then measure** (section 8). Two measured points, the w4 g64 model with a "
                  "float LM head and with an 8-bit head, fix a step's time as t = t₀ + bytes ÷ B. "
                  "Predict the decode speed, in tok/s, of the same model with a **4-bit** head (groups "
                  "of 64, asymmetric). It is marked against the speed the next cell measures, within 20%.",
            answer=lambda m: m["head4_tok_s"], unit="tok/s", rtol=0.2, needs=("head4_tok_s",),
            predict=True, example_measured={"head4_tok_s": 94.9},
            explanation="The 4-bit head saves (8 − 4) ÷ 8 bytes per head weight against the 8-bit one: "
                        "28.3 M × 0.5 B = 14.2 MB less per token. t = t₀ + bytes ÷ B with t₀ and B "
                        "from the two measured points gives the speed. The ratio of bytes alone "
                        "overestimates it: t₀ (attention, norms, sampling, kernel calls, unpacking) "
                        "does not shrink with the weights."),
    Choice("q8", "Why does quantize_model keep the LM head in floating point by default?",
           options=[
               Option("Its error goes straight into the logits, with no later layer to absorb it, "
                      "at the very step where the next token is chosen", correct=True,
                      why="Section 8 measures both: quantizing the head saves a large share of the "
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
                      why="Through the inverse Hessian of the layer's inputs (its Cholesky factor)."),
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
    Numeric("q12", "Asymmetric 4-bit weights with groups of **128**, one fp16 scale and one 8-bit zero "
                   "point per group: how many bits per weight, metadata included?",
            answer=_bits_per_weight_asym_g128, unit="", rtol=0.01,
            explanation="4 + (16 + 8) ÷ 128 = 4.1875 bits, against 4.375 with the lab's groups of 64: "
                        "larger groups halve the metadata and cost accuracy (section 1's table)."),
    Numeric("q13", "**Predict, then measure** (section 6). From the weights of each tensor type in the "
                   "shipped GGUF file and what a block of each type stores (Q4_1: 32 weights in an fp16 "
                   "scale, an fp16 minimum and 16 bytes of nibbles; Q8_0: 32 int8 values and an fp16 "
                   "scale; F32: 4 bytes a value), predict the file's tensor data in MB. It is marked "
                   "against the bytes the file reports, within 5%.",
            answer=lambda m: m["gguf_tensor_mb"], unit="MB", rtol=0.05, needs=("gguf_tensor_mb",),
            predict=True, example_measured={"gguf_tensor_mb": 96.58},
            explanation="Q4_1 is 20 bytes per 32 weights (5 bits), Q8_0 34 bytes per 32 (8.5 bits): "
                        "106.2 M × 5 ÷ 8 + 28.3 M × 8.5 ÷ 8 + 35 k × 4 = 66.4 + 30.1 + 0.1 = 96.6 MB. "
                        "Forgetting the scales and minimums (4 and 8 bits) says 81 MB, 16% short."),
    Numeric("q14", "**Predict, then measure** (section 8). The w4 g64 model reads its bytes per token "
                   "with a float LM head (section 7). Quantize the head (49,152 × 576, tied to the "
                   "embedding) to 8 bits in asymmetric groups of 64, with the same metadata as the "
                   "layers. Predict the new bytes per token, in MB; marked against the model's "
                   "measured bytes, within 5%.",
            answer=lambda m: m["head8_mb_per_token"], unit="MB", rtol=0.05,
            needs=("head8_mb_per_token",), predict=True, example_measured={"head8_mb_per_token": 87.8},
            explanation="The float head is 28.3 M × 4 B = 113.2 MB of the 171.4; at 8 + 24 ÷ 64 = 8.375 "
                        "bits it is 29.6 MB: 171.4 − 113.2 + 29.6 = 87.8 MB. The head was two thirds of "
                        "what a w4 step read."),
    Numeric("q15", "llama.cpp's Q4_K stores a super-block of 256 weights as 4-bit values, 8 sub-blocks "
                   "with a 6-bit scale and a 6-bit minimum each, and an fp16 scale and an fp16 minimum "
                   "for the super-block: 4.5 bits per weight. **Q5_K** is the same with 5-bit values. "
                   "How many bits per weight does it cost?",
            answer=_q5_k_bits, unit="", rtol=0.01,
            explanation="(256 × 5 + 8 × (6 + 6) + 2 × 16) ÷ 256 = (1280 + 96 + 32) ÷ 256 = 5.5 bits "
                        "(176 bytes a super-block; gguf_types.BLOCKS). The 6-bit sub-block scales are "
                        "what make K-quants cheaper than Q4_1/Q5_1's fp16 scale and minimum per 32."),
    Choice("q16", "A Q4_K_M file of SmolLM2 stores most of its matrices as Q5_0, not Q4_K (section 6). Why?",
           options=[
               Option("A K-quant row must be a whole number of 256-weight super-blocks, and SmolLM2's "
                      "rows are 576 weights long: llama.cpp falls back to a 32-block type",
                      correct=True,
                      why="576 = 2.25 × 256. Only ffn_down, whose rows are 1536 = 6 × 256, keeps "
                          "K-quants (Q4_K, and Q6_K in the layers that get more bits); Q4_K falls "
                          "back to Q5_0 and Q6_K to Q8_0, so this Q4_K_M is larger than Q4_1."),
               Option("Q4_K_M means 'medium': it always stores 5 bits",
                      why="The M is the mix: Q6_K for the tensors that hurt most (output, half of "
                          "attn_v and ffn_down), Q4_K for the rest, where the rows fit."),
               Option("Small models are quantized with more bits on purpose",
                      why="llama.cpp's rules look at tensor roles, layer positions and row lengths, "
                          "not at the model's size."),
           ]),
    Choice("q17", "FP8 inference stores weights in E4M3, not E5M2. Why?",
           options=[
               Option("A scaled row of weights spans a few decades at most: E4M3's extra mantissa bit "
                      "(precision) is worth more than E5M2's extra exponent bit (range)", correct=True,
                      why="Section 6 measures it: at the same 8 bits, E5M2's rounding moves the model "
                          "further from fp32. E5M2's range is for gradients, whose magnitudes span "
                          "many decades."),
               Option("E5M2 cannot represent 0",
                      why="Both formats have ±0 (and subnormals near it)."),
               Option("E4M3 has a larger largest value",
                      why="The opposite: 448 against 57,344. Per-row scales make the range "
                          "question moot for weights."),
           ]),
]
