"""The serving benchmark's workload, shared by `benchmarks/` and the load generator.

Seeded (numpy default_rng(seed)): prompt lengths uniform in [16, 256], then output lengths
uniform in [16, 256], then the prompt tokens. Prompts are random token ids drawn uniformly
from the real vocabulary of SmolLM2 (ids 3 .. 49151, skipping the special tokens 0-2):
the model's speed does not depend on what the tokens mean, and every prompt is distinct,
so no prefix cache can flatter the numbers. Decoding is greedy and ignores EOS, so each
request generates exactly its output length.
"""
from __future__ import annotations

import numpy as np

VOCAB_SIZE, FIRST_ID = 49152, 3


def make_workload(num_requests: int = 64, prompt_range=(16, 256), output_range=(16, 256),
                  seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    requests = [{"prompt_ids": rng.integers(FIRST_ID, VOCAB_SIZE, int(p)).tolist(),
                 "max_tokens": int(o)} for p, o in zip(prompt_lens, output_lens)]
    return {
        "description": (f"{num_requests} requests, prompts uniform in {list(prompt_range)} "
                        f"random token ids from [{FIRST_ID}, {VOCAB_SIZE}), outputs uniform "
                        f"in {list(output_range)}, greedy, ignore EOS; numpy default_rng"
                        f"({seed})"),
        "seed": seed,
        "num_prompt_tokens": int(prompt_lens.sum()),
        "num_output_tokens": int(output_lens.sum()),
        "requests": requests,
    }
