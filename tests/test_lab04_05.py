"""Labs 04 and 05: their checks fed right and deliberately wrong code, the stubs of the
released labs, the block-pool and batching widgets (against calc and the real
BlockManager/Scheduler), and the quiz banks. Small pools and workloads: well under a minute.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minillm import calc  # noqa: E402
from minillm.paged import BlockManager, hash_block_tokens  # noqa: E402
from quizzes import check  # noqa: E402
from quizzes.checks import CheckFailed, NotImplementedYet  # noqa: E402
from quizzes.checks.lab05 import reference_batch_steps, reference_schedule_step  # noqa: E402
from quizzes.questions import answer, expected, load_bank  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234


def failure(fn, *args, **kw) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(*args, seed=SEED, **kw)
    return str(info.value)


# ----------------------------------------------------------------------- lab 04: allocator


class Allocator:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.block_tables, self.num_tokens = {}, {}

    def _take(self):
        b = self.free_blocks.pop(0)
        self.ref_cnt[b] = 1
        return b

    def _drop(self, b):
        self.ref_cnt[b] -= 1
        if self.ref_cnt[b] == 0:
            self.free_blocks.append(b)

    def allocate(self, seq_id, num_tokens):
        self.block_tables[seq_id] = [self._take() for _ in range(-(-num_tokens // self.block_size))]
        self.num_tokens[seq_id] = num_tokens
        return list(self.block_tables[seq_id])

    def append(self, seq_id):
        table, n = self.block_tables[seq_id], self.num_tokens[seq_id]
        copies = []
        if n % self.block_size == 0:
            table.append(self._take())
        elif self.ref_cnt[table[-1]] > 1:
            old, new = table[-1], self._take()
            self._drop(old)
            table[-1] = new
            copies.append((old, new))
        self.num_tokens[seq_id] = n + 1
        return copies

    def fork(self, parent, child):
        self.block_tables[child] = list(self.block_tables[parent])
        self.num_tokens[child] = self.num_tokens[parent]
        for b in self.block_tables[child]:
            self.ref_cnt[b] += 1

    def free(self, seq_id):
        for b in reversed(self.block_tables.pop(seq_id)):
            self._drop(b)
        del self.num_tokens[seq_id]


class Leaks(Allocator):
    def free(self, seq_id):  # drops the refs but never returns the blocks
        for b in self.block_tables.pop(seq_id):
            self.ref_cnt[b] -= 1


class NoCopyOnWrite(Allocator):
    def append(self, seq_id):
        if self.num_tokens[seq_id] % self.block_size == 0:
            self.block_tables[seq_id].append(self._take())
        self.num_tokens[seq_id] += 1
        return []


class ForkWithoutRef(Allocator):
    def fork(self, parent, child):
        self.block_tables[child] = list(self.block_tables[parent])
        self.num_tokens[child] = self.num_tokens[parent]


class FreesHeadFirst(Allocator):
    def free(self, seq_id):
        for b in self.block_tables.pop(seq_id):
            self._drop(b)
        del self.num_tokens[seq_id]


class EagerBlock(Allocator):
    def append(self, seq_id):  # new block one token too early
        if (self.num_tokens[seq_id] + 1) % self.block_size == 0:
            self.block_tables[seq_id].append(self._take())
        self.num_tokens[seq_id] += 1
        return []


def test_allocator_accepts_correct_code(capsys):
    check.block_allocator(Allocator)
    assert "✓ block_allocator: matches the reference on 3 random cases" in capsys.readouterr().out


@pytest.mark.parametrize("cls, words", [
    (Leaks, "leaked"),
    (NoCopyOnWrite, "copy-on-write"),
    (ForkWithoutRef, "fork() must add one reference"),
    (FreesHeadFirst, "last block first"),
    (EagerBlock, "too few blocks"),
])
def test_allocator_names_the_mistake(cls, words):
    msg = failure(check.block_allocator, cls)
    assert words in msg, msg


def test_allocator_stub():
    class Stub(Allocator):
        def allocate(self, seq_id, num_tokens):
            raise NotImplementedError("ceil(num_tokens / block_size) blocks")

    with pytest.raises(NotImplementedYet, match="not implemented yet"):
        check.block_allocator(Stub)


# ----------------------------------------------------------------------- lab 04: slots, hashes


def slots(bt, s, e, bs):
    return [bt[p // bs] * bs + p % bs for p in range(s, e)]


def chained(tokens, bs):
    out, h = [], None
    for i in range(len(tokens) // bs):
        h = hash_block_tokens(h, tuple(tokens[i * bs:(i + 1) * bs]))
        out.append(h)
    return out


def test_slot_mapping_matches_block_manager_and_check(capsys):
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(8)))
    bm.allocate("b", [1, 2, 3])
    bm.append_slots("a", list(range(9)), 1)
    assert bm.slot_mapping("a", 0, 9) == slots(bm.get_block_table("a"), 0, 9, 4) == [0, 1, 2, 3, 4, 5, 6, 7, 12]
    check.slot_mapping(slots)
    assert "✓ slot_mapping" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (lambda bt, s, e, bs: [bt[p // bs] + p % bs for p in range(s, e)], "adds the block id and the offset"),
    (lambda bt, s, e, bs: [bt[min(p // bs + 1, len(bt) - 1)] * bs + p % bs for p in range(s, e)], "off by one block"),
    (lambda bt, s, e, bs: list(range(s, e)), "contiguous storage"),
])
def test_slot_mapping_names_the_mistake(fn, words):
    assert words in failure(check.slot_mapping, fn)


def test_block_hashes(capsys):
    check.block_hashes(chained)
    assert "✓ block_hashes" in capsys.readouterr().out
    flat = lambda t, bs: [hash_block_tokens(None, tuple(t[i * bs:(i + 1) * bs])) for i in range(len(t) // bs)]  # noqa: E731
    msg = failure(check.block_hashes, flat)
    assert "not chained" in msg and "false prefix-cache hit" in msg
    partial = lambda t, bs: chained(t, bs) + [hash_block_tokens(None, tuple(t[len(t) // bs * bs:]))]  # noqa: E731
    assert "only FULL blocks" in failure(check.block_hashes, partial)


# ----------------------------------------------------------------------- lab 05: checks


def test_schedule_step_reference_passes(capsys):
    check.schedule_step(reference_schedule_step)
    assert "✓ schedule_step" in capsys.readouterr().out


def no_budget(running, waiting, m, b):
    return reference_schedule_step(running, waiting, m, 10 ** 9)


def no_evict(running, waiting, m, b):
    out = reference_schedule_step([dict(r, decode_left=max(r["decode_left"], 1)) for r in running], waiting, m, b)
    return out


def over_admit(running, waiting, m, b):
    return reference_schedule_step(running, waiting, m + 5, b)


def mutates(running, waiting, m, b):
    out = reference_schedule_step(running, waiting, m, b)
    waiting.clear()
    return out


@pytest.mark.parametrize("fn, words", [
    (no_budget, "the budget is"),
    (no_evict, "evict running requests with decode_left == 0"),
    (over_admit, "max_num_seqs"),
    (mutates, "you changed the input"),
])
def test_schedule_step_names_the_mistake(fn, words):
    msg = failure(check.schedule_step, fn)
    assert words in msg, msg


def test_reference_step_agrees_with_the_real_scheduler():
    """The exercise's model of a step is the engine's: same tokens per request per step."""
    from minillm.engine.request import Request, SamplingParams
    from minillm.engine.scheduler import Scheduler

    workload = [(30, 3), (5, 6), (70, 2), (12, 4), (3, 5), (40, 2)]
    for max_seqs, budget in ((2, 16), (3, 32), (4, 8)):
        sched = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_seqs, budget)
        reqs = [Request(f"r{i}", list(range(3, 3 + p)), SamplingParams(max_tokens=o, ignore_eos=True))
                for i, (p, o) in enumerate(workload)]
        for r in reqs:
            sched.add(r)
        running, waiting = [], [{"id": f"r{i}", "prefill_left": p, "decode_left": o}
                                for i, (p, o) in enumerate(workload)]
        while sched.has_unfinished():
            out = sched.schedule()
            real = {s.request.request_id: s.num_new_tokens for s in out.seqs}
            ref = reference_schedule_step(running, waiting, max_seqs, budget)
            running, waiting = ref["running"], ref["waiting"]
            assert real == ref["scheduled"], (max_seqs, budget, real, ref["scheduled"])
            sched.advance(out)
            sched.append_tokens([(s.request, 5) for s in out.seqs if s.samples], 0.0)


def test_batch_steps():
    assert reference_batch_steps([20] * 7 + [500], 8, "static") == 500
    assert reference_batch_steps([20] * 7 + [500] + [20] * 168, 8, "continuous") == 500
    check.batch_steps(reference_batch_steps)
    msg = failure(check.batch_steps, lambda L, s, p: math.ceil(sum(L) / s))
    assert "ideal" in msg
    msg = failure(check.batch_steps, lambda L, s, p: reference_batch_steps(L, s, "static"))
    assert "freed slot is refilled" in msg
    with pytest.raises(NotImplementedYet):
        check.batch_steps(lambda L, s, p: (_ for _ in ()).throw(NotImplementedError("count")))


# ----------------------------------------------------------------------- released stubs


@pytest.mark.parametrize("name, ids", [
    ("04-paged-attention.ipynb", {"block_allocator", "slot_mapping", "block_hashes"}),
    ("05-continuous-batching.ipynb", {"batch_steps", "schedule_step"}),
])
def test_every_stub_reports_not_implemented(name, ids):
    import nbformat

    from quizzes.release import build_lab, tag_value

    lab = build_lab(nbformat.read(ROOT / "solutions" / name, as_version=4), name)
    cells = {tag_value(c, "exercise"): c.source for c in lab.cells if tag_value(c, "exercise")}
    assert set(cells) == ids
    ns = {"hash_block_tokens": hash_block_tokens}
    for src in cells.values():
        exec(src, ns)
    targets = {"block_allocator": "BlockAllocator"}
    for cid in ids:
        with pytest.raises(NotImplementedYet, match=f"✗ {cid}: not implemented yet"):
            getattr(check, cid)(ns[targets.get(cid, cid)])


# ----------------------------------------------------------------------- widgets


def test_simulator_reproduces_calc():
    from widgets import batching

    lens = [50] * 7 + [500]
    st = batching.simulate([(1, n) for n in lens], policy="static", max_num_seqs=8)
    assert len(st.steps) == 500
    assert st.throughput == pytest.approx(calc.static_batch_throughput(lens, 0.010))
    assert st.utilization == pytest.approx(calc.static_batch_utilization(lens))
    full = batching.simulate([(1, 20)] * 7 + [(1, 500)] + [(1, 20)] * 168, max_num_seqs=8)
    assert len(full.steps) == 500 and full.utilization == pytest.approx(1.0)
    assert full.throughput == pytest.approx(calc.continuous_batch_ideal_throughput(8, 0.010))
    assert full.total_output_tokens == 7 * 20 + 500 + 168 * 20


def test_batching_view_reacts_to_sliders():
    from widgets import batching

    v = batching.view(num_requests=8)
    assert v.error is None and v.renders == 1 and "minillm-batching" in v.box._dom_classes
    assert v.data.continuous.throughput >= v.data.static.throughput
    v.controls["max_num_seqs"].value = 2
    assert v.data.max_num_seqs == 2 and v.renders == 2
    assert max(len(s.slots) for s in v.data.continuous.steps) <= 2
    v.controls["arrival_rate"].value = 1.0
    v.controls["max_num_batched_tokens"].value = 64
    assert v.data.arrival_rate == 1.0 and v.data.max_num_batched_tokens == 64
    assert max(s.num_batched_tokens for s in v.data.continuous.steps) <= 64
    assert v.png.startswith(b"\x89PNG")


def test_latency_vs_load_follows_mm1():
    from widgets import batching

    d = batching.latency_vs_load_data(rhos=(0.2, 0.5), num_requests=300)
    for p in d.points:
        assert p.mm1_mean_s == pytest.approx(calc.mm1_mean_latency(p.arrival_rate, d.service_rate))
        assert p.measured_mean_s == pytest.approx(p.mm1_mean_s, rel=0.35)
    assert d.points[1].measured_mean_s > d.points[0].measured_mean_s
    assert batching.draw_latency_vs_load(d).axes


def test_block_pool_against_block_manager():
    from widgets import block_pool_grid as g

    run = g.run_pool(64, 12)
    assert run.contiguous_max_running == 64 * 16 // 512
    for s in run.paged.steps:
        owners = [o for o in s.block_owner if o >= 0]
        assert len(owners) == s.num_used_blocks  # the recorded grid is the BlockManager's pool
        assert sum(s.block_fill) == s.num_kv_tokens
    assert run.paged_waste < 0.06 < 0.4 < run.contiguous_waste
    d = g.block_pool_data(5, 64, 12)
    assert d.owner.shape == (64,) and "paged wastes" in d.summary[1]


def test_fragmentation_gauge_and_its_alert():
    from widgets import block_pool_grid as g

    run = g.run_pool(64, 12)
    frag = g.fragmentation_series(run)
    held = [s for s in run.paged.steps if s.num_used_blocks]
    assert len(frag) == len(held)
    for f, s in zip(frag, held):  # against the grid the BlockManager recorded, block by block
        assert f == pytest.approx(1 - sum(s.block_fill) / (len(s.block_fill) - s.block_owner.count(-1)) / 16)
        assert 0 <= f < 1
    # the predict-then-measure formula of lab04.q9: 7.5 empty slots per sequence on average
    big = g.run_pool(256)
    mean_held = sum(s.num_kv_tokens for s in big.paged.steps) / sum(len(s.slots) for s in big.paged.steps)
    assert 7.5 / (mean_held + 7.5) == pytest.approx(big.paged_waste, rel=0.2)
    # a rule "above 10% for 3 steps" fires on the third step of a run, never on a spike
    series = [0.05, 0.2, 0.05, 0.2, 0.3, 0.4, 0.5, 0.05]
    assert g.first_alert(series, 0.10, 3) == 5
    assert g.first_alert(series, 0.10, 5) is None
    assert g.first_alert(series, 0.10, 1) == 1
    assert g.first_alert([0.1, 0.1, 0.1], 0.10, 2) is None  # strictly above the threshold
    with pytest.raises(ValueError, match="for_steps"):
        g.first_alert(series, 0.1, 0)


def test_block_pool_view_reacts_to_its_controls():
    from widgets import block_pool_grid as g

    v = g.BlockPoolView(step=3, num_blocks=64, num_requests=12, pool_sizes=(64, 128))
    assert v.data.step == 3 and "minillm-block-pool" in v.box._dom_classes
    v.controls["step"].value = 10
    assert v.data.step == 10 and v.renders == 2
    v.controls["num_blocks"].value = 128
    assert v.data.run.num_blocks == 128
    assert v.controls["step"].max == len(g.run_pool(128, 12).paged.steps) - 1


# ----------------------------------------------------------------------- banks


@pytest.mark.parametrize("lab", ["lab04", "lab05"])
def test_bank_accepts_its_computed_answers(lab):
    bank = load_bank(lab)
    assert len(bank.questions) >= 8
    for qid, q in bank.questions.items():
        m = getattr(q, "example_measured", None) or None
        got = expected(f"{lab}.{qid}", m)
        assert answer(f"{lab}.{qid}", got if isinstance(got, str) else f"{got}", m).correct, qid


def test_bank_numbers_are_the_books():
    assert expected("lab04.q1") == 64 and expected("lab04.q4") == 119 and expected("lab04.q5") == 953
    n = {"mean_tokens_held": 222.9}
    assert expected("lab04.q2", n) == pytest.approx(297.2, abs=0.1)
    assert expected("lab04.q3", n) == pytest.approx(100 * 15.5 / 238.4)
    assert expected("lab04.q8", n) == pytest.approx(4096 / 230.4)
    assert expected("lab04.q10") == pytest.approx(100 * 12 / 112)
    assert expected("lab05.q1") == 2590
    assert expected("lab05.q2") == pytest.approx(1600 / 6)
    assert expected("lab05.q3") == pytest.approx(2 / 3)
    assert expected("lab05.q4") == pytest.approx(3.0)
    assert expected("lab05.q5") == pytest.approx(7.5)
    assert expected("lab05.q6") == pytest.approx(0.5 + 249 * 0.04)


def test_paged_predictions_hold_on_the_lab_workload():
    """lab04.q9 and q11: the formulas the lab asks for, from the mean tokens held, land within
    the questions' tolerances of what the BlockManager measures."""
    from widgets import block_pool_grid as g

    run, wide = g.run_pool(256), g.run_pool(256, max_len=1024)
    held = sum(s.num_kv_tokens for s in run.paged.steps) / sum(len(s.slots) for s in run.paged.steps)
    for qid, predicted, m in (
            ("q9", 100 * 7.5 / (held + 7.5), {"paged_waste_pct": 100 * run.paged_waste}),
            ("q11", 100 * (1 - held / 1024), {"contiguous1024_waste_pct": 100 * wide.contiguous_waste})):
        assert answer(f"lab04.{qid}", f"{predicted}%", m).correct, (qid, predicted, m)


