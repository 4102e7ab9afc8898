"""Pinned Triton tile configs (minillm/kernels/tuning.py, configs/sm_XY.json).

The lookup, the opt-in search and its guard against graph capture, the fallbacks, and the
pinned files themselves: every bucket of every kernel pinned for sm_80 and sm_90, and (in a
subprocess, with Triton's bundled ptxas) every pinned config compiled ahead of time within
the architecture's shared memory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton

from minillm.kernels import tuning

ROOT = Path(__file__).resolve().parents[1]


def _toy(name="toy"):
    fast = triton.Config({"BLOCK_N": 32}, num_warps=2, num_stages=2)
    slow = triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2)
    default = triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=2)
    return tuning.Tunable(name=name, fn=None, configs=(slow, fast), default=default,
                          interpreter=triton.Config({"BLOCK_N": 8}, num_warps=1, num_stages=1),
                          bucket_space={"D": (64, 128), "dt": (16, 32)}, signature={},
                          constexprs=lambda b: {}), fast, slow, default


@pytest.fixture
def compiled_branch(monkeypatch):
    """Make tuning take its GPU branch on this CPU (sm_90), and restore its state after."""
    monkeypatch.setattr(tuning, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(tuning, "device_arch", lambda device=None: 90)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    saved = dict(tuning._measured), dict(tuning._fell_back), dict(tuning._resolved)
    tuning._measured.clear()
    tuning._fell_back.clear()
    monkeypatch.setattr(tuning, "_ready", {})  # resolved under other tests' patched tables
    yield
    tuning.set_autotune(None)
    tuning._measured.clear()
    tuning._measured.update(saved[0])
    tuning._fell_back.clear()
    tuning._fell_back.update(saved[1])
    tuning._resolved.clear()
    tuning._resolved.update(saved[2])


def test_bucket_keys_round_trip_and_sort():
    key = tuning.bucket_key({"lse": True, "D": 64, "H": 16})
    assert key == "D=64,H=16,lse=1"
    assert tuning.parse_bucket_key(key) == {"D": 64, "H": 16, "lse": 1}
    assert tuning.dtype_bits(torch.bfloat16) == 16 and tuning.dtype_bits(torch.float32) == 32


@pytest.mark.parametrize("arch,expected", [(90, 90), (80, 80), (86, 80), (89, 80), (100, 90),
                                           (120, 90), (75, None), (70, None)])
def test_an_architecture_without_a_file_uses_the_nearest_older_one(arch, expected):
    assert tuning.file_arch(arch) == expected


def test_the_interpreter_always_runs_its_own_config(monkeypatch):
    toy, *_ = _toy()
    monkeypatch.setattr(tuning, "interpreter_enabled", lambda: True)
    launched = []
    toy.run({"D": 64, "dt": 32}, launched.append)
    assert launched == [toy.interpreter]


def test_a_call_launches_the_pinned_config_once_and_times_nothing(compiled_branch, monkeypatch):
    toy, fast, slow, _ = _toy()
    monkeypatch.setattr(tuning, "pinned_table", lambda arch: {"toy": {
        "D=64,dt=16": {**tuning.config_to_dict(slow), "source": "measured: a test"}}})
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: pytest.fail("timed"))
    tuning.set_autotune(False)
    launched = []
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert [tuning.config_to_dict(c) for c in launched] == [tuning.config_to_dict(slow)]
    launched.clear()
    toy.run({"D": 128, "dt": 16}, launched.append)  # not pinned: the default
    assert launched == [toy.default]


def test_autotuning_times_every_candidate_keeps_the_fastest_and_saves_it(
        compiled_branch, monkeypatch, tmp_path):
    toy, fast, slow, _ = _toy()
    timed = []

    def fake_bench(fn, **kwargs):
        fn()
        cfg = launched[-1]
        timed.append(cfg)
        return {32: 1.0, 64: 2.0}[cfg.kwargs["BLOCK_N"]] * 1e-3

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    tuning.set_autotune(True)
    launched = []
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert set(timed) == {fast, slow}          # every candidate timed once ...
    assert launched[-1] is fast                # ... then the fastest launched
    n = len(launched)
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert launched[n:] == [fast]              # the bucket is searched once per process
    [row] = [r for r in tuning.measured() if r["kernel"] == "toy"]
    assert row["bucket"] == "D=64,dt=16" and row["arch"] == 90 and row["BLOCK_N"] == 32
    path = tmp_path / "sm_90.json"
    assert tuning.save_measured("a test GPU, 2026-11-26", path) == [path]
    entry = json.loads(path.read_text())["kernels"]["toy"]["D=64,dt=16"]
    assert entry["source"] == "measured: a test GPU, 2026-11-26" and entry["BLOCK_N"] == 32


def test_a_kernel_timed_by_its_own_benchmark_is_never_searched_but_keeps_its_measurement(
        compiled_branch, monkeypatch, tmp_path):
    """``searchable=False`` (the decode GEMV, timed from CUDA graphs by gpu_check's
    gemv_tiles): MINILLM_AUTOTUNE times nothing; what `record_measured` keeps is launched
    from then on, reported by `measured` and saved like a search's."""
    from dataclasses import replace

    toy, fast, slow, _ = _toy("toy_own_bench")
    toy = replace(toy, searchable=False)
    monkeypatch.setitem(tuning._registry, toy.name, toy)  # pinned nowhere: the default
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: pytest.fail("timed"))
    tuning.set_autotune(True)
    launched = []
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert launched == [toy.default]
    tuning.record_measured(toy.name, 90, {"D": 64, "dt": 16}, fast, 3.25)
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert launched[-1] is fast  # the bucket resolved before is resolved again
    assert toy.config_on({"D": 64, "dt": 16}, 90) is fast
    assert toy.config_on({"D": 64, "dt": 16}, 80) == toy.default  # another architecture
    [row] = [r for r in tuning.measured() if r["kernel"] == toy.name]
    assert row["bucket"] == "D=64,dt=16" and row["us"] == 3.25 and row["BLOCK_N"] == 32
    path = tmp_path / "sm_90.json"
    tuning.save_measured("a test GPU", path)
    assert json.loads(path.read_text())["kernels"][toy.name]["D=64,dt=16"]["BLOCK_N"] == 32
    with pytest.raises(ValueError, match="outside the kernel's bucket space"):
        tuning.record_measured(toy.name, 90, {"D": 96, "dt": 16}, fast, 1.0)


