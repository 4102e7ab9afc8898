"""Lab 08 (model parallelism): its checks fed right and deliberately wrong code, the stubs of
the released lab, the timeline model (``minillm.calc.timeline``) against ``calc``'s closed
forms, the parallelism widget's data, and the quiz bank.

Each wrong version must fail with a message that names its mistake. No real model and no
process group: the whole file runs in a few seconds (``tests/test_dist*.py`` run the ranks).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from minillm import calc  # noqa: E402
from minillm.calc import timeline as tl  # noqa: E402
from quizzes import check  # noqa: E402
from quizzes.checks import CheckFailed, NotImplementedYet  # noqa: E402
from quizzes.checks.lab08 import reference_allreduces, reference_shard_qkv  # noqa: E402
from quizzes.questions import answer, expected, load_bank  # noqa: E402
from widgets import parallelism  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


def failure(fn, student, seed) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(student, seed=seed)
    return str(info.value)


# ----------------------------------------------------------------------- exercise 1: column / row


def column(x, w, tp):
    per = [x @ c for c in w.chunk(tp, dim=1)]
    return per, torch.cat(per, dim=-1)


def row(x, w, tp):
    per = [a @ b for a, b in zip(x.chunk(tp, dim=-1), w.chunk(tp, dim=0))]
    return per, sum(per)


@pytest.mark.parametrize("seed", SEEDS)
def test_matmul_checks_accept_the_splits(seed, capsys):
    check.column_parallel(column, seed=seed)
    check.row_parallel(row, seed=seed)
    out = capsys.readouterr().out
    assert "✓ column_parallel: matches the reference on 3 random cases" in out
    assert "✓ row_parallel: matches the reference on 3 random cases" in out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda x, w, tp: (column(x, w, tp)[0], sum(column(x, w, tp)[0])), "you summed the column shards"),
    (lambda x, w, tp: (column(x, w, tp)[0], torch.cat(column(x, w, tp)[0], 0)), "along dim 0, the tokens"),
    (lambda x, w, tp: (column(x, w, tp)[0], column(x, w, tp)[0][0]), "rank 0's block only"),
    (lambda x, w, tp: ([x @ w[:, r::tp] for r in range(tp)], x @ w), "every tp-th column"),
    (lambda x, w, tp: (row(x, w, tp)[0], x @ w), "ROW-parallel split"),
    (lambda x, w, tp: ([x @ w] * tp, x @ w), "nothing is split"),
    (lambda x, w, tp: x @ w, "return a pair (per_rank, y)"),
])
def test_column_parallel_names_the_mistake(fn, words, seed):
    msg = failure(check.column_parallel, fn, seed)
    assert words in msg, msg


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda x, w, tp: (row(x, w, tp)[0], torch.cat(row(x, w, tp)[0], -1)), "you concatenated the row shards"),
    (lambda x, w, tp: (row(x, w, tp)[0], torch.cat(row(x, w, tp)[0], 0)), "stacked the partial sums"),
    (lambda x, w, tp: (row(x, w, tp)[0], sum(row(x, w, tp)[0]) / tp), "you averaged"),
    (lambda x, w, tp: (row(x, w, tp)[0], row(x, w, tp)[0][0]), "without the all-reduce"),
    (lambda x, w, tp: (column(x, w, tp)[0], x @ w), "COLUMN-parallel split"),
    (lambda x, w, tp: ([x[:, r::tp] @ w[r::tp] for r in range(tp)], x @ w), "every tp-th row"),
    (lambda x, w, tp: (row(x, w, tp)[0][:-1], x @ w), "per_rank must be a list of"),
])
def test_row_parallel_names_the_mistake(fn, words, seed):
    msg = failure(check.row_parallel, fn, seed)
    assert words in msg, msg


# ----------------------------------------------------------------------- exercise 2: qkv with GQA


def _heads(w, H, KV, hd, tp, rank, kv_of):
    """A qkv shard whose KV heads come from kv_of(rank), refusing what the rule refuses."""
    if calc.tp_size_problem(H, KV, tp):
        raise ValueError("bad tp_size")
    q, k, v = w.split([H * hd, KV * hd, KV * hd])
    qh, kv = H // tp, kv_of(rank, tp, KV)
    rows = lambda part: torch.cat([part[h * hd:(h + 1) * hd] for h in kv])  # noqa: E731
    return torch.cat([q[rank * qh * hd:(rank + 1) * qh * hd], rows(k), rows(v)])


def kv_by_modulo(w, H, KV, hd, tp, rank):
    return _heads(w, H, KV, hd, tp, rank,
                  lambda r, tp, KV: [r % KV] if tp > KV else range(r * KV // tp, (r + 1) * KV // tp))


def kv_chunked(w, H, KV, hd, tp, rank):
    if calc.tp_size_problem(H, KV, tp):
        raise ValueError("bad tp_size")
    q, k, v = w.split([H * hd, KV * hd, KV * hd])
    return torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])


def never_refuses(w, H, KV, hd, tp, rank):
    try:
        return reference_shard_qkv(w, H, KV, hd, tp, rank)
    except ValueError:
        return w[:hd]


def refuses_with_the_wrong_error(w, H, KV, hd, tp, rank):
    if H % tp:
        raise AssertionError("no")
    return reference_shard_qkv(w, H, KV, hd, tp, rank)


@pytest.mark.parametrize("seed", SEEDS)
def test_shard_qkv_accepts_the_reference(seed, capsys):
    check.shard_qkv(reference_shard_qkv, seed=seed)
    assert "✓ shard_qkv: matches the reference on 4 random cases" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (kv_by_modulo, "you gave it KV head"),
    (lambda w, H, KV, hd, tp, rank: (reference_shard_qkv(w, H, KV, hd, tp, rank), w.chunk(tp)[rank])[1],
     "three stacked ones"),
    (lambda w, H, KV, hd, tp, rank: reference_shard_qkv(w, H, KV, hd, tp, rank)[:H // tp * hd],
     "only the Q rows"),
    (never_refuses, "yet your function returned a shard"),
    (refuses_with_the_wrong_error, "so raise ValueError, not AssertionError"),
])
def test_shard_qkv_names_the_mistake(fn, words, seed):
    msg = failure(check.shard_qkv, fn, seed)
    assert words in msg, msg


def test_shard_qkv_names_a_kv_split_through_a_head():
    """8 query, 2 KV heads at tp = 4 with head_dim 2 and 4: chunking K 4 ways cuts heads."""
    msgs = [failure(check.shard_qkv, kv_chunked, s) for s in range(12)]
    assert any("cuts through a head" in m for m in msgs), msgs


def test_reference_shard_is_what_dist_keeps():
    """The oracle agrees with minillm.dist's head assignment on SmolLM2's heads."""
    from minillm import dist
    from minillm.config import ModelConfig

    cfg = ModelConfig.smollm2_135m()
    hd = 2
    w = torch.randn((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, 3, dtype=torch.float64)
    for tp in (3, 9):
        for rank in range(tp):
            q_heads, kv_heads = dist.rank_heads(cfg, rank, tp)
            rows = [h * hd + i for h in q_heads for i in range(hd)]
            for off in (cfg.num_heads * hd, (cfg.num_heads + cfg.num_kv_heads) * hd):
                rows += [off + h * hd + i for h in kv_heads for i in range(hd)]
            assert torch.equal(reference_shard_qkv(w, cfg.num_heads, cfg.num_kv_heads, hd, tp, rank), w[rows])
    with pytest.raises(ValueError):
        reference_shard_qkv(w, cfg.num_heads, cfg.num_kv_heads, hd, 2, 0)


# ----------------------------------------------------------------------- exercise 3: the all-reduces


@pytest.mark.parametrize("seed", SEEDS)
def test_allreduces_accepts_the_reference(seed, capsys):
    check.allreduces_per_layer(reference_allreduces, seed=seed)
    assert "✓ allreduces_per_layer" in capsys.readouterr().out


def _with(**changes):
    def fn(T, d, f, tp, b):
        out = reference_allreduces(T, d, f, tp, b)
        for op, value in changes.items():
            if value is None:
                out.pop(op)
            else:
                out[op] = value(T, d, f, tp, b)
        return out
    return fn


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (_with(qkv_proj=lambda T, d, f, tp, b: T * d * b),
     "no all-reduce after qkv_proj: qkv_proj is column-parallel"),
    (_with(gate_up_proj=lambda T, d, f, tp, b: T * d * b), "SiLU(gate)·up is elementwise"),
    (_with(attention=lambda T, d, f, tp, b: T * d * b), "no all-reduce after attention"),
    (_with(o_proj=None), "missing after o_proj"),
    (_with(down_proj=None), "missing after down_proj"),
    (_with(down_proj=lambda T, d, f, tp, b: T * f * b), "uses intermediate_size"),
    (_with(o_proj=lambda T, d, f, tp, b: T * d * b / tp), "divided by tp_size"),
    (_with(o_proj=lambda T, d, f, tp, b: T * d * b * tp), "multiplied by tp_size"),
    (_with(o_proj=lambda T, d, f, tp, b: 2 * (tp - 1) / tp * T * d * b), "the ring's traffic per GPU"),
    (_with(o_proj=lambda T, d, f, tp, b: T * d), "counts elements"),
    (lambda T, d, f, tp, b: {"out_proj": 1}, "are not ops of the layer"),
    (lambda T, d, f, tp, b: [("o_proj", T * d * b)], "return a dict"),
])
def test_allreduces_names_the_mistake(fn, words, seed):
    msg = failure(check.allreduces_per_layer, fn, seed)
    assert words in msg, msg


def test_the_layer_rule_adds_up_to_calc():
    """Two per layer times the layers, plus the embedding's: calc.tp_allreduce_bytes."""
    T, d, L, b = 37, 576, 30, 4
    per_layer = sum(reference_allreduces(T, d, 1536, 3, b).values())
    assert per_layer * L + T * d * b == calc.tp_allreduce_bytes(T, d, L, b)
    assert len(reference_allreduces(T, d, 1536, 3, b)) == calc.tp_allreduces_per_layer()


