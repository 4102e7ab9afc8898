"""minillm.dist without the real model: the head rule, the calc formulas, the launcher's
failure handling, and a small random model (8 query / 4 KV heads) at TP = 2, 4 and 8
against one process, with its communication ledger checked byte for byte.

Launches spawn fresh Python processes (seconds each), so those tests are marked slow.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from minillm import LlamaModel, ModelConfig, calc, dist, generate

SMOL = ModelConfig.smollm2_135m()
# 8 query / 4 KV heads; FFN 100 and vocab 131 split unevenly at TP = 8 (13/12, 17/16 rows).
TINY = ModelConfig.tiny(num_heads=8, num_kv_heads=4, head_dim=16, hidden_size=64,
                        intermediate_size=100, vocab_size=131)


# --------------------------------------------------------------------------- head rule


def test_valid_tp_sizes_follow_the_head_rule():
    assert dist.valid_tp_sizes(SMOL) == [1, 3, 9]
    assert dist.valid_tp_sizes(TINY) == [1, 2, 4, 8]
    assert [dist.kv_heads_per_rank(SMOL, tp) for tp in (1, 3, 9)] == [3, 1, 1]
    assert [dist.kv_replicas(SMOL, tp) for tp in (1, 3, 9)] == [1, 1, 3]
    assert [dist.kv_replicas(TINY, tp) for tp in (2, 4, 8)] == [1, 1, 2]
    # 12 query / 4 KV heads: 6 divides the query heads, but 4 KV heads cannot go on 6 ranks
    odd = ModelConfig.tiny(num_heads=12, num_kv_heads=4)
    assert 6 not in dist.valid_tp_sizes(odd)


def test_rank_heads_keep_each_query_head_with_its_kv_head():
    for config in (SMOL, TINY):
        group = config.num_heads // config.num_kv_heads
        for tp in dist.valid_tp_sizes(config):
            owners = []
            for rank in range(tp):
                q, kv = dist.rank_heads(config, rank, tp)
                assert {h // group for h in q} <= set(kv)  # attention needs no communication
                owners += q
            assert sorted(owners) == list(range(config.num_heads))


def test_tp2_on_smollm2_is_refused_with_the_head_counts():
    with pytest.raises(ValueError) as err:
        dist.check_tp_size(SMOL, 2)
    message = str(err.value)
    for part in ("tp_size=2", "9 query heads", "num_heads=9", "num_kv_heads=3", "[1, 3, 9]"):
        assert part in message


def test_run_tp_refuses_tp2_before_starting_any_process(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr(dist.tp_run, "launch", no_launch)
    with pytest.raises(ValueError, match=r"use one of \[1, 3, 9\]"):
        dist.run_tp(2, [1, 2, 3], 4)


# --------------------------------------------------------------------------- calc


def test_tp_formulas_by_hand():
    assert calc.tp_allreduce_count(30) == 61
    assert calc.tp_allreduce_bytes(7, 576, 30, 4) == 61 * 7 * 576 * 4
    assert calc.tp_logits_gather_bytes(1, 49152, 3, 4) == 16384 * 4
    assert calc.tp_logits_gather_bytes(2, 131, 8, 2) == 2 * 17 * 2  # padded to ceil(131/8)
    assert [calc.tp_shard_size(100, 8, r) for r in range(8)] == [13] * 4 + [12] * 4
    # TP = 1 holds the whole model, tied embedding counted once
    assert calc.tp_param_bytes_per_rank(SMOL, 1, 4) == SMOL.num_params() * 4
    # replicated: 61 RMSNorm vectors; every other parameter splits 3 ways exactly
    replicated = (2 * SMOL.num_layers + 1) * SMOL.hidden_size
    assert calc.tp_param_bytes_per_rank(SMOL, 3, 4) == 4 * (
        (SMOL.num_params() - replicated) // 3 + replicated)


def test_tp_step_time_nvlink_against_pcie():
    nv = calc.tp_step_time_s(SMOL, 1, 3, calc.NVLINK_H100_BYTES_PER_S, 3.35e12, 990e12)
    pcie = calc.tp_step_time_s(SMOL, 1, 3, calc.PCIE_GEN5_BYTES_PER_S, 3.35e12, 990e12)
    assert nv["compute_s"] == pcie["compute_s"]
    assert pcie["comm_s"] / nv["comm_s"] == pytest.approx(450 / 32)
    message = 1 * 576 * 2  # one token of the hidden state, bf16
    assert nv["comm_s"] == pytest.approx(
        61 * calc.allreduce_time_s(message, 3, 450e9) + 2 * 16384 * 2 / 450e9)
    assert calc.tp_step_time_s(SMOL, 1, 1, 450e9, 3.35e12, 990e12)["comm_s"] == 0
    prefill = calc.tp_step_time_s(SMOL, 40, 3, 450e9, 3.35e12, 990e12, logit_rows=1)
    assert prefill["comm_s"] == pytest.approx(
        61 * calc.allreduce_time_s(40 * 576 * 2, 3, 450e9) + 2 * 16384 * 2 / 450e9)


# --------------------------------------------------------------------------- launcher


def _spawned_children() -> list[int]:
    """Pids of this process's children started by multiprocessing spawn (zombies too)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def _record_pid_then(rank, world_size, pid_dir, mode):
    Path(pid_dir, str(os.getpid())).touch()
    if mode == "raise" and rank == 1:
        raise ValueError("rank 1 broke on purpose")
    if mode == "raise" and rank == 0:
        tdist.barrier()  # rank 1 never arrives: without cleanup this waits forever
    time.sleep(600)


