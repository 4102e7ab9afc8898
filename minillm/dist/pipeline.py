"""Pipeline parallelism in its simplest form: layer groups on P ranks, a GPipe schedule.

    rank 0      embedding + layers [0, L/P)          ─ send activations ─▶
    rank s      layers [s·L/P, (s+1)·L/P)            ─ send activations ─▶
    rank P−1    its layers + final norm + LM head    ─▶ logits

The batch is cut into M microbatches. GPipe (forward only, as in inference): every stage
runs microbatch 0, 1, ..., M−1 in order; a stage starts microbatch m as soon as it has
received it (blocking `recv`) and hands the result to the next stage with a non-blocking
`send`, so stage s works on m while stage s+1 works on m−1. At the start later stages wait
and at the end earlier ones have nothing left: the bubble. With equal stage times t and no
transfer cost the makespan is (M + P − 1)·t, of which each rank computes M·t, so the idle
fraction is (P − 1)/(M + P − 1) (`calc.pp_bubble_fraction`).

Measured here: every rank timestamps its `fwd`, `send` and `recv` calls with
`time.perf_counter` (one system-wide monotonic clock, so ranks on one machine compare);
gaps are `idle`. The measured bubble is 1 − Σ fwd / (P · makespan).

Invariant: the logits equal one process running the whole batch (up to matmul rounding:
a microbatch has fewer rows).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as tdist

from .. import calc
from ..attention import NoCacheContext
from .comm import CommLedger, recv, send, use_ledger
from .launch import launch, rank_device
from .layers import shard_ranges


class PipelineEvent(NamedTuple):
    rank: int
    kind: str            # "fwd", "send", "recv", "idle"
    microbatch: int      # -1 for idle gaps
    start_s: float       # seconds since the common start (after a barrier)
    end_s: float


@dataclass
class PPRun:
    pp_size: int
    num_microbatches: int
    logits: torch.Tensor             # [B, T, V] float32, from the last stage
    events: list[PipelineEvent]      # every rank's, sorted by start
    stage_layers: list[tuple[int, int]]
    makespan_s: float
    measured_bubble_fraction: float
    predicted_bubble_fraction: float
    ledgers: list[CommLedger]        # one per rank: the sends and recvs


def stage_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """[first, end) layer of each stage (the first stages get one more when uneven)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size must lie in [1, {num_layers}] (one layer per stage at "
                         f"least), got {pp_size}")
    return shard_ranges(num_layers, pp_size)


def keep_stage(model, stage: int, pp_size: int):
    """Drop the layers (and the embedding or head) this stage does not run; returns model."""
    first, end = stage_layers(model.config.num_layers, pp_size)[stage]
    for i in range(model.config.num_layers):
        if not first <= i < end:
            model.layers[i] = torch.nn.Identity()  # frees the layer's weights
    model.stage_range = (first, end)
    return model


def stage_forward(model, stage: int, pp_size: int, x: torch.Tensor, positions: torch.Tensor):
    """Run one stage on one microbatch: ids [b, T] in on stage 0, hidden [b, T, d] in
    elsewhere; hidden out, or logits [b, T, V] on the last stage."""
    first, end = model.stage_range
    ctx = NoCacheContext(model.attn_backend)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    if stage == 0:
        x = model.embed_tokens(x)
    for i in range(first, end):
        x = model.layers[i](x, cos, sin, ctx, i)
    return model.compute_logits(model.norm(x)) if stage == pp_size - 1 else x


@torch.inference_mode()
def gpipe_forward(model, stage: int, pp_size: int, microbatches: list[torch.Tensor]):
    """One GPipe forward on this rank. Returns (logits of each microbatch on the last stage
    else None, this rank's events with absolute perf_counter times)."""
    events, pending, outputs = [], [], []
    d = model.config.hidden_size
    for m, ids in enumerate(microbatches):
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
        x = ids
        if stage > 0:
            t = time.perf_counter()
            x = recv(torch.empty(*ids.shape, d, dtype=model.dtype, device=ids.device), stage - 1)
            events.append((stage, "recv", m, t, time.perf_counter()))
        t = time.perf_counter()
        y = stage_forward(model, stage, pp_size, x, positions)
        if y.is_cuda:  # the stage's end is when its kernels ran, not when they were queued
            torch.cuda.current_stream(y.device).synchronize()
        events.append((stage, "fwd", m, t, time.perf_counter()))
        if stage < pp_size - 1:
            t = time.perf_counter()
            pending.append(send(y, stage + 1))
            events.append((stage, "send", m, t, time.perf_counter()))
        else:
            outputs.append(y.float())
    for request in pending:
        request.wait()
    return (outputs if stage == pp_size - 1 else None), events