# ----------------------------------------------------------------------- the released stubs


def test_every_stub_reports_not_implemented():
    import nbformat

    from quizzes.release import build_lab, tag_value

    name = "08-parallelism.ipynb"
    lab = build_lab(nbformat.read(ROOT / "solutions" / name, as_version=4), name)
    cells = {tag_value(c, "exercise"): c.source for c in lab.cells if tag_value(c, "exercise")}
    assert set(cells) == {"column_parallel", "row_parallel", "shard_qkv", "allreduces_per_layer"}
    ns = {"torch": torch}
    for src in cells.values():
        exec(src, ns)
    for cid in cells:
        with pytest.raises(NotImplementedYet, match=f"✗ {cid}: not implemented yet") as info:
            getattr(check, cid)(ns[cid])
        assert "Hint: " in str(info.value)


# ----------------------------------------------------------------------- the timeline model


@pytest.mark.parametrize("stages, microbatches", [(2, 1), (2, 4), (4, 8), (4, 1), (8, 3), (3, 5)])
def test_timeline_bubble_is_the_gpipe_formula(stages, microbatches):
    t = tl.tp_pp_timeline(24, 1e-3, 0, tp_size=1, pp_stages=stages, num_microbatches=microbatches)
    assert t.bubble_fraction == pytest.approx(calc.pp_bubble_fraction(stages, microbatches), rel=1e-9)
    assert t.total_s == pytest.approx((microbatches + stages - 1) * 24 / stages * 1e-3)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_timeline_tensor_parallel_prices_two_allreduces_per_layer(tp):
    msg, bw, lat, layer = 4096 * 8192 * 2, 450e9, 2e-6, 3e-3
    t = tl.tp_pp_timeline(10, layer, msg, tp_size=tp, link_bandwidth_bytes_per_s=bw, latency_s=lat)
    ar = calc.allreduce_time_s(msg, tp, bw, lat)
    assert t.allreduce_s == pytest.approx(ar)
    assert t.total_s == pytest.approx(10 * (layer / tp + calc.tp_allreduces_per_layer() * ar))
    assert t.comm_fraction == pytest.approx(2 * ar / (layer / tp + 2 * ar))
    assert t.bubble_fraction == 0
    assert sum(i.kind == "comm" for i in t.rank_intervals(0)) == 2 * 10


