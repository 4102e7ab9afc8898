"""Lab 04 quiz: PagedAttention. q2, q3, q8 and q9 read what the lab measured with the real
BlockManager on benchmarks/workload.json (``quizzes.record`` in the notebook). q9 is the
predict-then-measure question: the paged waste predicted from the mean tokens held."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 04: PagedAttention"

# Llama-3-8B in fp16 on an 80 GB H100: 16 GB of weights, 131,072 B of KV per token.
_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def _contiguous_8b() -> float:
    from minillm import calc

    return calc.max_concurrent_sequences(80e9, calc.weight_bytes(8e9, 2), 8192 * _KV_PER_TOKEN)


def _paged_8b() -> float:
    from minillm import calc

    # paged: each sequence holds ceil(2000 / 16) blocks of 16 tokens
    return calc.max_concurrent_sequences(80e9, calc.weight_bytes(8e9, 2), -(-2000 // 16) * 16 * _KV_PER_TOKEN)


QUESTIONS = [
    Numeric("q1", "With blocks of 16 tokens, how many blocks does a sequence of 1,000 tokens hold?",
            answer=-(-1000 // 16), unit="", rtol=0,
            explanation="ceil(1000 ÷ 16) = 63 blocks = 1,008 slots: 8 slots (0.8%) of internal "
                        "fragmentation, in the last block only."),
    Numeric("q2", "On the lab's workload (64 requests of benchmarks/workload.json), what fraction of the "
                  "reserved KV slots did **contiguous** reservation of 512 tokens per request leave empty, "
                  "as measured?",
            answer=lambda m: m["contiguous_waste_pct"], unit="%", rtol=0.02, needs=("contiguous_waste_pct",),
            example_measured={"contiguous_waste_pct": 56.4},
            explanation="Each request reserves its worst case up front; on average it holds far less (its "
                        "prompt plus what it has generated so far). Reserving the model's context "
                        "instead of the workload's maximum wastes even more (the lab's 1024 run)."),
    Numeric("q3", "And the measured waste of the **paged** pool (allocated slots holding no token)?",
            answer=lambda m: m["paged_waste_pct"], unit="%", rtol=0.05, needs=("paged_waste_pct",),
            example_measured={"paged_waste_pct": 3.3},
            explanation="Only the unfilled tail of each sequence's last block: under 16 slots per "
                        "sequence, about 7.5 on average, against ~220 tokens held."),
    Numeric("q4", "Llama-3-8B in fp16 on an 80 GB GPU: 16 GB of weights, 131,072 bytes of KV per token. "
                  "How many sequences fit if each reserves its full 8,192-token context contiguously?",
            answer=_contiguous_8b, unit="seq", rtol=0,
            explanation="A sequence reserves 8192 × 131,072 B = 1.07 GB; floor(64 GB ÷ 1.07 GB) = 59 "
                        "(`calc.max_concurrent_sequences`)."),
    Numeric("q5", "Same GPU, paged, when sequences actually hold 2,000 tokens each (125 blocks of 16)?",
            answer=_paged_8b, unit="seq", rtol=0,
            explanation="125 × 16 × 131,072 B = 262 MB per sequence: 244 sequences, 4.1× the contiguous "
                        "count. More sequences in a batch is more tokens per weight read: throughput."),
    Choice("q6", "Why does the prefix cache hash a block as hash(parent_hash, tokens) and not hash(tokens)?",
           options=[
               Option("A block's K and V depend on every token before it; the chain makes the key name "
                      "the whole prefix, so equal tokens after a different prefix do not match.", correct=True,
                      why="Attention mixes in all earlier positions, so the same 16 tokens have different "
                          "KV after different prefixes."),
               Option("It makes the hash faster to compute.", why="It hashes more, not less."),
               Option("To evict blocks in LRU order.", why="Eviction order is the free queue's, not the hash's."),
           ]),
    Choice("q7", "Two samples of one prompt share its blocks after a fork. When is a block copied?",
           options=[
               Option("When a sample first writes into a shared, partly filled block (copy-on-write).",
                      correct=True, why="Full shared blocks are only read; the partial last block is "
                                        "written by the next token, so that writer gets a private copy."),
               Option("At the fork, every block.", why="That is what paging avoids: the prompt's KV is stored once."),
               Option("Never: both samples write into the same block.",
                      why="They would overwrite each other's next tokens."),
           ]),
    Numeric("q8", "In the lab's 256-block run, how many times more sequences did the paged pool run on "
                  "average than contiguous reservation (512 tokens) could hold, as measured?",
            answer=lambda m: m["paged_concurrency_ratio"], unit="x", rtol=0.03,
            needs=("paged_concurrency_ratio",), example_measured={"paged_concurrency_ratio": 1.76},
            explanation="Paged sequences hold only what they use, so more of them fit (the ratio you "
                        "measured); with longer reservations (the model's context) the gain grows."),
    Numeric("q9", "**Predict, then measure.** Section 4 printed how many tokens a running sequence held "
                  "on average in the paged run (N). With blocks of 16, the last block of a sequence is "
                  "on average half empty: (16 − 1) ÷ 2 = 7.5 empty slots. Predict the paged pool's waste "
                  "(empty slots ÷ allocated slots, in %) before the next cell measures it over every "
                  "step. Marked against the measurement, within 20%.",
            answer=lambda m: m["paged_waste_pct"], unit="%", rtol=0.2, needs=("paged_waste_pct",),
            example_measured={"paged_waste_pct": 3.26},
            explanation="waste ≈ 7.5 ÷ (N + 7.5): with N ≈ 223 tokens, 7.5 ÷ 230.4 = 3.26%. The tail "
                        "n mod 16 of a sequence is spread evenly, so its empty slots average "
                        "(0 + 15 + 14 + … + 1) ÷ 16 = 7.5. Halving the block size halves it, at the "
                        "cost of longer block tables."),
    Numeric("q10", "An alert fires when the paged pool's fragmentation (empty ÷ allocated slots) stays above "
                   "a threshold. With blocks of 16 and sequences of 100 tokens each, what fragmentation "
                   "do you expect, in %? (A value far above it means requests hold far fewer tokens "
                   "than their blocks, e.g. a block size too large for short requests.)",
            answer=lambda: 100 * (1 - 100 / (-(-100 // 16) * 16)), unit="%", rtol=0.02,
            explanation="ceil(100 ÷ 16) = 7 blocks = 112 slots for 100 tokens: 12 ÷ 112 = 10.7%."),
]