def test_trying_a_candidate_launches_it_in_the_block_and_puts_back_what_was_there(
        compiled_branch, monkeypatch):
    """`tuning.trying` (gpu_check's w4a16_tiles times candidates through the kernel's own
    wrapper): inside the block the bucket launches the candidate, and afterwards the
    pinned config, or what a measurement had kept, launches again."""
    from dataclasses import replace

    toy, fast, slow, _ = _toy("toy_trying")
    toy = replace(toy, searchable=False)
    monkeypatch.setitem(tuning._registry, toy.name, toy)
    bucket, launched = {"D": 64, "dt": 16}, []
    toy.run(bucket, launched.append)
    with tuning.trying(toy.name, 90, bucket, slow):
        toy.run(bucket, launched.append)
        assert toy.config_on(bucket, 90) is slow and toy.config_on(bucket, 80) == toy.default
    toy.run(bucket, launched.append)
    assert launched == [toy.default, slow, toy.default]
    assert not [r for r in tuning.measured() if r["kernel"] == toy.name]  # nothing kept
    tuning.record_measured(toy.name, 90, bucket, fast, 2.0)
    with pytest.raises(RuntimeError, match="broken"), tuning.trying(toy.name, 90, bucket, slow):
        toy.run(bucket, launched.append)
        raise RuntimeError("broken")
    toy.run(bucket, launched.append)
    assert launched[-2:] == [slow, fast]  # the measurement is back, an error or not
    [row] = [r for r in tuning.measured() if r["kernel"] == toy.name]
    assert row["us"] == 2.0


