"""Lab 03 quiz: attention variants (MHA / GQA / MQA) and FlashAttention.

Numbers come from ``minillm.calc`` at check time; none is a number the lab prints (the
textbook questions ask for new cases; q3 derives a rate from two measured steps). q3, q5 and
q11 read values the lab measured on the student's machine (``quizzes.record`` in the notebook's measurement cells). Two are
predictions (``predict=True``, asked in ``predict:<id>`` cells before their measurement):

- q5: naive attention's peak memory growth at T = 2,048, from the one measured at 1,024;
- q11: one layer's decode attention over 16,384 cached tokens, from the one timed at 8,192.
"""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 03: attention variants and FlashAttention"


def _window_saving_gb() -> float:
    """KV memory a window of 8,192 saves at 65,536 tokens (32 layers, 8 KV heads, D 128, fp16)."""
    from minillm import calc

    kept = calc.sliding_window_kv_tokens(65536, 8192)
    full, window = (calc.kv_cache_bytes(32, 8, 128, t, dtype_bytes=2) for t in (65536, kept))
    return (full - window) / 1e9


def _mqa_saving_gb() -> float:
    """KV memory MQA saves over GQA-8 for 16 Llama-2-70B sequences of 4,096 tokens, fp16."""
    from minillm import calc

    gqa, mqa = (calc.kv_cache_bytes(80, h, 128, 4096, 2, batch=16) for h in (8, 1))
    return (gqa - mqa) / 1e9


def _score_matrix_gb() -> float:
    from minillm import calc

    return calc.attention_matrix_bytes(32768, dtype_bytes=2, num_heads=32) / 1e9


def _decode_intensity() -> float:
    from minillm import calc

    return calc.attention_intensity(8192, 128, 64, 8, dtype_bytes=1)


def _kv_read_ms() -> float:
    from minillm import calc

    return calc.kv_cache_bytes(80, 8, 128, 32768, dtype_bytes=2) / 3.35e12 * 1e3