def _with_idle(events: list[tuple], pp_size: int, start: float, end: float):
    """Relative times, plus an "idle" event for every gap in a rank's timeline."""
    out = []
    for rank in range(pp_size):
        busy = sorted((e for e in events if e[0] == rank and e[1] != "recv"),
                      key=lambda e: e[3])
        cursor = start
        for e in busy:
            if e[3] > cursor:
                out.append(PipelineEvent(rank, "idle", -1, cursor - start, e[3] - start))
            cursor = max(cursor, e[4])
        if end > cursor:
            out.append(PipelineEvent(rank, "idle", -1, cursor - start, end - start))
    out += [PipelineEvent(r, k, m, s - start, e - start) for r, k, m, s, e in events]
    return sorted(out, key=lambda e: (e.start_s, e.rank))


def _makespan(events) -> float:
    """From the first event to the end of the last forward, over all ranks."""
    return max(e[4] for e in events if e[1] == "fwd") - min(e[3] for e in events)


def _pp_worker(rank: int, pp_size: int, batch: torch.Tensor, num_microbatches: int, dtype,
               repeats: int):
    from ..model import load_model
    model, _ = load_model(dtype=dtype, device=rank_device(rank))
    keep_stage(model, rank, pp_size)
    microbatches = [mb.to(model.device) for mb in batch.chunk(num_microbatches)]
    stage_forward(model, rank, pp_size,  # warm-up (kernel build, allocator) outside timing
                  microbatches[0] if rank == 0 else
                  torch.zeros(*microbatches[0].shape, model.config.hidden_size,
                              dtype=model.dtype, device=model.device),
                  torch.arange(batch.shape[1]).expand(microbatches[0].shape))
    timelines = []
    for _ in range(repeats):
        ledger = CommLedger()
        tdist.barrier()
        with use_ledger(ledger), ledger.step("pipeline"):
            outputs, events = gpipe_forward(model, rank, pp_size, microbatches)
        gathered, ledgers = [None] * pp_size, [None] * pp_size
        tdist.all_gather_object(gathered, events)
        tdist.all_gather_object(ledgers, ledger)
        flat = [e for rank_events in gathered for e in rank_events]
        timelines.append((_makespan(flat), flat, ledgers))
    # The logits go from the last stage to rank 0 (outside the timed schedule), on the
    # ranks' device: a process group on NCCL has no CPU backend to carry a CPU tensor.
    logits = torch.empty(*batch.shape, model.config.vocab_size, dtype=torch.float32,
                         device=model.device)
    if pp_size > 1 and rank == pp_size - 1:
        tdist.send(torch.cat(outputs).float().contiguous(), 0)
    elif pp_size > 1 and rank == 0:
        tdist.recv(logits, pp_size - 1)
    else:
        logits = torch.cat(outputs).float()
    logits = logits.cpu()
    if rank != 0:
        return None
    makespan, flat, ledgers = sorted(timelines, key=lambda t: t[0])[len(timelines) // 2]
    start = min(e[3] for e in flat)
    end = start + makespan
    busy = sum(e[4] - e[3] for e in flat if e[1] == "fwd")
    return PPRun(pp_size, num_microbatches, logits, _with_idle(flat, pp_size, start, end),
                 stage_layers(model.config.num_layers, pp_size), makespan,
                 1.0 - busy / (pp_size * makespan),
                 calc.pp_bubble_fraction(pp_size, num_microbatches), ledgers)


def run_pipeline(pp_size: int, num_microbatches: int, prompt_ids_batch, *,
                 dtype=torch.float32, timeout_s: float = 600.0, repeats: int = 1) -> PPRun:
    """GPipe forward of SmolLM2 on `pp_size` ranks over `num_microbatches` microbatches.

    `prompt_ids_batch`: B prompts of equal length (list of lists or a [B, T] tensor), with
    B a multiple of `num_microbatches`. Returns the logits [B, T, V] and the timeline of
    one forward; with `repeats` > 1 the forward runs that many times and the timeline with
    the median makespan is returned (one launch, the model loaded once).
    """
    batch = torch.as_tensor(prompt_ids_batch, dtype=torch.long)
    if batch.dim() != 2 or batch.numel() == 0:
        raise ValueError(f"prompt_ids_batch must be B prompts of equal length ([B, T]), got "
                         f"shape {tuple(batch.shape)}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
            or num_microbatches < 1 or batch.shape[0] % num_microbatches:
        raise ValueError(f"num_microbatches must be a positive int dividing the batch of "
                         f"{batch.shape[0]} prompts, got {num_microbatches!r}")
    from ..config import ModelConfig
    stage_layers(ModelConfig.smollm2_135m().num_layers, pp_size)  # checks pp_size
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    return launch(_pp_worker, pp_size, batch, num_microbatches, dtype, repeats,
                  timeout_s=timeout_s)