def _assert_all_gone(pid_dir, world_size):
    pids = [int(p.name) for p in Path(pid_dir).iterdir()]
    assert len(pids) == world_size
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # gone and reaped: not even a zombie
            os.kill(pid, 0)
    assert _spawned_children() == []


@pytest.mark.slow
def test_launch_returns_rank0_result_and_reports_a_failing_rank(tmp_path):
    assert dist.launch(_rank_sum, 2, 10) == (0, 2, 10 + 0 + 1)
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed first.*rank 1 broke on purpose"):
        dist.launch(_record_pid_then, 3, str(tmp_path), "raise", timeout_s=120)
    _assert_all_gone(tmp_path, 3)


def _rank_sum(rank, world_size, base):
    total = torch.tensor([float(rank)], device=dist.rank_device(rank))  # NCCL: on its GPU
    tdist.all_reduce(total)
    return rank, world_size, base + int(total)


@pytest.mark.slow
def test_launch_timeout_kills_and_reaps_every_rank(tmp_path):
    with pytest.raises(TimeoutError, match="timeout_s=20"):
        dist.launch(_record_pid_then, 2, str(tmp_path), "sleep", timeout_s=20)
    _assert_all_gone(tmp_path, 2)


def test_launch_refuses_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is already in use"):
            dist.launch(_rank_sum, 2, 0, port=port)
    assert _spawned_children() == []


# --------------------------------------------------------------------------- tiny model


def _tiny_tp(rank, world_size, ids, new_tokens):
    model = LlamaModel(TINY).init_random_weights(seed=0).eval()
    model = model.to(dist.rank_device(rank))  # NCCL (a GPU per rank): on the rank's GPU
    ids = ids.to(model.device)
    dist.shard_model(model, rank, world_size)
    forward, generation = dist.CommLedger(), dist.CommLedger()
    with torch.inference_mode(), dist.use_ledger(forward), forward.step("prefill"):
        logits = model(ids)  # every position: [1, T, V] on rank 0, None elsewhere
    with dist.use_ledger(generation):
        tokens = list(dist.tp_generate_stream(model, ids[0].tolist(), new_tokens,
                                              ignore_eos=True))
    ledgers = [None] * world_size
    tdist.all_gather_object(ledgers, (forward, generation))
    return (None if logits is None else logits.cpu()), tokens, ledgers


