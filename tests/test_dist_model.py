"""minillm.dist on the real SmolLM2 (9 query / 3 KV heads): TP = 3 equals one process
through the Python launcher and through `torchrun`, per-rank memory matches calc, the
ledger matches calc on every rank, bad sizes are refused, and PP = 2 equals one process.

Each launch loads the model once per rank; assertions are grouped into few launches.
"""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from minillm import calc, dist, generate
from minillm.__main__ import main as cli_main

from test_dist import check_ledger

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea,"]
NEW_TOKENS = 32


def test_param_bytes_per_rank_match_calc_and_the_head_is_tied(smollm):
    model, _ = smollm
    config = model.config
    assert dist.param_bytes(model) == calc.tp_param_bytes_per_rank(config, 1, 4)
    replicated = (2 * config.num_layers + 1) * config.hidden_size * 4
    for tp, ranks in ((3, [0, 1, 2]), (9, [0, 5, 6, 8])):  # TP=9: FFN 1536 = 6 x 171 + 3 x 170
        for rank in ranks:
            shard = dist.shard_model(copy.deepcopy(model), rank, tp)
            nbytes = dist.param_bytes(shard)
            assert nbytes == calc.tp_param_bytes_per_rank(config, tp, 4, rank)
            assert shard.lm_head.weight is shard.embed_tokens.weight  # one tensor, not a copy
            # about 1/N of the sharded weights; the norms are on every rank, and at TP = 9
            # each rank also holds a copy of one of the 3 KV heads
            kv = 2 * dist.kv_heads_per_rank(config, tp) * config.head_dim * 576 * 30 * 4
            all_kv = 2 * config.kv_size * 576 * 30 * 4
            share = (nbytes - replicated - kv) / (dist.param_bytes(model) - replicated - all_kv)
            assert abs(share - 1 / tp) < 0.001
            del shard


def test_tp3_through_the_launcher_equals_one_process(smollm):
    model, tok = smollm
    prompts = [tok.encode(p) for p in PROMPTS]
    runs = dist.run_tp_many(3, prompts, NEW_TOKENS)
    for ids, run in zip(prompts, runs):
        with torch.inference_mode():
            expected = model(torch.tensor([ids], device=model.device))[0].cpu()
        torch.testing.assert_close(run.prefill_logits, expected, atol=1e-4, rtol=0)
        assert run.tokens == generate(model, ids, NEW_TOKENS)
        assert run.param_bytes_per_rank == [calc.tp_param_bytes_per_rank(model.config, 3, 4, r)
                                            for r in range(3)]
        assert len(run.step_times_s) == len(run.tokens)
        for ledger in run.rank_ledgers:
            check_ledger(ledger, model.config, 3, len(ids), len(run.tokens) - 1)
        assert run.ledger.bytes("all_reduce", "decode") == (len(run.tokens) - 1) * \
            calc.tp_allreduce_bytes(1, 576, 30, 4)


def _torchrun(nproc: int, *args: str, timeout: float = 600):
    port = dist.free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "minillm", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_torchrun_tp3_prints_the_same_text_as_one_process(capsys):
    args = ["generate", PROMPTS[2], "--max-new-tokens", str(NEW_TOKENS)]
    assert cli_main(args) == 0
    expected = capsys.readouterr().out
    result = _torchrun(3, *args, "--tp", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected  # rank 0 only: the text appears once
    assert len(expected.strip()) > 20


def test_bad_tp_sizes_fail_fast_with_a_clear_error(capsys):
    result = _torchrun(2, "generate", "hello", "--tp", "3", timeout=120)
    assert result.returncode != 0
    assert "torchrun started 2 processes but --tp is 3" in result.stderr
    result = _torchrun(2, "generate", "hello", "--tp", "2", timeout=120)
    assert result.returncode != 0
    assert "tp_size=2 does not divide the 9 query heads" in result.stderr
    assert "use one of [1, 3, 9]" in result.stderr
    assert cli_main(["generate", "hello", "--tp", "3"]) == 2  # no torchrun around it
    assert "torchrun --nproc-per-node 3" in capsys.readouterr().err


def test_pp2_with_4_microbatches_equals_one_process(smollm):
    model, tok = smollm
    ids = tok.encode(" ".join(PROMPTS))[:12]
    batch = torch.tensor([ids[i:] + ids[:i] for i in range(8)])  # 8 prompts of 12 tokens
    run = dist.run_pipeline(2, 4, batch)
    with torch.inference_mode():
        expected = model(batch.to(model.device)).cpu()
    torch.testing.assert_close(run.logits, expected, atol=1e-4, rtol=0)
    assert run.stage_layers == [(0, 15), (15, 30)]
    assert run.predicted_bubble_fraction == calc.pp_bubble_fraction(2, 4) == 0.2
    assert 0 < run.measured_bubble_fraction < 1
    fwd = [e for e in run.events if e.kind == "fwd"]
    assert sorted((e.rank, e.microbatch) for e in fwd) == [(r, m) for r in (0, 1)
                                                           for m in range(4)]
    for m in range(4):  # stage 1 starts microbatch m only after stage 0 finished it
        done = next(e.end_s for e in fwd if e.rank == 0 and e.microbatch == m)
        assert next(e.start_s for e in fwd if e.rank == 1 and e.microbatch == m) >= done
    message = 2 * 12 * 576 * 4  # [b, T, d] fp32 per microbatch of 2 prompts
    assert [r.num_bytes for r in run.ledgers[0].select("send")] == [message] * 4
    assert [r.num_bytes for r in run.ledgers[1].select("recv")] == [message] * 4