def test_a_bucket_is_resolved_once_until_something_changes_the_answer(compiled_branch,
                                                                        monkeypatch):
    """The second call of a bucket launches what the first resolved, without resolving it
    again (an eager decode step launches ~150 kernels); turning autotuning on, or loading
    measured configs, makes the next call resolve (and search) again."""
    toy, fast, slow, default = _toy()
    resolved = []
    real = tuning.Tunable.config_for
    monkeypatch.setattr(tuning.Tunable, "config_for",
                        lambda self, b, d=None: resolved.append(b) or real(self, b, d))
    tuning.set_autotune(False)
    launched = []
    for _ in range(3):
        toy.run({"D": 64, "dt": 16}, launched.append, "cuda:0")
    assert launched == [default] * 3 and len(resolved) == 1
    toy.run({"D": 64, "dt": 32}, launched.append, "cuda:0")  # another bucket: its own answer
    assert len(resolved) == 2

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: (
        fn(), {32: 1.0, 64: 2.0}[launched[-1].kwargs["BLOCK_N"]] * 1e-3)[1])
    tuning.set_autotune(True)
    toy.run({"D": 64, "dt": 16}, launched.append, "cuda:0")
    assert launched[-1] is fast and len(resolved) == 3  # searched, then resolved
    toy.run({"D": 64, "dt": 16}, launched.append, "cuda:0")
    assert launched[-1] is fast and len(resolved) == 3


def test_a_search_asked_for_during_a_capture_runs_at_the_next_call(compiled_branch,
                                                                    monkeypatch):
    toy, fast, slow, default = _toy()
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    launched = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: (
        fn(), {32: 1.0, 64: 2.0}[launched[-1].kwargs["BLOCK_N"]] * 1e-3)[1])
    tuning.set_autotune(True)
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert launched == [default]  # no timing inside a capture: the pinned (here default)
    capturing[0] = False
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert launched[-1] is fast  # not the remembered default: the search ran now


def test_no_search_while_a_cuda_graph_is_being_captured(compiled_branch, monkeypatch):
    toy, *_ = _toy()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: pytest.fail("timed"))
    tuning.set_autotune(True)
    launched = []
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert launched == [toy.default]


def test_a_pinned_config_that_does_not_fit_falls_back_to_the_default(compiled_branch,
                                                                      monkeypatch):
    toy, fast, slow, default = _toy()
    monkeypatch.setattr(tuning, "pinned_table", lambda arch: {"toy": {
        "D=128,dt=32": tuning.config_to_dict(slow)}})
    tuning.set_autotune(False)

    def launch(cfg):
        if cfg.kwargs["BLOCK_N"] > 16:
            raise triton.runtime.errors.OutOfResources(1 << 18, 1 << 17, "shared memory")
        launched.append(cfg)

    launched = []
    with pytest.warns(RuntimeWarning, match="does not fit this GPU"):
        toy.run({"D": 128, "dt": 32}, launch)
    assert launched == [default]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, then the default straight away
        toy.run({"D": 128, "dt": 32}, launch)
    assert launched == [default, default]


def test_when_the_default_does_not_fit_either_the_smallest_candidate_that_fits_runs(
        compiled_branch, monkeypatch):
    # An sm_86 reads sm_80's file with 60% of its shared memory: for a large head dim both
    # the pinned tiles and the default may be too big, while a smaller candidate fits.
    toy, fast, slow, default = _toy()
    tiny = triton.Config({"BLOCK_N": 8}, num_warps=2, num_stages=2)
    toy = dataclasses.replace(toy, configs=(slow, fast, tiny))
    monkeypatch.setattr(tuning, "pinned_table", lambda arch: {"toy": {
        "D=128,dt=32": tuning.config_to_dict(slow)}})
    tuning.set_autotune(False)
    tried = []

    def launch(cfg):
        tried.append(cfg.kwargs["BLOCK_N"])
        if cfg.kwargs["BLOCK_N"] > 8:
            raise triton.runtime.errors.OutOfResources(1 << 18, 1 << 17, "shared memory")

    with pytest.warns(RuntimeWarning, match="using {'BLOCK_N': 8"):
        toy.run({"D": 128, "dt": 32}, launch)
    assert tried == [64, 16, 8]  # pinned, default, then the smallest first
    assert tuning._resolved[("toy", "D=128,dt=32")] is tiny  # a compiled trace takes it too
    tried.clear()
    toy.run({"D": 128, "dt": 32}, launch)
    assert tried == [8]
    with pytest.raises(RuntimeError, match="no candidate tile fits this GPU"):
        toy.run({"D": 64, "dt": 16}, lambda cfg: (_ for _ in ()).throw(
            triton.runtime.errors.OutOfResources(1 << 18, 1 << 17, "shared memory")))


