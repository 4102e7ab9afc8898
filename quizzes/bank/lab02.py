"""Lab 02 quiz: the KV cache.

Numeric answers come from ``minillm.calc`` (imported inside the answer functions). Two
questions read values the lab recorded on this machine with ``quizzes.record``:
``kv_bytes`` (the bytes of the real fp32 cache of the speedup run, from its tensors) and
``speedup_max`` (uncached ÷ cached time at the longest length measured). q9 is the
predict-then-measure question: the speedup predicted from the measured step costs.
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 02 quiz: the KV cache"


def _kv_gb(layers, kv_heads, head_dim, seq_len, dtype_bytes=2):
    from minillm import calc

    return calc.kv_cache_bytes(layers, kv_heads, head_dim, seq_len, dtype_bytes) / 1e9


def _gqa_32_8() -> float:
    from minillm import calc

    return calc.gqa_reduction(32, 8)


def _max_batch() -> float:
    from minillm import calc

    return calc.max_concurrent_sequences(80e9, 14e9, 5e9)


def _smollm_per_token_kb() -> float:
    from minillm import calc

    return calc.kv_cache_bytes_per_token(30, 3, 64, 4) / 1e3


QUESTIONS = [
    Numeric(
        "q1",
        "Llama-2-70B has 80 layers, 8 KV heads and head_dim 128. How many GB does its KV cache take "
        "for one sequence of 4,096 tokens in fp16?",
        answer=lambda: _kv_gb(80, 8, 128, 4096), unit="GB", rtol=0.02,
        explanation="2 (K and V) × 80 × 8 × 128 × 4096 × 2 B = 1.34 × 10⁹ B = 1.34 GB (1.25 GiB): "
                    "327,680 bytes per token.",
    ),
    Numeric(
        "q2",
        "The same model with multi-head attention, i.e. 64 KV heads (one per query head): "
        "the KV cache of that 4,096-token sequence, in GB?",
        answer=lambda: _kv_gb(80, 64, 128, 4096), unit="GB", rtol=0.02,
        explanation="8 times the GQA figure: 2 × 80 × 64 × 128 × 4096 × 2 B = 10.7 GB per sequence. "
                    "Eight such sequences would fill an 80 GB GPU before the 140 GB of weights.",
    ),
    Numeric(
        "q3",
        "A model has 32 query heads and 8 KV heads (GQA). How many times smaller is its KV cache "
        "than with MHA?",
        answer=_gqa_32_8, unit="x", rtol=0.01,
        explanation="The cache stores one K and one V per KV head: 32 ÷ 8 = 4× smaller. The query "
                    "heads are untouched, so the attention FLOPs do not change; only the bytes do.",
    ),
    Numeric(
        "q4",
        "Llama-3-8B: 32 layers, 8 KV heads, head_dim 128. KV cache of one 8,192-token sequence in "
        "fp16, in GB?",
        answer=lambda: _kv_gb(32, 8, 128, 8192), unit="GB", rtol=0.02,
        explanation="2 × 32 × 8 × 128 × 8192 × 2 B = 1.07 GB: 131,072 bytes (128 KiB) per token.",
    ),
    Numeric(
        "q5",
        "GPT-3 175B uses MHA: 96 layers, 96 KV heads, head_dim 128. Its KV cache for one 4,096-token "
        "sequence in fp16, in GB (10⁹ bytes)?",
        answer=lambda: _kv_gb(96, 96, 128, 4096), unit="GB", rtol=0.02,
        explanation="2 × 96 × 96 × 128 × 4096 × 2 B = 19.3 × 10⁹ B = 19.3 GB. Texts that say "
                    "\"about 18 GB\" are quoting GiB (18.0 GiB): the same bytes, a different unit.",
    ),
    Numeric(
        "q6",
        "An 80 GB GPU holds a 14 GB model. Each sequence needs 5 GB of KV cache. How many "
        "sequences fit at once?",
        answer=_max_batch, unit="seq", rtol=0.0, atol=0.01,
        explanation="(80 − 14) ÷ 5 = 13.2, and a sequence cannot be split: 13. Memory, not compute, "
                    "caps the batch, and the batch is what lifts decode off the memory wall (Lab 01).",
    ),
    Numeric(
        "q7",
        "SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64. How many KB of KV cache does one token "
        "add in fp32 (this lab's engine)?",
        answer=_smollm_per_token_kb, unit="KB", rtol=0.02,
        explanation="2 × 30 × 3 × 64 × 4 B = 46,080 B = 46.1 KB per token, so 2,048 tokens take "
                    "94 MB: small next to the 538 MB of fp32 weights, unlike a 70B model at long context.",
    ),
    Numeric(
        "q8",
        "**Measured.** The speedup run above kept its whole sequence (prompt + generated tokens, "
        "printed above) in one fp32 cache. How many MB does that cache hold? "
        "(Compute it with the formula; it is marked against the bytes of the real cache tensors.)",
        answer=lambda m: m["kv_bytes"] / 1e6, unit="MB", rtol=0.03,
        needs=("kv_bytes",), example_measured={"kv_bytes": 46080 * 263},
        explanation="2 · layers · kv_heads · head_dim · positions · 4 bytes = 46,080 B × positions. "
                    "minillm preallocates it for the whole request (prompt + max_new_tokens) at the start.",
    ),
    Numeric(
        "q9",
        "**Predict, then measure.** Section 5's first cell printed your measured costs: the cached "
        "decode step (ms) and the uncached step, a forward pass over the whole sequence so far, at "
        "its first and last position. An uncached step grows about linearly with the position, so "
        "T uncached steps cost about T × (first + last) ÷ 2, and T cached steps about T × the cached "
        "step. Predict the cache's speedup (uncached time ÷ cached time) at the longest length T "
        "(256; 32 in quick mode) before the next cell measures it. Marked against the measured "
        "speedup, within 20%.",
        answer=lambda m: m["speedup_max"], unit="x", rtol=0.2,
        needs=("speedup_max",), example_measured={"speedup_max": 5.1},
        explanation="speedup ≈ (first + last) ÷ 2 ÷ cached step, e.g. (60 ms + 500 ms) ÷ 2 ÷ 55 ms "
                    "= 5.1×. Without a cache, step t re-runs the model over all t tokens, so the "
                    "total work grows as T²; with it, each step processes one token, so the ratio "
                    "grows with T. On a GPU a small GPT gains ~40× at 256 tokens; on a CPU the gain "
                    "is smaller, because a decode step there is already slow (memory-bound "
                    "matrix-vector products) while the uncached prefill-like steps run near the "
                    "compute roof.",
    ),
    Choice(
        "q10",
        "Why does the cache keep K and V of past tokens, but not their Q?",
        options=[
            Option("A past query is never used again: only the newest token's query attends",
                   correct=True,
                   why="Causal attention: token t's output needs q_t and the K, V of tokens ≤ t. "
                       "Earlier outputs are final, so their queries are dead after their own step."),
            Option("Q is recomputed from K and V", why="Q, K and V are three separate projections of the "
                                                        "hidden state; none is derived from the others."),
            Option("Q is too large to store", why="Per token, q has num_heads × head_dim numbers, the same "
                                                  "order as K; size is not the reason."),
        ],
    ),
    Choice(
        "q11",
        "With a KV cache, how does the total work of generating T tokens grow?",
        options=[
            Option("Linear in T for the weights (one token per step), but attention over the cache "
                   "still adds up to O(T²), with a small constant", correct=True,
                   why="Step t reads t cached K/V vectors: Σt = T²/2 dot products per layer. That is "
                       "tiny next to 2·N FLOPs per token until the context is long (then Lab 03's "
                       "kernels and Lab 04's paging matter)."),
            Option("O(T) exactly: the cache removes every quadratic term",
                   why="The common simplification. The projections and MLP become O(T), but each new "
                       "query still attends over all t cached keys."),
            Option("Still O(T²) in every part, just faster",
                   why="Without a cache the projections and MLP run over all t tokens at every step: "
                       "O(T²·N). The cache removes exactly that."),
        ],
    ),
    Choice(
        "q12",
        "Greedy decoding with your cache must give the same tokens as without it. Why is that a "
        "good test, and when could it fail without a bug?",
        options=[
            Option("The two compute the same math in a different order; only a near-tie between "
                   "the top two logits could flip under float rounding", correct=True,
                   why="Any indexing bug (wrong slot, missing mask, wrong scale) changes logits by far "
                       "more than rounding, and greedy decoding amplifies it into different tokens."),
            Option("It always passes, so it tests nothing",
                   why="An off-by-one in the append or the attention changes the output within a few "
                       "tokens: try it."),
            Option("It fails whenever the prompt is longer than the cache",
                   why="generate() sizes the cache for prompt + max_new_tokens before it starts."),
        ],
    ),
]