def test_timeline_intervals_tile_each_rank_without_overlap():
    t = tl.tp_pp_timeline(30, 1e-3, 1e6, tp_size=2, pp_stages=4, num_microbatches=3, latency_s=1e-5,
                          link_bandwidth_bytes_per_s=32e9)
    assert t.world_size == 8 and t.layers_per_stage == (8, 8, 7, 7)
    for r in range(8):
        items = t.rank_intervals(r)
        assert items[0].start_s == 0 and items[-1].end_s == pytest.approx(t.total_s)
        assert all(a.end_s == pytest.approx(b.start_s) for a, b in zip(items, items[1:]))
        assert sum(t.seconds(k, r) for k in tl.KINDS) == pytest.approx(t.total_s)
    assert t.rank_intervals(2) == [tl.Interval(2, 1, i.kind, i.start_s, i.end_s, i.microbatch, i.layer)
                                   for i in t.rank_intervals(3)]  # tp ranks of a stage are alike
    assert t.send_s == pytest.approx(1e6 / 32e9 + 1e-5)
    first = next(i for i in t.rank_intervals(2) if i.kind == "compute")
    stage0_done = max(i.end_s for i in t.rank_intervals(0) if i.microbatch == 0)
    assert first.start_s == pytest.approx(stage0_done + t.send_s)  # waits for stage 0's send


