"""`run_tp`: SmolLM2 at a tensor-parallel size, through `launch`, measured.

Each rank loads the model once, keeps its shards (`shard_model`), and for each prompt runs
greedy generation with a fresh `CommLedger`. Rank 0 returns one `TPRun` per prompt, with
every rank's ledger and parameter bytes, so a notebook or a test sees the whole group.
The head rule is checked before any process starts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..config import ModelConfig
from .comm import CommLedger, use_ledger
from .generate import StepTrace, tp_generate_stream
from .launch import launch, rank_device
from .sharding import check_tp_size, param_bytes, shard_model


@dataclass
class TPRun:
    """One prompt at one TP size. `prefill_logits` is rank 0's [T, V] float32 logits of
    EVERY prompt position (row -1 picks the first token). Times are wall seconds on rank 0:
    `step_times_s` is [prefill, decode 1, decode 2, ...]; `comm_time_s` is the time rank 0
    spent inside collectives (waiting for the other ranks included)."""
    tp_size: int
    prompt_ids: list[int]
    tokens: list[int]
    prefill_logits: torch.Tensor
    ledger: CommLedger                 # rank 0's
    rank_ledgers: list[CommLedger]     # one per rank
    param_bytes_per_rank: list[int]
    step_times_s: list[float]
    comm_time_s: float

    @property
    def prefill_records(self):
        return self.ledger.select(phase="prefill")

    @property
    def decode_records(self):
        return self.ledger.select(phase="decode")


def _tp_worker(rank: int, world_size: int, prompts, max_new_tokens: int, dtype):
    from ..model import load_model
    model, _ = load_model(dtype=dtype, device=rank_device(rank))
    shard_model(model, rank, world_size)
    sizes = [None] * world_size
    tdist.all_gather_object(sizes, param_bytes(model))
    runs = []
    for prompt in prompts:
        ledger, trace = CommLedger(), StepTrace()
        with use_ledger(ledger):
            tokens = list(tp_generate_stream(model, prompt, max_new_tokens, trace=trace))
        ledgers = [None] * world_size
        tdist.all_gather_object(ledgers, ledger)
        logits = None if trace.prefill_logits is None else trace.prefill_logits.cpu()
        runs.append(TPRun(world_size, list(prompt), tokens, logits, ledger,
                          ledgers, sizes, trace.step_times_s, ledger.time_s()))
    return runs


def run_tp_many(tp_size: int, prompts, max_new_tokens: int, *, dtype=torch.float32,
                timeout_s: float = 600.0) -> list[TPRun]:
    """`run_tp` for several prompts in one launch (the model loads once per rank)."""
    check_tp_size(ModelConfig.smollm2_135m(), tp_size)
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("prompts is empty")
    return launch(_tp_worker, tp_size, prompts, max_new_tokens, dtype, timeout_s=timeout_s)


def run_tp(tp_size: int, prompt_ids, max_new_tokens: int, *, dtype=torch.float32,
           timeout_s: float = 600.0) -> TPRun:
    """Greedy generation of SmolLM2 on `tp_size` ranks; see `TPRun` for what comes back."""
    return run_tp_many(tp_size, [prompt_ids], max_new_tokens, dtype=dtype,
                       timeout_s=timeout_s)[0]
