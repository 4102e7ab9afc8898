"""Generation on a tensor-parallel model: every rank runs every step; rank 0 decides.

    prefill   all ranks run the prompt on their shards; the logits are gathered to rank 0
    sample    rank 0 picks the next token and broadcasts it (8 bytes)
    decode    all ranks feed that token at the next position, with their own KV cache
              (their KV heads only), until a stop token or max_new_tokens

Every rank yields the same tokens, so every rank's loop stops at the same step and the
collectives stay matched. With greedy decoding the tokens equal `minillm.generate` on one
process, up to logits that differ in the last bits (all-reduce sums in another order).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..attention import ContiguousCacheContext
from ..kv_cache import KVCache
from ..prompts import check_generation, stop_token_set
from ..sampling import make_generator, sample_next, validate_sampling
from . import comm


@dataclass
class StepTrace:
    """What `tp_generate_stream` measured. `prefill_logits`: rank 0's logits of every
    prompt position, [T, V] (None on other ranks); `step_times_s`: the prefill, then each
    decode step, wall time on this rank (sampling and the broadcast included)."""
    prefill_logits: torch.Tensor | None = None
    step_times_s: list[float] = field(default_factory=list)


@torch.inference_mode()
def tp_generate_stream(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None,
                       seed: int | None = None, trace: StepTrace | None = None,
                       ignore_eos: bool = False) -> Iterator[int]:
    """Yield new token ids on every rank of a model sharded by `shard_model`.

    With `trace`, the prefill computes (and gathers) the logits of every prompt position,
    not only the last, and records step times; each step runs inside
    `ledger.step("prefill" | "decode")` of the active ledger, if any.
    """
    prompt = check_generation(model, prompt_ids, max_new_tokens)
    validate_sampling(temperature, top_k, top_p)
    if max_new_tokens == 0:
        return
    stops = stop_token_set(None, model.config.eos_token_id, ignore_eos)
    generator = make_generator(seed)
    device = model.device
    cache = KVCache(model.config, 1, len(prompt) + max_new_tokens, model.dtype, device)
    ctx = ContiguousCacheContext(model.attn_backend, cache, 0)
    ids = torch.tensor([prompt], device=device)
    positions = torch.arange(len(prompt), device=device)[None]
    for step in range(max_new_tokens):
        start = time.perf_counter()
        with _ledger_step("prefill" if step == 0 else "decode"):
            logits = model(ids, positions, ctx, last_only=trace is None or step > 0)
            if step == 0 and trace is not None and logits is not None:
                trace.prefill_logits = logits[0].float().clone()
            next_id = _agree(logits, temperature, top_k, top_p, generator, device)
        if trace is not None:
            trace.step_times_s.append(time.perf_counter() - start)
        yield next_id
        if next_id in stops:
            return
        ctx.start_pos = int(positions[0, -1]) + 1
        ids = ids.new_tensor([[next_id]])
        positions = positions.new_tensor([[ctx.start_pos]])


def _agree(logits, temperature, top_k, top_p, generator, device) -> int:
    """Rank 0 samples from its gathered logits; every rank gets the token by broadcast."""
    token = torch.zeros(1, dtype=torch.long, device=device)
    if logits is not None:
        token[0] = sample_next(logits[0, -1], temperature, top_k, top_p, generator)
    if comm.world_size() > 1:
        comm.broadcast(token, src=0)
    return int(token[0])


def _ledger_step(phase: str):
    ledger = comm.active_ledger()
    return ledger.step(phase) if ledger is not None else contextlib.nullcontext()
