"""Tensor and pipeline parallelism over `torch.distributed` (gloo on CPU, NCCL on CUDA).

One concept per module:

    launch.py     `launch(fn, world_size, ...)`: spawn ranks on 127.0.0.1, return rank 0's
                  result, leave no process behind; `init_from_env` under torchrun
    comm.py       the collectives the layers use, each recorded in a `CommLedger`
    layers.py     ColumnParallelLinear, RowParallelLinear (on the `Linear` seam),
                  VocabParallelEmbedding, ParallelLMHead (tied: shares the embedding shard)
    sharding.py   the head rule (`check_tp_size`, KV replication) and `shard_model`
    generate.py   generation on a sharded model: rank 0 samples, broadcasts the token
    tp_run.py     `run_tp`: SmolLM2 at a TP size, with ledgers, memory and step times
    pipeline.py   pipeline parallelism: layer groups, a GPipe schedule, `run_pipeline`

The formulas these are checked against live in `minillm.calc.parallel`.
"""
from .comm import CommLedger, CommRecord, use_ledger
from .generate import StepTrace, tp_generate_stream
from .launch import free_port, init_from_env, launch, rank_device, ranks_device
from .layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                     VocabParallelEmbedding)
from .pipeline import (PipelineEvent, PPRun, gpipe_forward, keep_stage, run_pipeline,
                       stage_forward, stage_layers)
from .sharding import (TPInfo, check_tp_size, kv_heads_per_rank, kv_replicas, param_bytes,
                       rank_heads, shard_model, valid_tp_sizes)
from .tp_run import TPRun, run_tp, run_tp_many

__all__ = [
    "launch", "init_from_env", "free_port", "rank_device", "ranks_device",
    "CommLedger", "CommRecord", "use_ledger",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
    "valid_tp_sizes", "check_tp_size", "kv_heads_per_rank", "kv_replicas", "rank_heads",
    "shard_model", "param_bytes", "TPInfo",
    "tp_generate_stream", "StepTrace", "TPRun", "run_tp", "run_tp_many",
    "PipelineEvent", "PPRun", "stage_layers", "keep_stage", "stage_forward", "gpipe_forward",
    "run_pipeline",
]
