"""Lab 09 quiz: serving. Every number comes from ``minillm.calc`` (imported in the answer
functions) except q3, which reads the knee the lab's load sweep measured
(``quizzes.record(knee_rate=...)`` in the notebook)."""

from quizzes.questions import Choice, Numeric, Option

TITLE = "Lab 09: serving"

# SmolLM2's attention projections (d_in, d_out): q and o are 576 × 576, k and v 576 → 192.
SMOLLM2_QKVO = [(576, 576), (576, 192), (576, 192), (576, 576)]


def _calc(name, *args, **kwargs):
    def answer() -> float:
        from minillm import calc

        return getattr(calc, name)(*args, **kwargs)

    return answer


def _lora_fraction() -> float:
    from minillm import calc

    return calc.lora_adapter_bytes(30, 16, SMOLLM2_QKVO, 4) / (134_515_008 * 4) * 100


QUESTIONS = [
    Numeric("q1", "A chat service peaks at 50 requests/s. A request spends 4 s in the server on average "
                  "(waiting, prefill and streaming its answer). One replica runs at most 32 requests at "
                  "once. How many replicas does Little's law ask for?",
            answer=_calc("replicas_needed", 50, 4, 32), unit="", rtol=0, atol=0,
            explanation="L = λ·W = 50 × 4 = 200 requests in the system on average; 200 / 32 = 6.25, so 7 "
                        "replicas (calc.replicas_needed). To keep each at 80% of its slots, off the knee: "
                        "200 / (32 × 0.8) = 7.8, so 8."),
    Numeric("q2", "A replica's measured capacity is μ = 10 req/s and its unloaded latency 0.5 s. By the "
                  "M/M/1-style curve base / (1 − ρ), what latency does it show at 9 req/s?",
            answer=_calc("queueing_latency_s", 0.5, 9, 10), unit="s", rtol=0.02,
            explanation="ρ = 9 / 10 = 0.9, so 0.5 / (1 − 0.9) = 5 s: ten times the unloaded latency. At "
                        "ρ = 0.5 it would be 1 s. The last 10% of capacity costs the most latency."),
    Numeric("q3", "**Measured.** From the service rate μ you measured (section 4), predict the arrival rate "
                  "at which this server's p99 latency blows up: the knee of the curve. It is marked against "
                  "the knee the load sweep then measures (where p99 passes 1.5 × the full-batch time "
                  "max_num_seqs / μ); within 20% counts as right.",
            answer=lambda m: m["knee_rate"], unit="req/s", rtol=0.2, needs=("knee_rate",),
            example_measured={"knee_rate": 4.0},
            explanation="The queue grows without bound once λ > μ (ρ > 1): the knee sits at about μ. A batching "
                        "server stays nearly flat until close to it (its slots absorb the bursts), then "
                        "climbs steeply. 1 / (one request's latency) is the mistake: it ignores the batch, "
                        "and predicts a knee max_num_seqs times too early."),
    Numeric("q4", "p99 of an M/M/1 queue with λ = 8 req/s and μ = 10 req/s, in seconds?",
            answer=_calc("mm1_latency_percentile", 8, 10, 99), unit="s", rtol=0.02,
            explanation="The time in system is exponential with rate μ − λ = 2/s, so p99 = ln(100) / 2 = "
                        "2.3 s: 4.6 times the mean of 0.5 s. Tails are where queues hurt."),
    Choice("q5", "A user watches a streamed answer appear. Which latency do they perceive as 'the "
                 "server is slow'?",
           options=[
               Option("The time to the first token (TTFT): after that, text arrives faster than they read",
                      correct=True,
                      why="Streaming hides the rest: at 20 ms per token the text outruns reading speed. "
                          "A non-streamed answer would make them wait for the whole E2E."),
               Option("The end-to-end latency of the whole answer",
                      why="Only without streaming; with it, the answer is being read while it is written."),
               Option("The inter-token latency", why="It matters only once it is slower than reading."),
               Option("The server's CPU time per request", why="Users see wall time, not CPU time."),
           ]),
    Choice("q6", "Which signal should drive autoscaling of an LLM server?",
           options=[
               Option("The queue depth (requests waiting), or the TTFT it causes", correct=True,
                      why="Waiting requests are exactly the demand the replicas cannot absorb; by Little's "
                          "law they turn straight into latency."),
               Option("CPU utilization",
                      why="The engine loop keeps a core busy at any load, and a GPU server's CPU says nothing "
                          "of its GPU: CPU% is high when idle-polling and flat when the queue explodes."),
               Option("GPU memory used",
                      why="The KV pool is allocated up front: memory reads ~90% at any load."),
               Option("Requests per second", why="Useful, but only against capacity, which changes with "
                                                 "prompt and output lengths; the queue measures both."),
           ]),
    Choice("q7", "What should GET /health do on an inference server?",
           options=[
               Option("Run a tiny generation (one token) through the engine, with a timeout", correct=True,
                      why="A deep check: it fails when the engine loop is stuck or the model is broken, "
                          "which is what a load balancer needs to know."),
               Option("Return 200 as soon as the HTTP server runs",
                      why="A shallow check stays green while the engine loop is dead."),
               Option("Report GPU utilization", why="Busy is not healthy; a stuck kernel reads 100%."),
               Option("Restart the engine", why="A probe must not change the server's state."),
           ]),
    Choice("q8", "The server gets SIGTERM during a deployment. In what order should it shut down?",
           options=[
               Option("Stop admitting (new requests get 503), let in-flight requests finish within a grace "
                      "period, abort what is left, exit", correct=True,
                      why="No accepted request is cut short unless it outlives the grace period, and the "
                          "load balancer sees the 503s and retries elsewhere."),
               Option("Abort everything at once and exit", why="Every in-flight stream breaks mid-answer."),
               Option("Finish every queued and running request, however long it takes",
                      why="A deployment could then wait forever; the grace period bounds it."),
               Option("Keep admitting until the queue is empty, then exit",
                      why="Under steady load the queue is never empty."),
           ]),
    Numeric("q9", "Prefill/decode disaggregation ships each prompt's KV cache from a prefill GPU to a decode "
                  "GPU. Llama-2-70B holds 327,680 bytes of KV per token (fp16). How many milliseconds does "
                  "a 4,096-token prompt's KV take over a 50 GB/s link?",
            answer=lambda: _calc("kv_transfer_time_s", 4096, 327_680, 50e9)() * 1e3, unit="ms", rtol=0.03,
            explanation="4,096 × 327,680 B = 1.34 GB; / 50 GB/s = 27 ms, a few % of the prefill itself "
                        "(~1 s on one GPU). In exchange, decode steps never stall behind a long prefill."),
    Numeric("q10", "One LoRA adapter of rank 16 on SmolLM2's q, k, v and o projections (30 layers, fp32): what "
                   "percentage of the 134.5M-parameter base model's bytes is it?",
            answer=_lora_fraction, unit="%", rtol=0.03,
            explanation="Each adapted matrix adds r·(d_in + d_out): 16 × (1152 + 768 + 768 + 1152) = 61,440 "
                        "parameters per layer, 1.84M in all: 7.4 MB, 1.4% of 538 MB. A hundred adapters "
                        "cost about 1.4 base models, against a hundred full copies."),
    Numeric("q11", "A paged KV cache holds 1,000 tokens of 40 live sequences in 80 blocks of 16. What "
                   "fraction of the allocated slots is empty (the fragmentation a server should export and "
                   "alert on)?",
            answer=_calc("kv_fragmentation", 1000, 80, 16), unit="", rtol=0.02,
            explanation="1 − 1000 / (80 × 16) = 0.22. Paging bounds the waste to each sequence's last block, "
                        "at most 40 × 15 = 600 slots here; a value that stays high says the blocks are too "
                        "big for the traffic, one that grows says blocks leak."),
]