def test_timeline_rejects_bad_arguments():
    with pytest.raises(ValueError, match="pp_stages"):
        tl.tp_pp_timeline(4, 1e-3, 0, pp_stages=5)
    with pytest.raises(ValueError, match="tp_size"):
        tl.tp_pp_timeline(4, 1e-3, 0, tp_size=0)
    with pytest.raises(ValueError, match="kind"):
        tl.tp_pp_timeline(4, 1e-3, 0).seconds("waiting")


def test_layer_time_is_the_roofline():
    p = 856e6
    assert tl.layer_time_s(p, 1, 2, 989e12, 3.35e12) == pytest.approx(p * 2 / 3.35e12)   # decode: reads
    assert tl.layer_time_s(p, 8192, 2, 989e12, 3.35e12) == pytest.approx(2 * 8192 * p / 989e12)


# ----------------------------------------------------------------------- the widget


def fake_pipeline(stages=2, microbatches=4):
    """A GPipe run as dist.run_pipeline reports it: 1 s per forward, 0.1 s per transfer."""
    events = []
    for s in range(stages):
        for m in range(microbatches):
            start = (m + s) * 1.1
            if s:
                events.append((s, "recv", m, start - 0.1, start))
            events.append((s, "fwd", m, start, start + 1))
            if s < stages - 1:
                events.append((s, "send", m, start + 1, start + 1.1))
    return SimpleNamespace(events=events, pp_size=stages, num_microbatches=microbatches,
                           measured_bubble_fraction=None,
                           predicted_bubble_fraction=calc.pp_bubble_fraction(stages, microbatches))


def test_widget_data_is_the_timeline_model():
    d = parallelism.parallelism_data(tp_size=4, pp_stages=2, num_microbatches=4, tokens_per_microbatch=512)
    cfg = parallelism.MODELS["Llama-2-70B"]
    layer = tl.layer_time_s(parallelism._per_layer_params(cfg), 512, 2, 989e12, 3.35e12)
    want = tl.tp_pp_timeline(80, layer, 512 * 8192 * 2, 4, 2, 4, 450e9, 2e-6)
    assert d.timeline == want
    assert d.weight_bytes_per_gpu == pytest.approx(17.5e9)
    assert "= 17.5 GB of 80 GB" in d.summary[3]
    pcie = parallelism.parallelism_data(tp_size=4, link=list(parallelism.LINKS)[1])
    assert pcie.timeline.comm_fraction > parallelism.parallelism_data(tp_size=4).timeline.comm_fraction


@pytest.mark.parametrize("tp, gb", [(1, 140), (2, 70), (4, 35), (8, 17.5)])
def test_widget_memory_per_gpu_of_70b(tp, gb):
    assert parallelism.parallelism_data(tp_size=tp).weight_bytes_per_gpu == pytest.approx(gb * 1e9)


def test_measured_pipeline_fills_gaps_with_bubble():
    m = parallelism.measured_pipeline(fake_pipeline())
    assert m.world_size == 2 and m.total_s == pytest.approx(4 * 1.1 + 1)
    for r in (0, 1):
        mine = [e for e in m.events if e[0] == r]
        assert sum(e[4] - e[3] for e in mine) == pytest.approx(m.total_s)
    idle = sum(e[4] - e[3] for e in m.events if e[1] == "bubble")
    assert m.bubble_fraction == pytest.approx(idle / (2 * m.total_s))
    assert m.predicted_bubble_fraction == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unknown event kind"):
        parallelism.measured_pipeline(SimpleNamespace(events=[(0, "nap", 0, 0.0, 1.0)]))


def test_view_redraws_on_every_control():
    v = parallelism.view(tp_size=8, measured=fake_pipeline())
    assert v.error is None and v.png.startswith(b"\x89PNG") and v.renders == 1
    v.controls["pp_stages"].value = 4
    v.controls["num_microbatches"].value = 8
    assert v.renders == 3 and v.data.timeline.pp_stages == 4 and v.data.timeline.world_size == 32
    v.controls["tokens_per_microbatch"].value = 1
    v.controls["link"].value = list(parallelism.LINKS)[1]
    assert v.renders == 5 and "measured on this machine: PP = 2" in v.summary.value