def test_an_unsupported_bucket_and_a_bucket_outside_the_space_say_why(compiled_branch,
                                                                       monkeypatch):
    toy, *_ = _toy()
    monkeypatch.setattr(tuning, "pinned_table", lambda arch: {"toy": {
        "D=128,dt=32": {"unsupported": "no candidate fits"}}})
    with pytest.raises(ValueError, match="does not fit a sm_90 GPU: no candidate fits"):
        toy.run({"D": 128, "dt": 32}, lambda cfg: None)
    with pytest.raises(ValueError, match="outside the kernel's bucket space"):
        toy.run({"D": 256, "dt": 32}, lambda cfg: None)


@pytest.mark.parametrize("arch", tuning.PINNED_ARCHS)
def test_the_pinned_file_covers_every_bucket_of_every_kernel(arch):
    table = json.loads(tuning.config_path(arch).read_text())
    assert table["arch"] == f"sm_{arch}"
    kernels = tuning.tunables()
    assert {"flash_attention", "paged_decode"} <= set(kernels)
    for name, t in kernels.items():
        allowed = [tuning.config_to_dict(c) for c in (*t.configs, t.default)]
        for bucket in t.buckets():
            entry = table["kernels"].get(name, {}).get(tuning.bucket_key(bucket))
            assert entry is not None, f"sm_{arch} {name} {tuning.bucket_key(bucket)} not pinned"
            assert "source" in entry or "unsupported" in entry, entry
            if "unsupported" not in entry:
                assert tuning.config_to_dict(tuning.config_from_dict(entry)) in allowed, entry


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compiles ahead of time on a CPU machine")
def test_every_pinned_config_compiles_for_its_architecture():
    """The sweep: each pinned config compiled for sm_80 and sm_90 with Triton's bundled ptxas
    (benchmarks/pin_configs.py --check), within the architecture's shared memory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "benchmarks/pin_configs.py", "--check"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 problem(s)" in res.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compiles ahead of time on a CPU machine")
def test_the_check_compiles_what_a_launch_compiles():
    """Aligned pointers, sizes that are multiples of 16 and unit innermost strides, as a
    launch specializes them: only then are the loads pipelined, and the shared memory is a
    launch's. Without them SmolLM2's varlen tile measured 16,384 bytes; launched, 73,728."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import pin_configs as pc\n"
            "t = pc.tuning.tunables()['flash_attention']\n"
            "b = dict(D=64, L=1, causal=1, varlen=1, dt=16)\n"
            "cfg = pc.tuning.triton.Config({'BLOCK_M': 64, 'BLOCK_N': 64}, num_warps=4, "
            "num_stages=4)\n"
            "print(pc.shared_bytes(t, b, cfg, 90))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.split()[-1]) > 50_000


def test_the_lookup_traces_under_torch_compile_without_a_graph_break(monkeypatch):
    """torch.compile traces a kernel's launch (Inductor compiles user Triton kernels into
    its graph): the config lookup must be plain Python that Dynamo follows, with no file
    reads, no timing and no graph break (fullgraph=True fails on one)."""
    toy, fast, *_ = _toy("toy_traced")
    monkeypatch.setattr(tuning, "pinned_table", lambda arch: {"toy_traced": {
        "D=64,dt=32": tuning.config_to_dict(fast)}})
    monkeypatch.setattr(tuning, "_resolved", {})
    tuning.resolve_for_tracing(toy, 90)

    def step(x):
        out = torch.empty_like(x)
        toy.run({"D": 64, "dt": 32}, lambda cfg: out.copy_(x * cfg.kwargs["BLOCK_N"]))
        return out

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 32.0))
    with pytest.raises(Exception, match="outside the kernel's bucket space"):
        torch.compile(lambda x: toy.run({"D": 256, "dt": 32}, lambda cfg: x),
                      fullgraph=True, backend="eager")(torch.ones(1))


