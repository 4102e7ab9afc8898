"""Lab 03 quiz: attention variants (MHA / GQA / MQA) and FlashAttention.

Numbers come from ``minillm.calc`` at check time; q3 and q5 read values the lab measured
on the student's machine (``quizzes.record`` in the notebook's measurement cells). q5 is the
predict-then-measure question: naive attention's peak memory at T = 2,048, predicted from
the one measured at T = 1,024.
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 03: attention variants and FlashAttention"


def _gqa(num_heads: int, num_kv_heads: int):
    def answer() -> float:
        from minillm import calc

        return calc.gqa_reduction(num_heads, num_kv_heads)

    return answer


def _sliding_window_gb() -> float:
    from minillm import calc

    kept = calc.sliding_window_kv_tokens(32768, 4096)
    return calc.kv_cache_bytes(32, 8, 128, kept, dtype_bytes=2) / 1e9


def _score_matrix_gb() -> float:
    from minillm import calc

    return calc.attention_matrix_bytes(131072, dtype_bytes=2) / 1e9


def _decode_intensity() -> float:
    from minillm import calc

    return calc.attention_intensity(8192, 128, 32, 8, dtype_bytes=2)


def _kv_read_ms() -> float:
    from minillm import calc

    return calc.kv_cache_bytes(32, 8, 128, 8192, dtype_bytes=2) / 3.35e12 * 1e3


QUESTIONS = [
    Numeric(
        "q1",
        "Mistral-7B uses sliding-window attention with a window of W = 4,096 tokens (32 layers, 8 KV "
        "heads, head_dim 128, fp16). How many GB of KV cache does one sequence of 32,768 tokens "
        "need when the cache keeps only the window?",
        answer=_sliding_window_gb, unit="GB", rtol=0.02,
        explanation="Each layer keeps min(T, W) = 4,096 positions (`calc.sliding_window_kv_tokens`): "
                    "2 · 32 · 8 · 128 · 4096 · 2 B = 0.54 GB, against 4.29 GB for full attention at "
                    "32K: 8× less, and it stops growing with T.",
    ),
    Numeric(
        "q2",
        "Llama-2-70B has 64 query heads and 8 KV heads. How many times smaller is its KV cache than "
        "the MHA version's?",
        answer=_gqa(64, 8), unit="x", rtol=0.01,
        explanation="64 ÷ 8 = 8: at 4096 tokens in fp16 that is 1.34 GB per sequence instead of 10.7 GB.",
    ),
    Numeric(
        "q3",
        "Under the widget, the lab printed the time and the bytes read of the measured **MHA** step, "
        "and the bytes read of the **MQA** step. If a decode step's time were proportional to the "
        "bytes it reads, how long would the MQA step take?",
        answer=lambda m: m["mha_step_ms"] * m["mqa_step_bytes"] / m["mha_step_bytes"],
        unit="ms", rtol=0.05,
        needs=("mha_step_ms", "mha_step_bytes", "mqa_step_bytes"),
        example_measured={"mha_step_ms": 140.0, "mha_step_bytes": 368e6, "mqa_step_bytes": 90e6},
        explanation="time_MQA ≈ time_MHA × bytes_MQA ÷ bytes_MHA. The measured MQA step is slower than "
                    "this: part of each step does not shrink with the bytes (fixed costs: on a GPU "
                    "the launch of every kernel, Lab 01's launch wall; and an attention kernel "
                    "that runs below the memory bandwidth).",
    ),
    Numeric(
        "q4",
        "Naive attention materializes the T×T score matrix. How big is it for **one** head of one "
        "sequence at T = 128K = 131,072 tokens in fp16? Answer in GB (10⁹ bytes).",
        answer=_score_matrix_gb, unit="GB", rtol=0.02,
        explanation="131,072² × 2 bytes = 34.4 GB, which is exactly 32 GiB (2³⁵ bytes): the \"32 GB\" "
                    "often quoted is in GiB. Per head and per layer; an 80 GB GPU could not hold three of them.",
    ),
    Numeric(
        "q5",
        "**Predict, then measure.** Section 2 measured how much naive attention's peak memory grew "
        "during one call at T = 1,024 on your device. It keeps a few [H, T, T] matrices alive at "
        "once. Predict the growth at T = 2,048, in MB, before the next cell measures it. Marked "
        "against that measurement, within 20%.",
        answer=lambda m: m["naive_peak_2048_MB"], unit="MB", rtol=0.2,
        needs=("naive_peak_2048_MB",), example_measured={"naive_peak_2048_MB": 464.0},
        explanation="T² memory: doubling T multiplies it by 4, e.g. 119 MB → 476 MB predicted, 464 "
                    "measured (the small fixed part does not grow). Tiled attention's peak only "
                    "grows like T (its output), plus fixed tiles.",
    ),
    Choice(
        "q6",
        "Naive attention and FlashAttention do the same matrix products. Why is FlashAttention "
        "faster on a GPU?",
        options=[
            Option("Naive attention writes the T×T scores to HBM and reads them back (softmax, then P·V). "
                   "FlashAttention keeps each score tile in on-chip SRAM: only Q, K, V and the output "
                   "cross HBM.", correct=True,
                   why="The softmax does a few FLOPs per byte, so with its T×T intermediate in HBM "
                       "attention is memory-bound. Keeping it on chip removes that traffic."),
            Option("It does fewer FLOPs by skipping small attention weights.",
                   why="It computes every score: the result is exact. (Its backward pass even does "
                       "more FLOPs: it recomputes the scores instead of storing them.)"),
            Option("It approximates softmax(QKᵀ) with a low-rank product.",
                   why="That is Linformer/Performer-style approximate attention; FlashAttention is exact."),
            Option("It runs the softmax on the CPU, in parallel with the GPU's matmuls.",
                   why="Everything runs in one GPU kernel; the point is where the intermediate lives."),
        ],
        explanation="Per head, naive attention moves the T² scores several times: Θ(T·d + T²) bytes. "
                    "FlashAttention moves Θ(T²·d² ÷ M) for an SRAM of M bytes: Q and the output once, "
                    "K and V once per query tile. This is often simplified to O(T·d), which forgets the "
                    "re-reads of K and V; what is O(T) is its extra memory (the T×T matrix never exists).",
    ),
    Choice(
        "q7",
        "Is FlashAttention's output the same as softmax(Q·Kᵀ/√d)·V?",
        options=[
            Option("Yes: the same sums in another order (online softmax with rescaling); it differs "
                   "only by floating-point rounding.", correct=True,
                   why="The running max m and sum l are rescaled by exp(m_old − m_new) whenever the "
                       "max grows, so acc / l is the exact softmax-weighted sum."),
            Option("No: it drops attention weights below a threshold to save memory.",
                   why="That is sparse attention; FlashAttention keeps every weight."),
            Option("Only when T is a multiple of the tile size.",
                   why="The last, shorter tile is masked; the check in this lab uses T that is not a "
                       "multiple of the tile."),
            Option("Only without the causal mask.",
                   why="The mask is applied per tile (and fully hidden tiles are skipped); the result "
                       "is still exact."),
        ],
    ),
    Choice(
        "q8",
        "What does FlashAttention-3 add over FlashAttention-2?",
        options=[
            Option("Hopper (H100) features: TMA asynchronous copies and warp specialization that overlap "
                   "data movement and softmax with the tensor-core matmuls, plus FP8.", correct=True,
                   why="v3 targets the H100's asynchrony (TMA, WGMMA) and its FP8 tensor cores."),
            Option("Parallelizing over the sequence length, not only over batch and heads.",
                   why="That was FlashAttention-2 (along with fewer non-matmul FLOPs and a better "
                       "work split between warps)."),
            Option("The online softmax that avoids materializing the T×T matrix.",
                   why="That is the original FlashAttention (v1)."),
            Option("An approximation that makes attention linear in T.",
                   why="All versions are exact; FLOPs stay O(T²·d)."),
        ],
    ),
    Numeric(
        "q9",
        "Decode attention for one sequence: 32 query heads, 8 KV heads, head_dim 128, T = 8192 cached "
        "tokens, fp16. FLOPs per byte read (4 · H · T · D FLOPs; K, V, q and the output moved once)?",
        answer=_decode_intensity, unit="", rtol=0.03,
        explanation="About 2 · (H ÷ H_kv) ÷ bytes = 4 FLOP/byte (`calc.attention_intensity`), against an "
                    "H100 ridge of ~295: memory-bound. Batching does not help: each sequence reads its own cache.",
    ),
    Numeric(
        "q10",
        "At 3.35 TB/s (H100 SXM), how long does one decode step spend just reading the KV cache of one "
        "Llama-3-8B sequence (32 layers, 8 KV heads, head_dim 128) at 8192 tokens in fp16? Answer in ms.",
        answer=_kv_read_ms, unit="ms", rtol=0.03,
        explanation="2 · 32 · 8 · 128 · 8192 · 2 B = 1.07 GB; 1.07e9 ÷ 3.35e12 = 0.32 ms per token per "
                    "sequence, on top of the 16 GB of weights (4.8 ms) shared by the batch. At batch 16 the KV "
                    "reads (17 GB) outweigh the weights.",
    ),
]
