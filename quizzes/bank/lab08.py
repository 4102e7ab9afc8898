"""Lab 08 quiz: model parallelism. Every number comes from ``minillm.calc`` (imported in the
answer functions) except the lab's two predictions, asked in the lab (``quizzes.predict``)
before the TP = 3 run that measures them and marked within 20%: q12, the all-reduce bytes of
the prefill that rank 0's ledger records (``quizzes.record(tp_prefill_allreduce_bytes=...)``),
and q17, the parameter bytes rank 0 holds (``tp_rank0_param_bytes``). The calc questions apply
the lab's formulas to cases it does not print (a 5120-wide layer over 4 GPUs, 3 and 8 pipeline
stages, 405B in fp8, Llama-3-8B's heads, Mixtral-8x22B), so no answer is copied from an
output above the quiz."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 08: model parallelism"

# The layer of q3/q4: one all-reduce of a 2048-token batch's hidden state, 5120 wide, fp16,
# over 4 GPUs. Links per direction: NVLink 4 (H100) 450 GB/s, PCIe Gen5 x16 32 GB/s.
_TOKENS, _HIDDEN, _FP16, _GPUS = 2048, 5120, 2, 4
NVLINK_PER_DIRECTION, PCIE5_PER_DIRECTION = 450e9, 32e9


def _allreduce_ms(link_bytes_per_s: float):
    def answer() -> float:
        from minillm import calc

        return calc.allreduce_time_s(_TOKENS * _HIDDEN * _FP16, _GPUS, link_bytes_per_s) * 1e3

    return answer


def _calc(name, *args, scale=1.0):
    def answer() -> float:
        from minillm import calc

        return getattr(calc, name)(*args) * scale

    return answer


def _memory_405b_fp8_gb(tp: int):
    def answer() -> float:
        from minillm import calc

        return calc.memory_per_gpu(calc.weight_bytes(405e9, calc.DTYPE_BYTES["fp8"]), tp) / calc.GB

    return answer


def _mixtral_8x22b():
    from minillm import calc

    # Mixtral-8x22B's config.json: 56 layers, hidden 6144, expert FFN 16384, 8 experts, top-2,
    # 48 query / 8 KV heads of 128, vocabulary 32768 (141B parameters, 39B active).
    return calc.MoEConfig("Mixtral-8x22B", 56, 6144, 16384, 8, 2, 48, 8, 128, 32768)


def _x22_expert_gb() -> float:
    from minillm import calc

    return calc.ep_expert_bytes_per_gpu(_mixtral_8x22b(), 8, calc.DTYPE_BYTES["fp16"]) / calc.GB


def _x22_all_to_all_kb() -> float:
    from minillm import calc

    m = _mixtral_8x22b()
    return calc.ep_all_to_all_bytes_per_token(m.hidden_size, m.top_k, 4, calc.DTYPE_BYTES["bf16"]) / 1e3


QUESTIONS = [
    Numeric("q1", "Llama-3-8B has 32 layers. Under Megatron-style tensor parallelism with a "
                  "vocab-parallel embedding, how many all-reduces does one forward pass make?",
            answer=_calc("tp_allreduce_count", 32), unit="", rtol=0, atol=0,
            explanation="Two per block: QKV column-parallel and O row-parallel, then one all-reduce; "
                        "gate|up column-parallel and down row-parallel, then another. Plus one for the "
                        "embedding: 2 × 32 + 1 = 65."),
    Numeric("q2", "A 64 MB message is all-reduced over 8 GPUs with a ring. How many bytes does each GPU "
                  "send?",
            answer=_calc("ring_allreduce_bytes", 64e6, 8, scale=1e-6), unit="MB", rtol=0.02,
            explanation="2 · (N − 1) / N × message = 2 × 7/8 × 64 MB = 112 MB: a reduce-scatter and an "
                        "all-gather, each N − 1 steps of message/N."),
    Numeric("q3", "One all-reduce of a 5120-wide layer's output for 2048 tokens in fp16 over 4 H100s on "
                  "NVLink, 450 GB/s per direction, latency ignored. How long does it take?",
            answer=_allreduce_ms(NVLINK_PER_DIRECTION), unit="ms", rtol=0.05,
            explanation="The message is 2048 × 5120 × 2 B = 21.0 MB; a ring sends 2 × 3/4 of it per GPU, "
                        "31.5 MB, and 31.5 MB ÷ 450 GB/s = 0.070 ms (calc.allreduce_time_s)."),
    Numeric("q4", "The same all-reduce over PCIe Gen5 x16, 32 GB/s per direction?",
            answer=_allreduce_ms(PCIE5_PER_DIRECTION), unit="ms", rtol=0.05,
            explanation="31.5 MB ÷ 32 GB/s = 0.98 ms, 14× NVLink. At 2 all-reduces per layer of a "
                        "60-layer model that is 0.12 s of communication per step: why TP stays inside "
                        "an NVLink domain."),
    Choice("q5", "NVIDIA quotes the H100's NVLink at 900 GB/s. Which figure goes into the ring all-reduce "
                 "time, bytes sent per GPU ÷ bandwidth?",
           options=[
               Option("450 GB/s: the 900 is both directions added; a GPU sends at 450 while it receives "
                      "at 450", correct=True,
                      why="In a ring every GPU sends and receives at once, each direction at 450 GB/s."),
               Option("900 GB/s, the quoted figure",
                      why="That adds the two directions; the time would come out half what it is."),
               Option("900 ÷ 8 GB/s, shared by the 8 GPUs",
                      why="Each GPU has its own links to the NVSwitch; they are not shared."),
               Option("64 GB/s, as PCIe", why="PCIe Gen5 x16 is 64 bidirectional, 32 per direction; "
                                                "NVLink is a separate, faster link."),
           ]),
    Numeric("q6", "A pipeline of P = 3 stages runs M = 6 microbatches (GPipe). What fraction of the GPUs' "
                  "time is bubble?",
            answer=_calc("pp_bubble_fraction", 3, 6, scale=100), unit="%", rtol=0.02,
            explanation="(P − 1) / (M + P − 1) = 2/8 = 25%."),
    Numeric("q7", "A pipeline of P = 8 stages at batch 1, one microbatch?",
            answer=_calc("pp_bubble_fraction", 8, 1, scale=100), unit="%", rtol=0.02,
            explanation="(P − 1) / P = 7/8 = 87.5%: only one stage works at a time. Microbatches fill "
                        "the bubble."),
    Numeric("q8", "A 405B-parameter model in fp8 (1 byte per weight) is split with TP = 8. How much "
                  "weight memory does each GPU hold?",
            answer=_memory_405b_fp8_gb(8), unit="GB", rtol=0.02,
            explanation="405e9 × 1 B = 405 GB; ÷ 8 = 50.6 GB, which leaves about 29 GB of an 80 GB "
                        "H100 for the KV cache and activations."),
    Choice("q9", "SmolLM2-135M has 9 query heads and 3 KV heads. Why does TP = 2 fail?",
           options=[
               Option("9 query heads cannot be split evenly into 2 ranks of whole heads", correct=True,
                      why="Each rank must hold whole heads; 9 ÷ 2 is not an integer. TP = 1, 3 or 9 works."),
               Option("135M parameters are too few to split",
                      why="Size has nothing to do with it: TP = 3 and 9 work."),
               Option("2 does not divide the hidden size 576", why="576 = 2 × 288: it divides."),
               Option("gloo cannot run two processes", why="Any world size runs; the heads decide."),
           ]),
    Numeric("q10", "Llama-3-8B has 32 query heads and 8 KV heads. At TP = 32, how many ranks hold a copy "
                   "of each KV head?",
            answer=_calc("tp_kv_replicas", 32, 8, 32), unit="", rtol=0, atol=0,
            explanation="tp > num_kv_heads, so each rank keeps one whole KV head, replicated tp / KV = "
                        "32 / 8 = 4 times: ranks 0–3 hold KV head 0, the group their query heads read."),
    Choice("q11", "Expert parallelism (EP) puts a mixture-of-experts model's experts on different GPUs. "
                  "Which collective moves the tokens?",
           options=[
               Option("all-to-all: each GPU sends every token to the GPUs of the experts the router "
                      "picked, and gets the results back", correct=True,
                      why="Each token goes only where its top-k experts live: a different amount between "
                          "every pair of GPUs."),
               Option("all-reduce, as in tensor parallelism",
                      why="An all-reduce sums the same tensor everywhere; EP routes different tokens to "
                          "different GPUs."),
               Option("point-to-point send/recv between consecutive GPUs, as in pipeline parallelism",
                      why="A token's experts can be on any GPU, not just the next one."),
               Option("broadcast of all experts' weights", why="That would undo the split of the weights."),
           ]),
    Numeric("q12", "**Predict, then measure.** Before the TP = 3 run (section 6): predict the total bytes "
                   "of the all-reduces that rank 0's ledger records for the prefill of your prompt, from "
                   "its token count, SmolLM2's size and the dtype (float32). It is marked against the "
                   "ledger, within 20%.",
            answer=lambda m: m["tp_prefill_allreduce_bytes"] / 1e6, unit="MB", rtol=0.2,
            predict=True, needs=("tp_prefill_allreduce_bytes",),
            example_measured={"tp_prefill_allreduce_bytes": 4.05e6},
            explanation="Two all-reduces per layer, each tokens × 576 × 4 B, over 30 layers, plus one "
                        "for the vocab-parallel embedding: (2 × 30 + 1) × tokens × 576 × 4 B "
                        "(calc.tp_allreduce_bytes)."),
    Choice("q13", "Why is the MLP's gate|up column-parallel and down row-parallel, not the other way round?",
           options=[
               Option("Column-parallel gate|up leaves each rank whole FFN columns, SiLU(gate)·up is "
                      "elementwise on them, and row-parallel down turns them into partial sums: one "
                      "all-reduce for the whole MLP", correct=True,
                      why="The column shards feed the row shards directly; only the end needs a sum."),
               Option("Row-parallel layers are faster", why="Both do 1/tp of the FLOPs."),
               Option("It halves the memory", why="Either way each rank holds 1/tp of each matrix."),
               Option("Row-first would need no communication at all",
                      why="Row-first gives partial sums, and SiLU of a partial sum is not a partial "
                          "sum of SiLUs: it would need an all-reduce before the activation too."),
           ]),
    Choice("q14", "A 405B model needs 16 GPUs: two nodes of 8, NVLink inside a node, a network between "
                  "them several times slower. How do you split it?",
           options=[
               Option("TP = 8 inside each node, PP = 2 across the nodes", correct=True,
                      why="TP's two all-reduces per layer need NVLink; PP sends one activation per "
                          "stage boundary, which a slower link can carry."),
               Option("TP = 16 across both nodes",
                      why="Every layer's all-reduces would cross the slow network: 2 per layer."),
               Option("PP = 16, one stage per GPU",
                      why="It works, but the bubble at 16 stages needs very many microbatches, and each "
                          "request's latency passes through 16 stages."),
               Option("Data parallelism: a copy on each GPU",
                      why="405B in fp16 is 810 GB: no copy fits one GPU."),
           ]),
    Numeric("q15", "Mixtral-8x22B: 56 MoE layers of 8 experts, each expert a SwiGLU MLP of hidden 6144 "
                   "and FFN 16384 (gate, up, down). Under expert parallelism over 8 GPUs in fp16, how "
                   "many bytes of EXPERT weights does each GPU hold?",
            answer=_x22_expert_gb, unit="GB", rtol=0.02,
            explanation="One expert is 3 × 6144 × 16384 = 302M weights; each GPU holds 8 / 8 = 1 "
                        "expert of each of the 56 layers: 56 × 302M × 2 B = 33.8 GB "
                        "(calc.ep_expert_bytes_per_gpu). The shared weights (attention, embeddings) "
                        "come on top of it on every GPU."),
    Numeric("q16", "Mixtral-8x22B routes each token to its top-2 experts. Under expert parallelism over 4 "
                   "GPUs in bf16, how many bytes does one token send across GPUs in one MoE layer "
                   "(dispatch and combine), with uniform routing?",
            answer=_x22_all_to_all_kb, unit="KB", rtol=0.02,
            explanation="2 (there and back) × 2 experts × 3/4 (the chance an expert is on another of "
                        "the 4 GPUs) × 6144 × 2 B = 36.9 KB (calc.ep_all_to_all_bytes_per_token). The "
                        "expert FFN size does not enter: only hidden vectors travel."),
    Numeric("q17", "**Predict, then measure.** Before the TP = 3 run (section 6): predict how many bytes "
                   "of parameters rank 0 holds (float32), from what one process holds and what TP "
                   "splits. It is marked against the bytes the rank counts in its own process, within "
                   "20%.",
            answer=lambda m: m["tp_rank0_param_bytes"] / 1e6, unit="MB", rtol=0.2,
            predict=True, needs=("tp_rank0_param_bytes",),
            example_measured={"tp_rank0_param_bytes": 179.4e6},
            explanation="Every matrix and the vocab-parallel embedding are split three ways; only the "
                        "RMSNorm weights (a few hundred KB) are copied to every rank. So about a third "
                        "of 538 MB: 179 MB (calc.tp_param_bytes_per_rank)."),
]