def test_configs_measured_by_an_earlier_run_are_used_first(compiled_branch, monkeypatch,
                                                             tmp_path):
    toy, fast, slow, _ = _toy("toy_loaded")
    monkeypatch.setattr(tuning, "pinned_table", lambda arch: {"toy_loaded": {
        "D=64,dt=16": tuning.config_to_dict(slow)}})
    path = tmp_path / "gpu.tuned.json"
    path.write_text(json.dumps({"source": "a test GPU", "measured": [
        {"kernel": "toy_loaded", "arch": 90, "bucket": "D=64,dt=16", "us": 3.5,
         **tuning.config_to_dict(fast)}]}))
    assert tuning.load_measured(path) == 1
    tuning.set_autotune(False)
    launched = []
    toy.run({"D": 64, "dt": 16}, launched.append)
    assert [tuning.config_to_dict(c) for c in launched] == [tuning.config_to_dict(fast)]


@pytest.mark.parametrize("value,expected", [("0", (False, False)), ("1", (True, True)),
                                            ("toy_a", (True, False)),
                                            ("toy_b, toy_a", (True, False))])
def test_minillm_autotune_names_the_kernels_to_search(monkeypatch, value, expected):
    monkeypatch.setattr(tuning, "_autotune_override", None)
    monkeypatch.setenv("MINILLM_AUTOTUNE", value)
    assert (tuning.autotune_enabled("toy_a"), tuning.autotune_enabled("toy_c")) == expected


def test_a_bucket_nothing_measured_takes_the_nearest_class_not_the_first():
    """Tunable.distance counts steps in the ordered bucket space: a long-sequence bucket is
    nearer the next-shorter class than the shortest (counting differing classes alone tied
    them, and FlashAttention at T >= 4,096 got T <= 256's tiles on the H100)."""
    t = tuning.tunables()["flash_attention"]
    long = {"D": 64, "L": 2, "causal": 1, "dt": 16, "varlen": 0}
    short, mid = {**long, "L": 0}, {**long, "L": 1}
    assert t.distance(long, mid) < t.distance(long, short)
    assert t.distance(long, {**mid, "causal": 0}) == t.distance(long, short)  # one step each
    assert t.distance(long, {**long, "dt": 32}) > t.distance(long, short)  # dtype width first
    assert t.distance(long, {**long, "D": 128}) > t.distance(long, short)  # then head dim


def test_sm90_carries_each_unmeasured_bucket_from_a_nearest_measured_one():
    """Where sm_90's pinned entry was carried from a measured bucket of its own dtype width
    and head dim (``pin_configs.py --fill``), no other such measured bucket is nearer. (Those
    were measured on sm_90 at the same tile sizes, so none was passed over for not fitting;
    a config carried across dtype or head dim may have been, for its shared memory.)"""
    arch = 90
    table = json.loads(tuning.config_path(arch).read_text())
    checked = 0
    for name, t in tuning.tunables().items():
        entries = table["kernels"].get(name, {})
        measured = [tuning.parse_bucket_key(k) for k, e in entries.items()
                    if e.get("source", "").startswith("measured")]
        for key, entry in entries.items():
            source = entry.get("source", "")
            if not source.startswith("nearest measured: "):
                continue
            bucket = tuning.parse_bucket_key(key)
            alike = [m for m in measured
                     if (m.get("dt"), m.get("D")) == (bucket.get("dt"), bucket.get("D"))]
            if not alike:
                continue
            chosen = t.distance(bucket, tuning.parse_bucket_key(source.split(": ", 1)[1]))
            best = min(t.distance(bucket, m) for m in alike)
            assert chosen == best, f"sm_{arch} {name} {key}: {source}, but one at {best} exists"
            checked += 1
    assert checked >= 10  # FlashAttention's carried D = 64 buckets, at least
