"""Lab 09 quiz: serving. Every number comes from ``minillm.calc`` (imported in the answer
functions) except the two predictions, each asked in a ``predict:`` cell before the
measurement it is marked against: q12 (one request's unloaded latency, from the median TTFT
and ITL of section 1; ``quizzes.record(unloaded_latency_ms=...)``) and q3 (the completed rate
of the load sweep at 1.5 μ, from the service rate;
``quizzes.record(overload_completed_rate=...)``). No answer is printed by the lab: the numbers
asked for differ from the ones its cells compute."""

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

    q_and_v = [SMOLLM2_QKVO[0], SMOLLM2_QKVO[2]]
    return calc.lora_adapter_bytes(30, 64, q_and_v, 4) / (134_515_008 * 4) * 100


def _llama3_kv_ms() -> float:
    from minillm import calc

    per_token = calc.kv_cache_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    return calc.kv_transfer_time_s(8192, per_token, 25e9) * 1e3


def _scale_rule_replicas() -> float:
    from minillm.serve.autoscale import ScaleRule

    return ScaleRule(target_per_replica=8, min_replicas=1, max_replicas=10).recommend(3, 52)


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
    Numeric("q3", "**Predict, then measure.** The load sweep of section 5 ends at an arrival rate of 1.5 μ, "
                  "sent for 8 seconds. From the service rate μ you measured (section 4), predict how many "
                  "requests per second the server completes at that rate (from the first request sent to "
                  "the last answer). It is marked against the completed rate the sweep measures; within "
                  "20% counts as right.",
            answer=lambda m: m["overload_completed_rate"], unit="req/s", rtol=0.2,
            needs=("overload_completed_rate",), example_measured={"overload_completed_rate": 4.0},
            predict=True,
            explanation="About μ: past ρ = 1 every slot is always busy, so the server completes requests at its "
                        "capacity and no faster; the other 0.5 μ per second join the queue, whose wait is "
                        "the vertical part of the latency curve. Predicting 1.5 μ forgets that capacity is "
                        "fixed; predicting 1 / (one request's latency) forgets the batch, and is "
                        "max_num_seqs-fold too low. A little under μ is measured: the first batch ramps up."),
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
                      why="Once the batch has work the engine loop keeps the CPU busy, whether the queue is "
                          "empty or exploding, and a GPU server's CPU says little of its GPU."),
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
                  "GPU. Llama-3-8B has 32 layers and 8 KV heads of 128, in fp16. How many milliseconds "
                  "does an 8,192-token prompt's KV take over a 25 GB/s link?",
            answer=_llama3_kv_ms, unit="ms", rtol=0.03,
            explanation="Per token: 2 (K and V) × 32 × 8 × 128 × 2 B = 131,072 B; × 8,192 tokens = 1.07 GB; "
                        "÷ 25 GB/s = 43 ms. That is added to TTFT; in exchange, decode steps never stall "
                        "behind a long prefill."),
    Numeric("q10", "A LoRA adapter of rank 64 on SmolLM2's q and v projections only (30 layers, fp32; q is "
                   "576 → 576, v is 576 → 192): what percentage of the 134.5M-parameter base model's bytes "
                   "is it?",
            answer=_lora_fraction, unit="%", rtol=0.03,
            explanation="Each adapted matrix adds r·(d_in + d_out): 64 × ((576 + 576) + (576 + 192)) = "
                        "122,880 parameters per layer, 3.7M in all: 14.7 MB, 2.7% of 538 MB."),
    Numeric("q11", "A paged KV cache holds 24 live sequences of 70 tokens each, in blocks of 16 tokens. What "
                   "fraction of the allocated slots is empty (the fragmentation a server should export and "
                   "alert on)?",
            answer=_calc("kv_fragmentation", 24 * 70, 24 * 5, 16), unit="", rtol=0.02,
            explanation="Each sequence holds ⌈70 / 16⌉ = 5 blocks = 80 slots for 70 tokens: 1 − 1680 / 1920 "
                        "= 0.125. Paging bounds the waste to each sequence's last block; a value that stays "
                        "high says the blocks are too big for the traffic, one that grows says blocks leak."),
    Numeric("q12", "**Predict, then measure.** Section 1 streamed three answers and printed their median "
                   "TTFT and median gap between tokens (ITL). The cell after this question times one request "
                   "alone: a 32-token prompt and exactly 16 output tokens, streamed. Predict its latency in "
                   "ms from those medians with E2E = TTFT + (n − 1) · ITL, before the cell runs it. Within "
                   "20% counts as right.",
            answer=lambda m: m["unloaded_latency_ms"], unit="ms", rtol=0.2,
            needs=("unloaded_latency_ms",), example_measured={"unloaded_latency_ms": 450.0},
            predict=True,
            explanation="TTFT + 15 × ITL: the prefill of a short prompt costs about what the first token of "
                        "section 1's answers did (their prompts were of a similar length), and each later "
                        "token one decode step. The medians matter: one request is one sample, and the "
                        "first after start-up or a neighbour's burst can move it by a third."),
    Choice("q13", "The server sends 5 tokens per SSE event instead of 1 (after the first token, which goes "
                  "alone). What changes?",
           options=[
               Option("The event loop's work per token (JSON encoding, HTTP writes) falls several-fold; the "
                      "engine's steps, the tokens per second and the TTFT stay the same", correct=True,
                      why="The per-event cost is paid once per 5 tokens; the per-token work (detokenizing) "
                          "is not. The engine still makes one token per step, and the text arrives in "
                          "bigger, rarer pieces."),
               Option("The TTFT falls about 5-fold", why="The first token is still one step of prefill away; "
                                                        "buffering after it cannot make it earlier."),
               Option("The model generates 5 tokens per step", why="Buffering happens after generation, in "
                                                                  "the HTTP layer."),
               Option("The text changes: tokens are merged", why="The joined text is the same whatever the "
                                                                "buffering (the server's tests check it)."),
           ]),
    Choice("q14", "A Kubernetes liveness probe pointed at the deep GET /health (a one-token generation that "
                  "waits its turn in the queue). What happens under a heavy load?",
           options=[
               Option("The probe queues behind the load, times out, and Kubernetes restarts a busy but "
                      "healthy replica, sending its load to the others", correct=True,
                      why="Liveness must answer from the engine loop's state (is it running, has one step "
                          "stalled?), not wait in line: /health/live. Readiness, /health/ready, says when to "
                          "send traffic."),
               Option("Nothing: a deep check is always better",
                      why="Deep checks suit a load balancer's occasional probe or a human, not a restart "
                          "trigger."),
               Option("The replica stops getting traffic until the load falls",
                      why="That is what a failing readiness probe does; a failing liveness probe restarts."),
               Option("The queue shrinks, because probes take priority",
                      why="The health generation is scheduled like any request."),
           ]),
    Numeric("q15", "The scale rule of section 8 targets 8 requests in flight (waiting + running) per replica. "
                   "A fleet of 3 replicas holds 52 requests in all. How many replicas does it ask for?",
            answer=_scale_rule_replicas, unit="", rtol=0, atol=0,
            explanation="⌈52 / 8⌉ = 7: the HPA formula, replicas × (metric per replica ÷ target) = 3 × "
                        "(17.3 ÷ 8), rounded up. It scales up at once; it scales down only once a lower "
                        "reading has held for the stabilization window."),
]
