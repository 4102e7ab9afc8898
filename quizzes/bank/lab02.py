"""Lab 02 quiz: the KV cache.

Numeric answers come from ``minillm.calc`` (imported inside the answer functions). None is a
number the lab prints: the sizing questions ask for new models, the inverse of a printed
case, or how many sequences fit.

Measured questions read what the lab recorded with ``quizzes.record``: ``kv_bytes`` (the
bytes of the real fp32 cache of the speedup run, from its tensors), and the two
predictions (``predict=True``, asked in ``predict:<id>`` cells before their measurement):

- q13: the wall time of a real uncached generation of 32 tokens (``uncached_32_s``),
  predicted from the timed uncached steps (the sum of an arithmetic series);
- q9: the cache's speedup at the longest length (``speedup_max``), predicted from the cached
  step and the first and last uncached steps.
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 02 quiz: the KV cache"


def _calc():
    from minillm import calc

    return calc


def _kv_gb(layers, kv_heads, head_dim, seq_len, dtype_bytes=2, batch=1):
    return _calc().kv_cache_bytes(layers, kv_heads, head_dim, seq_len, dtype_bytes, batch) / 1e9


def _smollm_per_token_kb() -> float:
    return _calc().kv_cache_bytes_per_token(30, 3, 64, 4) / 1e3


def _tokens_in_10gb() -> float:
    return 10e9 / _calc().kv_cache_bytes_per_token(80, 8, 128, 2)


def _gpt3_sequences() -> float:
    calc = _calc()
    return calc.max_concurrent_sequences(640e9, 350e9, calc.kv_cache_bytes(96, 96, 128, 4096, 2))


def _llama3_8b_sequences() -> float:
    calc = _calc()
    return calc.max_concurrent_sequences(80e9, 16e9, calc.kv_cache_bytes(32, 8, 128, 8192, 2))


QUESTIONS = [
    Numeric(
        "q1",
        "A model with Llama-2-70B's shape (80 layers, 8 KV heads, head_dim 128) serves a batch of 3 "
        "sequences of 8,192 tokens each in fp16. How many GB of KV cache is that?",
        answer=lambda: _kv_gb(80, 8, 128, 8192, 2, 3), unit="GB", rtol=0.02,
        explanation="2 (K and V) × 80 × 8 × 128 × 8192 × 2 B × 3 sequences = 8.05 GB: 327,680 bytes per "
                    "token per sequence, and every sequence keeps its own.",
    ),
    Numeric(
        "q2",
        "Llama-2-70B (80 layers, 8 KV heads, head_dim 128, fp16) has 10 GB of GPU memory left for "
        "KV cache. How many tokens of context fit, summed over all sequences?",
        answer=_tokens_in_10gb, unit="tok", rtol=0.02,
        explanation="One token costs 2 × 80 × 8 × 128 × 2 B = 327,680 B, so 10 × 10⁹ ÷ 327,680 = 30,518 "
                    "tokens: seven 4,096-token conversations, or one of 30K. With MHA (64 KV heads) it "
                    "would be 8 times fewer.",
    ),
    Numeric(
        "q3",
        "A model has 40 query heads, and its KV cache is 5 times smaller than it would be with MHA. "
        "How many KV heads does it have?",
        answer=lambda: 8, unit="", rtol=0.01,
        explanation="The cache is num_heads ÷ num_kv_heads times smaller: 40 ÷ 5 = 8 KV heads, each "
                    "shared by a group of 5 query heads. The query heads (and the attention FLOPs) do "
                    "not change; only the bytes do.",
    ),
    Numeric(
        "q4",
        "Llama-3-8B (32 layers, 8 KV heads, head_dim 128) with its KV cache stored in 8 bits "
        "(1 byte per value): how many GB for one sequence of 32,768 tokens?",
        answer=lambda: _kv_gb(32, 8, 128, 32768, 1), unit="GB", rtol=0.02,
        explanation="2 × 32 × 8 × 128 × 32768 × 1 B = 2.15 GB: 4 × the tokens of the fp16 figure at "
                    "8,192 (1.07 GB) at half the bytes per value, so twice the memory.",
    ),
    Numeric(
        "q5",
        "GPT-3 175B (MHA: 96 layers, 96 KV heads, head_dim 128) runs in fp16 on 8 GPUs of 80 GB "
        "(640 GB in all); its weights take 350 GB. How many sequences of 4,096 tokens fit?",
        answer=_gpt3_sequences, unit="seq", rtol=0.0, atol=0.01,
        explanation="Each sequence needs 2 × 96 × 96 × 128 × 4096 × 2 B = 19.3 GB (18.0 GiB); "
                    "(640 − 350) ÷ 19.33 = 15.0, and a sequence cannot be split: 15. MHA is why: with "
                    "8 KV heads (GQA) each would need 1.6 GB and 180 would fit.",
    ),
    Numeric(
        "q6",
        "Llama-3-8B in fp16 (16 GB of weights; 1.07 GB of KV cache per 8,192-token sequence) on an "
        "80 GB GPU: how many 8,192-token sequences fit at once?",
        answer=_llama3_8b_sequences, unit="seq", rtol=0.0, atol=0.01,
        explanation="(80 − 16) ÷ 1.074 = 59.6, rounded down: 59. Memory, not compute, caps the batch, "
                    "and the batch is what lifts decode off the memory wall (Lab 01).",
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
        "**Predict, then measure.** Section 5 printed your measured costs: the cached decode step "
        "and the uncached step (a forward pass over the whole sequence so far) at its first and "
        "last position. Take the uncached step to grow linearly in between, so T uncached steps cost "
        "about T × (first + last) ÷ 2, and T cached steps about T × the cached step. Predict the "
        "cache's speedup (uncached time ÷ cached time) at the longest length T (256; 32 in quick "
        "mode) before the next cell measures it. Marked against the measured speedup, within 20%.",
        answer=lambda m: m["speedup_max"], unit="x", rtol=0.2, predict=True,
        needs=("speedup_max",), example_measured={"speedup_max": 12.3},
        explanation="speedup ≈ (first + last) ÷ 2 ÷ cached step, e.g. (43 ms + 651 ms) ÷ 2 ÷ 28.8 ms "
                    "= 12.0×, measured 12.3× on a 2-core CPU. Without a cache, step t re-runs the "
                    "model over all t tokens, so the total work grows as T²; with it, each step "
                    "processes one token, so the ratio grows with T. On a GPU a small GPT gains ~40× "
                    "at 256 tokens; on a CPU the gain is smaller, because a decode step there is "
                    "already slow (memory-bound matrix-vector products) while the uncached "
                    "prefill-like steps run near the compute roof.",
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
    Numeric(
        "q13",
        "**Predict, then measure.** From the uncached step costs section 5 timed (a forward pass "
        "over n tokens, at n = P and n = P + 31), predict the wall time of a real uncached "
        "generation of 32 tokens, in seconds, before the next cell runs one. Its step i is a "
        "forward pass over P + i tokens; take the cost to grow linearly between the two. Marked "
        "against the real run, within 20%.",
        answer=lambda m: m["uncached_32_s"], unit="s", rtol=0.2, predict=True,
        needs=("uncached_32_s",), example_measured={"uncached_32_s": 2.9},
        explanation="The sum of an arithmetic series: 32 × (first + last) ÷ 2, e.g. 32 × (43 + 136) ms "
                    "÷ 2 = 2.9 s. The real run adds a little per step (sampling, Python, the growing "
                    "token tensor), so it usually comes out a few percent longer than the sum. That is "
                    "why section 5 may sum timed steps instead of running every uncached generation.",
    ),
    Choice(
        "q14",
        "At the shortest lengths (8 or 16 tokens) the cache gains little: an uncached step costs not "
        "much more than a cached one, and on a busy machine the cached run can even come out "
        "slower. Why?",
        options=[
            Option("A forward pass over a handful of tokens reads every weight once, exactly like a "
                   "cached step: both are bound by the weight bytes, not by the tokens", correct=True,
                   why="Until the tokens' FLOPs outgrow the time it takes to stream the weights, "
                       "recomputing them is nearly free. The cache pays once the uncached step's cost "
                       "is proportional to n, and the lab's cached run also calls your Python "
                       "functions, 60 extra calls per step."),
            Option("The cache is not used for the first tokens",
                   why="The cache is filled by the prefill and used from the first decode step on."),
            Option("Writing the cache costs more than recomputing K and V",
                   why="Writing one token's K and V is a copy of a few KB per layer; the weights are "
                       "hundreds of MB."),
            Option("The uncached run skips the attention",
                   why="It runs full causal attention over all n tokens at every step."),
        ],
    ),
]