def test_mm1_prediction_holds_on_the_lab_scheduler():
    """lab05.q10: W = (1 / μ) / (1 − ρ) at ρ = 0.9, from the light-load run's service rate, is
    within 20% of the scheduler's measured mean latency (simulated clock: deterministic)."""
    from widgets import batching

    light = batching.latency_vs_load_data(rhos=(0.1,), num_requests=2000)
    load = batching.latency_vs_load_data(rhos=(0.1, 0.3, 0.5, 0.7, 0.8, 0.9), num_requests=2000)
    predicted = 1e3 / light.service_rate / (1 - 0.9)
    m = {"latency_rho09_ms": load.points[-1].measured_mean_s * 1e3}
    assert answer("lab05.q10", f"{predicted} ms", m).correct, (predicted, m)


def test_predicted_engine_steps_equal_the_engines():
    """lab05.q9: the student's batch_steps predicts the real engine's step count exactly when
    the budget fits every prompt in one chunk."""
    import torch

    from minillm import LlamaModel, ModelConfig
    from quizzes.checks.lab05 import reference_batch_steps
    from widgets import batching

    torch.manual_seed(0)
    tiny = LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()
    work = batching.tiny_workload(10)
    run = batching.run_engine(tiny, work, "continuous", max_num_seqs=4)
    assert run["steps"] == reference_batch_steps([n for _, n in work], 4, "continuous")
    assert answer("lab05.q9", f"{run['steps']}", {"engine_steps_continuous": run["steps"]}).correct
    # the way a student writes it, and the way the solution's predict cell does
    assert answer("lab05.q9", f"{run['steps']} steps", {"engine_steps_continuous": run["steps"]}).correct
