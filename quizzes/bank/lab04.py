"""Lab 04 quiz: PagedAttention. Two questions are predictions, each asked in a ``predict:``
cell before the cell that measures it on the real BlockManager (``quizzes.record``): q9 the
paged pool's waste and q11 the waste of contiguous reservation at 1024 slots, both from the
tokens a running request holds on average (N, printed before them). q2, q3 and q8 apply N
to new cases; the calc questions ask for cases the lab does not print."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 04: PagedAttention"

# Llama-3-8B in fp16 on an 80 GB H100: 16 GB of weights, 131,072 B of KV per token.
_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def _contiguous_8b() -> float:
    from minillm import calc

    return calc.max_concurrent_sequences(80e9, calc.weight_bytes(8e9, 2), 4096 * _KV_PER_TOKEN)


def _paged_8b() -> float:
    from minillm import calc

    # paged: each sequence holds ceil(500 / 16) blocks of 16 tokens
    return calc.max_concurrent_sequences(80e9, calc.weight_bytes(8e9, 2), -(-500 // 16) * 16 * _KV_PER_TOKEN)


_N = {"mean_tokens_held": 222.9}  # the lab's run, for the bank's tests


QUESTIONS = [
    Numeric("q1", "With blocks of 16 tokens, a sequence holds a prompt of 1,000 tokens and then generates "
                  "9 more. How many blocks does it hold now?",
            answer=-(-1009 // 16), unit="", rtol=0,
            explanation="ceil(1009 ÷ 16) = 64 blocks: the 1,000-token prompt filled 62 blocks and 8 slots "
                        "of a 63rd; the 9th new token starts a 64th. Only the last block is ever partly empty."),
    Numeric("q2", "In the lab's workload a running request held N tokens on average (section 4). "
                  "Reserving R slots per request contiguously wastes 1 − N ÷ R. What reservation R "
                  "would bring that waste down to 25%, in tokens?",
            answer=lambda m: m["mean_tokens_held"] / 0.75, unit="", rtol=0.05,
            needs=("mean_tokens_held",), example_measured=_N,
            explanation="R = N ÷ 0.75 ≈ 297 slots. But a contiguous region cannot grow: every request "
                        "whose prompt plus output may exceed R (up to 512 here) could not run at all. "
                        "Contiguous allocation must reserve the worst case; paging does not."),
    Numeric("q3", "Same workload, same N, but blocks of **32** tokens: what fraction of the paged pool's "
                  "allocated slots would you expect to be empty, in %?",
            answer=lambda m: 100 * 15.5 / (m["mean_tokens_held"] + 15.5), unit="%", rtol=0.1,
            needs=("mean_tokens_held",), example_measured=_N,
            explanation="The last block is on average (32 − 1) ÷ 2 = 15.5 slots short: 15.5 ÷ (N + 15.5) "
                        "≈ 6.5%, twice the waste of blocks of 16, for block tables half as long."),
    Numeric("q4", "Llama-3-8B in fp16 on an 80 GB GPU: 16 GB of weights, 131,072 bytes of KV per token. "
                  "How many sequences fit if each reserves a **4,096**-token context contiguously?",
            answer=_contiguous_8b, unit="seq", rtol=0,
            explanation="A sequence reserves 4096 × 131,072 B = 537 MB; floor(64 GB ÷ 537 MB) = 119 "
                        "(`calc.max_concurrent_sequences`), twice the 59 of an 8,192-token reservation."),
    Numeric("q5", "Same GPU, paged, when sequences actually hold **500** tokens each (blocks of 16)?",
            answer=_paged_8b, unit="seq", rtol=0,
            explanation="ceil(500 ÷ 16) = 32 blocks = 512 slots × 131,072 B = 67 MB per sequence: 953 "
                        "sequences. More sequences in a batch is more tokens per weight read: throughput."),
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
    Numeric("q8", "The lab's pool has 256 blocks of 16 (4,096 slots). If every running request held N "
                  "tokens (section 4) plus its half-empty last block, how many could run at once?",
            answer=lambda m: 4096 / (m["mean_tokens_held"] + 7.5), unit="seq", rtol=0.05,
            needs=("mean_tokens_held",), example_measured=_N,
            explanation="4096 ÷ (N + 7.5) ≈ 17.8 sequences, against 8 reserving 512 each. The measured "
                        "average is lower (section 4 prints it): when the queue runs dry at the end of "
                        "the workload the last requests run with the pool half empty, and a preempted "
                        "request gives its blocks back."),
    Numeric("q9", "**Predict, then measure.** Section 4 printed how many tokens a running sequence held "
                  "on average in the paged run (N). With blocks of 16, how many slots of a sequence's "
                  "last block are empty on average? From that, predict the paged pool's waste (empty "
                  "slots ÷ allocated slots, in %) before the next cell measures it over every step. "
                  "Marked against the measurement, within 20%.",
            answer=lambda m: m["paged_waste_pct"], unit="%", rtol=0.2, needs=("paged_waste_pct",),
            predict=True, example_measured={"paged_waste_pct": 3.26},
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
    Numeric("q11", "**Predict, then measure.** A server that reserves its model's context, 1,024 slots "
                   "per request, instead of the workload's 512. Its requests hold the same N tokens on "
                   "average while they run (section 4). Predict the fraction of its reserved slots that "
                   "stay empty, in %, before the next cell measures it. Marked against the measurement, "
                   "within 5%.",
            answer=lambda m: m["contiguous1024_waste_pct"], unit="%", rtol=0.05,
            needs=("contiguous1024_waste_pct",), predict=True,
            example_measured={"contiguous1024_waste_pct": 78.2},
            explanation="1 − N ÷ 1024 = 1 − 223 ÷ 1024 = 78%: inside the 60–80% that vLLM measured on "
                        "real servers. The reservation, not the workload, sets the waste."),
]
