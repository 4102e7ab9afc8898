"""Lab 08 quiz: model parallelism. Every number comes from ``minillm.calc`` (imported in the
answer functions) except q12, which reads the all-reduce bytes the lab's TP = 3 run recorded
in its ledger (``quizzes.record(tp_prefill_allreduce_bytes=...)`` in the notebook)."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 08: model parallelism"

# The layer of q3/q4: one all-reduce of a 4096-token batch's hidden state, 8192 wide, fp16,
# over 8 GPUs. Links per direction: NVLink 4 (H100) 450 GB/s, PCIe Gen5 x16 32 GB/s.
_TOKENS, _HIDDEN, _FP16, _GPUS = 4096, 8192, 2, 8
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


def _memory_70b_gb(tp: int):
    def answer() -> float:
        from minillm import calc

        return calc.memory_per_gpu(calc.weight_bytes(70e9, calc.DTYPE_BYTES["fp16"]), tp) / calc.GB

    return answer


def _smollm_kv_replicas() -> float:
    from minillm.config import ModelConfig

    cfg, tp_size = ModelConfig.smollm2_135m(), 9
    return tp_size // cfg.num_kv_heads


QUESTIONS = [
    Numeric("q1", "Under Megatron-style tensor parallelism, how many all-reduces does one transformer "
                  "block need in its forward pass?",
            answer=_calc("tp_allreduces_per_layer"), unit="", rtol=0, atol=0,
            explanation="Two: QKV is column-parallel and O row-parallel, then one all-reduce; gate|up "
                        "column-parallel and down row-parallel, then another."),
    Numeric("q2", "A 64 MB message is all-reduced over 8 GPUs with a ring. How many bytes does each GPU "
                  "send?",
            answer=_calc("ring_allreduce_bytes", 64e6, 8, scale=1e-6), unit="MB", rtol=0.02,
            explanation="2 · (N − 1) / N × message = 2 × 7/8 × 64 MB = 112 MB: a reduce-scatter and an "
                        "all-gather, each N − 1 steps of message/N."),
    Numeric("q3", "One all-reduce of an 8192-wide layer's output for 4096 tokens in fp16 (4096 × 8192 × "
                  "2 B = 67.1 MB) over 8 H100s on NVLink, 450 GB/s per direction, latency ignored. How "
                  "long does it take?",
            answer=_allreduce_ms(NVLINK_PER_DIRECTION), unit="ms", rtol=0.05,
            explanation="2 × 7/8 × 67.1 MB ÷ 450 GB/s = 0.26 ms (calc.allreduce_time_s)."),
    Numeric("q4", "The same all-reduce over PCIe Gen5 x16, 32 GB/s per direction?",
            answer=_allreduce_ms(PCIE5_PER_DIRECTION), unit="ms", rtol=0.05,
            explanation="2 × 7/8 × 67.1 MB ÷ 32 GB/s = 3.67 ms, 14× NVLink. At 160 all-reduces per "
                        "forward of an 80-layer model that is 0.59 s of communication per step: why TP "
                        "stays inside an NVLink domain."),
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
    Numeric("q6", "A pipeline of P = 4 stages runs M = 8 microbatches (GPipe). What fraction of the GPUs' "
                  "time is bubble?",
            answer=_calc("pp_bubble_fraction", 4, 8, scale=100), unit="%", rtol=0.02,
            explanation="(P − 1) / (M + P − 1) = 3/11 = 27%."),
    Numeric("q7", "The same 4-stage pipeline at batch 1, one microbatch?",
            answer=_calc("pp_bubble_fraction", 4, 1, scale=100), unit="%", rtol=0.02,
            explanation="(P − 1) / P = 75%: only one stage works at a time. Microbatches fill the bubble."),
    Numeric("q8", "A 70B-parameter model in fp16 is split with TP = 8. How much weight memory does each "
                  "GPU hold?",
            answer=_memory_70b_gb(8), unit="GB", rtol=0.02,
            explanation="70e9 × 2 B = 140 GB; ÷ 8 = 17.5 GB (TP = 1/2/4: 140/70/35 GB). KV cache and "
                        "activations come on top."),
    Choice("q9", "SmolLM2-135M has 9 query heads and 3 KV heads. Why does TP = 2 fail?",
           options=[
               Option("9 query heads cannot be split evenly into 2 ranks of whole heads", correct=True,
                      why="Each rank must hold whole heads; 9 ÷ 2 is not an integer. TP = 1, 3 or 9 works."),
               Option("135M parameters are too few to split",
                      why="Size has nothing to do with it: TP = 3 and 9 work."),
               Option("2 does not divide the hidden size 576", why="576 = 2 × 288: it divides."),
               Option("gloo cannot run two processes", why="Any world size runs; the heads decide."),
           ]),
    Numeric("q10", "At TP = 9 on SmolLM2 (9 query heads, 3 KV heads), how many ranks hold a copy of each "
                   "KV head?",
            answer=_smollm_kv_replicas, unit="", rtol=0, atol=0,
            explanation="tp > num_kv_heads, so each rank keeps one whole KV head, replicated tp / KV = "
                        "9 / 3 = 3 times: ranks 0–2 hold KV head 0, the group their query heads read."),
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
    Numeric("q12", "**Measured.** Before the TP = 3 run (section 6): predict the total bytes of the "
                   "all-reduces that rank 0's ledger records for the prefill of your prompt, from its "
                   "token count, SmolLM2's size and the dtype (float32). It is marked against the "
                   "ledger, within 20%.",
            answer=lambda m: m["tp_prefill_allreduce_bytes"] / 1e6, unit="MB", rtol=0.2,
            needs=("tp_prefill_allreduce_bytes",),
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
]