def check_ledger(ledger, config, tp_size, prefill_tokens, num_decode_steps,
                 prefill_logit_rows=None):
    """Every step of a rank's ledger equals calc: 2L + 1 all-reduces of [tokens, hidden],
    one gather of the logits (of `prefill_logit_rows` rows at prefill: all by default), and
    (when generating) one 8-byte broadcast of the token."""
    L, d, V = config.num_layers, config.hidden_size, config.vocab_size
    steps = {}
    for r in ledger.records:
        steps.setdefault((r.phase, r.step), []).append(r)
    assert sum(phase == "decode" for phase, _ in steps) == num_decode_steps
    assert sum(phase == "prefill" for phase, _ in steps) == 1
    for (phase, _), records in steps.items():
        tokens = prefill_tokens if phase == "prefill" else 1
        reduces = [r for r in records if r.op == "all_reduce"]
        assert len(reduces) == calc.tp_allreduce_count(L) == 2 * L + 1
        assert {r.shape for r in reduces} == {(1, tokens, d)}
        assert sum(r.num_bytes for r in reduces) == calc.tp_allreduce_bytes(tokens, d, L, 4)
        gathers = [r.num_bytes for r in records if r.op == "gather"]
        rows = prefill_logit_rows or tokens if phase == "prefill" else 1
        assert gathers == [calc.tp_logits_gather_bytes(rows, V, tp_size, 4)]
        broadcasts = [r.num_bytes for r in records if r.op == "broadcast"]
        assert broadcasts in ([], [8])
        assert len(records) == len(reduces) + 1 + len(broadcasts)


@pytest.mark.slow
@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_tiny_model_tp_matches_one_process(tp_size):
    reference = LlamaModel(TINY).init_random_weights(seed=0).eval()
    ids = torch.randint(3, TINY.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(ids)
    expected_tokens = generate(reference, ids[0].tolist(), 6, ignore_eos=True)
    logits, tokens, ledgers = dist.launch(_tiny_tp, tp_size, ids, 6)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert tokens == expected_tokens
    for forward, generation in ledgers:  # every rank
        check_ledger(forward, TINY, tp_size, ids.shape[1], 0)
        # generation's prefill gathers the last position only (last_only=True)
        check_ledger(generation, TINY, tp_size, ids.shape[1], 5, prefill_logit_rows=1)


@pytest.mark.slow
def test_ranks_die_with_a_killed_launcher(tmp_path):
    """kill -9 the process that called launch: its ranks must not outlive it."""
    import signal
    import subprocess
    import sys
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_dist; "
            "from minillm import dist; "
            "dist.launch(test_dist._record_pid_then, 2, sys.argv[2], 'sleep', timeout_s=600)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent),
                               str(tmp_path)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p.name) for p in tmp_path.iterdir()]
        assert len(pids) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_default_backend_needs_a_gpu_per_rank(monkeypatch):
    """NCCL only when every rank gets its own GPU; one GPU with 3 ranks takes gloo."""
    import importlib
    launch_module = importlib.import_module("minillm.dist.launch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch_module.default_backend(1) == "nccl"
    assert launch_module.default_backend(3) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch_module.default_backend(1) == "gloo"


def test_timed_collectives_on_a_gpu_drain_the_stream_around_them_but_not_isend(monkeypatch):
    # Under NCCL a collective returns once queued; its ledger seconds must cover its run.
    from minillm.dist import comm

    log = []

    class Stream:
        def synchronize(self):
            log.append("sync")

    class CudaTensor:  # what _timed asks of a tensor on a GPU
        is_cuda, device = True, torch.device("cuda", 0)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    ledger = dist.CommLedger()
    monkeypatch.setattr(ledger, "add", lambda op, tensor, seconds: log.append(op))
    with dist.use_ledger(ledger):
        comm._timed("all_reduce", CudaTensor(), lambda: log.append("call"))
        comm._timed("send", CudaTensor(), lambda: log.append("call"))
    assert log == ["sync", "call", "sync", "all_reduce", "call", "send"]
    log.clear()
    comm._timed("all_reduce", CudaTensor(), lambda: log.append("call"))  # no ledger: no syncs
    assert log == ["call"]