QUESTIONS = [
    Numeric(
        "q1",
        "A model with Mistral-7B's shape (32 layers, 8 KV heads, head_dim 128, fp16) uses a sliding "
        "window of W = 8,192 tokens. For one sequence of 65,536 tokens, how many GB of KV cache does "
        "the window save against full attention?",
        answer=_window_saving_gb, unit="GB", rtol=0.02,
        explanation="Full attention keeps 65,536 positions per layer: 2 · 32 · 8 · 128 · 65536 · 2 B = "
                    "8.59 GB. The window keeps min(T, W) = 8,192 (`calc.sliding_window_kv_tokens`): "
                    "1.07 GB. It saves 7.52 GB, and the saving keeps growing with T while the window's "
                    "cache stays flat.",
    ),
    Numeric(
        "q2",
        "Llama-2-70B (80 layers, head_dim 128, fp16) has 8 KV heads. Serving 16 sequences of 4,096 "
        "tokens, how many GB of KV cache would MQA (1 KV head) save against its GQA?",
        answer=_mqa_saving_gb, unit="GB", rtol=0.02,
        explanation="GQA: 16 × 1.34 GB = 21.5 GB. MQA keeps 1 head instead of 8: 16 × 0.168 = 2.7 GB. "
                    "The saving is 18.8 GB, a quarter of an 80 GB GPU, bought with a little quality: "
                    "why most models settle on GQA.",
    ),
    Numeric(
        "q3",
        "Under the widget, the lab printed the measured **MHA** and **MQA** decode steps: their times "
        "and the bytes each reads. Model a step as a fixed time plus its bytes streamed at some rate. "
        "At what rate, in GB/s, does the MHA step pay for the extra KV bytes that MQA does not read? "
        "Compute it from the two printed steps.",
        answer=lambda m: (m["mha_step_bytes"] - m["mqa_step_bytes"]) / (m["mha_step_ms"] - m["mqa_step_ms"]) / 1e6,
        unit="GB/s", rtol=0.1,
        needs=("mha_step_ms", "mqa_step_ms", "mha_step_bytes", "mqa_step_bytes"),
        example_measured={"mha_step_ms": 37.5, "mqa_step_ms": 15.0, "mha_step_bytes": 368e6,
                          "mqa_step_bytes": 90e6},
        explanation="Two points fix the line: extra bytes ÷ extra time, e.g. (368 − 90) MB ÷ (37.5 − 15.0) ms "
                    "= 12.4 GB/s. Compare it with the machine's bandwidth (printed by the widget): where "
                    "they are close, the KV cache streams at memory speed and fewer KV heads save time in "
                    "proportion. The rest of the step, MHA's time minus its bytes at that rate, is the "
                    "fixed part that no KV saving touches (on a GPU mostly launches, Lab 01).",
    ),
    Numeric(
        "q4",
        "Naive attention materializes the T×T score matrix of every head. How big is it for one "
        "layer with 32 heads of one sequence at T = 32,768 tokens in fp16? Answer in GB (10⁹ bytes).",
        answer=_score_matrix_gb, unit="GB", rtol=0.02,
        explanation="32,768² × 2 bytes × 32 heads = 68.7 GB (64 GiB), for one layer of one sequence: 16× "
                    "the 4.29 GB of T = 8,192, because T doubled twice. FlashAttention never stores it.",
    ),
    Numeric(
        "q5",
        "**Predict, then measure.** Section 2 measured how much naive attention's peak memory grew "
        "during one call at T = 1,024 on your device. It keeps a few [H, T, T] matrices alive at "
        "once. Predict the growth at T = 2,048, in MB, before the next cell measures it. Marked "
        "against that measurement, within 20%.",
        answer=lambda m: m["naive_peak_2048_MB"], unit="MB", rtol=0.2, predict=True,
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
        "Decode attention for one sequence: 64 query heads, 8 KV heads, head_dim 128, T = 8192 cached "
        "tokens, with the KV cache (and q and the output) in **8-bit** (1 byte per value). FLOPs per "
        "byte read (4 · H · T · D FLOPs; K, V, q and the output moved once)?",
        answer=_decode_intensity, unit="", rtol=0.03,
        explanation="About 2 · (H ÷ H_kv) ÷ bytes = 2 · 8 ÷ 1 = 16 FLOP/byte (`calc.attention_intensity`): "
                    "both the larger query groups and the smaller bytes raise it, and it is still far "
                    "below an H100's ridge of ~295. Batching does not help: each sequence reads its own cache.",
    ),
    Numeric(
        "q10",
        "At 3.35 TB/s (H100 SXM), how long does one decode step spend just reading the KV cache of one "
        "Llama-2-70B sequence (80 layers, 8 KV heads, head_dim 128) at 32,768 tokens in fp16? "
        "Answer in ms.",
        answer=_kv_read_ms, unit="ms", rtol=0.03,
        explanation="2 · 80 · 8 · 128 · 32768 · 2 B = 10.7 GB; 10.7e9 ÷ 3.35e12 = 3.2 ms per token per "
                    "sequence, against 42 ms for the 140 GB of weights shared by the batch. From batch 14 "
                    "on, the KV reads outweigh the weights.",
    ),
    Numeric(
        "q11",
        "**Predict, then measure.** Section 6 timed one layer's decode attention for 8 sequences "
        "over 8,192 cached tokens each. Predict its time over 16,384 cached tokens, in ms, before "
        "the next cell measures it: decode attention reads each sequence's whole cache once per "
        "token. Marked against the measurement, within 20%.",
        answer=lambda m: m["attn_decode_16k_ms"], unit="ms", rtol=0.2, predict=True,
        needs=("attn_decode_16k_ms",), example_measured={"attn_decode_16k_ms": 16.6},
        explanation="Twice the cache is twice the bytes, and decode attention is memory-bound (about "
                    "1.5 FLOP/byte for SmolLM2's 9/3 heads in fp32), so about twice the time: e.g. "
                    "8.3 ms → 16.6 ms. Where the measured ratio is below 2, a fixed cost per call "
                    "(launches, on a GPU) is showing; above 2, the larger cache fell out of a cache "
                    "level the smaller one still used.",
    ),
]