# ----------------------------------------------------------------------- the quiz


def test_bank_numbers_are_the_books():
    """(tests/test_quizzes_core.py checks that every question accepts its own answer.)"""
    assert len(load_bank("lab08").questions) >= 12
    assert expected("lab08.q1") == 65                                   # 2 × 32 + 1
    assert expected("lab08.q2") == pytest.approx(112)
    assert expected("lab08.q3") == pytest.approx(1.5 * 2048 * 5120 * 2 / 450e9 * 1e3)  # 0.070 ms
    assert expected("lab08.q4") == pytest.approx(0.983, abs=0.001)
    assert expected("lab08.q6") == pytest.approx(25)
    assert expected("lab08.q7") == pytest.approx(87.5)
    assert expected("lab08.q8") == pytest.approx(50.625)
    assert expected("lab08.q10") == 4
    assert expected("lab08.q15") == pytest.approx(56 * 3 * 6144 * 16384 * 2 / 1e9)  # 33.8 GB
    assert expected("lab08.q16") == pytest.approx(2 * 2 * 0.75 * 6144 * 2 / 1e3)   # 36.9 KB
    assert not answer("lab08.q3", "0.035 ms").correct  # the 900 GB/s bidirectional figure
    assert not answer("lab08.q6", "33%").correct       # (P − 1) / M
    assert not answer("lab08.q15", "270 GB").correct   # every expert on every GPU
    assert not answer("lab08.q16", "49.2 KB").correct  # every expert counted as remote


def test_measured_question_marks_a_wild_prediction_wrong():
    ledger = calc.tp_allreduce_bytes(37, 576, 30, 4)  # 5.2 MB: 37 tokens at TP = 3, fp32
    m = {"tp_prefill_allreduce_bytes": ledger}
    assert answer("lab08.q12", "5.2 MB", m).correct
    assert answer("lab08.q12", f"{ledger * 1.15:.0f} B", m).correct
    for wrong in (f"{ledger * 10:.0f} B",             # 10x off
                  f"{ledger / 3:.0f} B",              # divided by tp
                  f"{ledger * 4 / 3:.0f} B",          # the ring's 2(N-1)/N per GPU
                  f"{ledger * 2:.0f} B",              # fp32 counted as 8 bytes
                  f"{37 * 576 * 4:.0f} B"):           # one all-reduce only
        assert not answer("lab08.q12", wrong, m).correct, wrong


def test_rank_memory_prediction_marks_a_wild_one_wrong():
    from minillm import ModelConfig

    measured = calc.tp_param_bytes_per_rank(ModelConfig.smollm2_135m(), 3, 4)
    m = {"tp_rank0_param_bytes": measured}
    assert answer("lab08.q17", "179 MB", m).correct           # a third of 538 MB
    for wrong in ("538 MB", "60 MB", "359 MB"):  # nothing split, split 9 ways, fp32 counted as 8 B
        assert not answer("lab08.q17", wrong, m).correct, wrong


def test_measured_pipeline_reads_dist_pipeline_events():
    """dist.run_pipeline's own event type, idle gaps (microbatch -1) included; its measured
    bubble (1 − Σ fwd ÷ (P · makespan)) is shown as given."""
    from minillm.dist import PipelineEvent

    ev = [PipelineEvent(0, "fwd", 0, 0.0, 1.0), PipelineEvent(0, "send", 0, 1.0, 1.1),
          PipelineEvent(0, "idle", -1, 1.1, 2.1),
          PipelineEvent(1, "idle", -1, 0.0, 1.0), PipelineEvent(1, "recv", 0, 1.0, 1.1),
          PipelineEvent(1, "fwd", 0, 1.1, 2.1)]
    run = SimpleNamespace(events=ev, pp_size=2, num_microbatches=1,
                          measured_bubble_fraction=1 - 2.0 / (2 * 2.1), predicted_bubble_fraction=0.5)
    m = parallelism.measured_pipeline(run)
    assert [(e[0], e[1]) for e in m.events] == [(0, "compute"), (0, "comm"), (0, "bubble"),
                                                (1, "bubble"), (1, "comm"), (1, "compute")]
    assert m.bubble_fraction == pytest.approx(1 - 2.0 / 4.2) and m.total_s == pytest.approx(2.1)
    d = parallelism.parallelism_data(tp_size=1, pp_stages=2, measured=run)
    assert "bubble 52% of the ranks' time (formula 50%)" in d.summary[-1]
