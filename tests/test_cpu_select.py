"""minillm.cpu_select: which build of each C++ CPU kernel runs which shapes. The decision
rule on made-up timings; only builds the CPU runs are offered (mocked CPU flags); a forced
choice (MINILLM_CPU_KERNEL=blas or a named build) is what runs; a cached selection is reused
only by the CPU it was measured on; a noisy measurement is not trusted; `python -m minillm
info` prints the selection. Nothing here times anything: the timer is a fake.
"""
from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from minillm import __main__ as cli, cpp_extension, cpu_select
from minillm.attention import cpu_decode
from minillm.layers import Linear, cpu_linear
from minillm.quant import cpu_kernels

HOST = cpp_extension.host_isas()


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Each test: its own cache folder and no selection remembered from another test."""
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path))
    cpu_select.reset()
    yield
    cpu_select.reset()


def fake_timer(speed: dict[str, float], calls: list | None = None):
    """A timer that runs nothing: variant v takes speed.get(v, 1.0) seconds in each of 5
    rounds (exactly, so the measurement is not noisy). `calls` collects the variants
    offered, per bucket."""
    def timer(makers):
        if calls is not None:
            calls.append(sorted(makers))
        return {v: [speed.get(v, 1.0)] * 5 for v in makers}
    return timer


def group(variants=("avx512bf16", "avx2", "avx512")):
    return cpu_select.Group("k", "float32 K<1024", cpu_select.ROW_BUCKETS, variants, "blas",
                            lambda v, b: None)


def times(per_bucket):
    return {b: dict(per_bucket[b]) for b in cpu_select.ROW_BUCKETS}


# ---------------------------------------------------------------------------- the rule

def test_row_buckets():
    assert [cpu_select.row_bucket(m) for m in (1, 2, 4, 5, 8, 9, 16)] == \
        ["1", "2-4", "2-4", "5-8", "5-8", "9-16", "9-16"]
    with pytest.raises(ValueError, match="rows must be 1 to 16"):
        cpu_select.row_bucket(17)


def test_ties_keep_the_default_build_and_one_build_serves_the_group():
    g = group()
    # avx2 is 3% faster than the default over the buckets: within MARGIN, the default stays.
    t = times({b: {"avx512bf16": 1.0, "avx2": 0.97, "avx512": 1.2, "blas": 2.0}
               for b in cpu_select.ROW_BUCKETS})
    assert set(cpu_select.decide(g, t).values()) == {"avx512bf16"}
    # avx2 20% faster in every bucket: it serves them all.
    t = times({b: {"avx512bf16": 1.0, "avx2": 0.8, "avx512": 1.2, "blas": 2.0}
               for b in cpu_select.ROW_BUCKETS})
    assert set(cpu_select.decide(g, t).values()) == {"avx2"}
    # avx512 fastest in one bucket only, avx2 over all: one build (batch invariance), avx2.
    t["9-16"]["avx512"] = 0.5
    assert set(cpu_select.decide(g, t).values()) == {"avx2"}


def test_blas_takes_a_bucket_only_when_clearly_faster():
    g = group()
    t = times({b: {"avx512bf16": 1.0, "avx2": 1.1, "avx512": 1.1, "blas": 2.0}
               for b in cpu_select.ROW_BUCKETS})
    t["5-8"]["blas"] = 0.98  # 2% faster: noise, the kernel stays
    t["9-16"]["blas"] = 0.7  # 30% faster: BLAS
    assert cpu_select.decide(g, t) == {"1": "avx512bf16", "2-4": "avx512bf16",
                                       "5-8": "avx512bf16", "9-16": "blas"}


def test_a_build_that_is_not_available_is_not_chosen():
    g = group()
    t = times({b: {"avx512bf16": 1.0, "avx2": 1.1, "blas": 2.0} for b in cpu_select.ROW_BUCKETS})
    assert set(cpu_select.decide(g, t).values()) == {"avx512bf16"}  # no avx512 timings
    t = times({b: {"blas": 2.0} for b in cpu_select.ROW_BUCKETS})
    assert set(cpu_select.decide(g, t).values()) == {"blas"}  # no build at all


def test_forced_build_is_the_widest_not_wider():
    assert cpu_select.forced_variant(("avx512bf16", "avx2", "avx512"), "avx512") == "avx512"
    assert cpu_select.forced_variant(("avx512", "avx2"), "avx512bf16") == "avx512"
    assert cpu_select.forced_variant(("avx2",), "avx512bf16") == "avx2"
    assert cpu_select.forced_variant(("avx512", "avx2"), "avx2") == "avx2"


# ---------------------------------------------------------------------------- host support

@pytest.mark.parametrize("capability, flags, want", [
    ("AVX512", {"avx512_bf16", "avx2"}, ("avx2", "avx512", "avx512bf16")),  # Zen 4, Zen 5
    ("AVX512", {"avx2"}, ("avx2", "avx512")),  # Skylake-SP: AVX-512 without bf16
    ("AVX2", {"avx2", "avx512_bf16"}, ("avx2",)),  # PyTorch found no AVX-512: flags alone do not count
    ("DEFAULT", set(), ()),  # no AVX2: generic builds only
])
def test_host_isas_follow_the_cpu(capability, flags, want):
    assert cpp_extension.host_isas(capability, flags) == want


@pytest.mark.parametrize("isas", [("avx2",), ("avx2", "avx512"), ()])
def test_only_builds_the_cpu_runs_are_offered_and_chosen(monkeypatch, isas):
    # A fake CPU with fewer ISAs than any build: the measurement is offered only its
    # builds, and chooses among them even where a missing build would have been fastest.
    monkeypatch.setattr(cpp_extension, "host_isas", lambda *a: isas)
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "1")
    offered = []
    sel = cpu_select.select(timer=fake_timer({"avx512bf16": 0.1, "avx512": 0.2}, offered))
    allowed = set(isas or ("generic",)) | {"blas", "gather", "sdpa"}
    assert offered and all(set(o) <= allowed for o in offered)
    assert set(sel.choices.values()) <= allowed
    assert {k.split("/")[0] for k in sel.choices} == {"small_m_linear", "quant_linear",
                                                      "paged_decode"}
    for g in cpu_select.groups(isas):
        assert set(g.variants) <= set(isas or ("generic",))
        assert g.variants[0] == cpp_extension.default_isa(
            avx512_bf16=g.kernel == "small_m_linear", avx512=g.kernel == "quant_linear",
            isas=isas)


def test_a_forced_build_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(cpp_extension, "host_isas", lambda *a: ("avx2",))
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "avx512")
    with pytest.raises(ValueError, match=r"cannot run avx512 builds \(it runs avx2\)"):
        cpu_select.current()


def test_a_bad_setting_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "fast")
    with pytest.raises(ValueError, match="'fast' is not a setting: use 1 .* avx512bf16"):
        cpp_extension.setting()


def plain_setting() -> str:
    """The reference: MINILLM_CPU_KERNEL read and parsed afresh, nothing remembered."""
    text = os.environ.get(cpp_extension.ENV, "1").strip().lower() or "1"
    if text not in cpp_extension._SETTINGS:
        raise ValueError(text)
    return cpp_extension._SETTINGS[text]


def test_the_setting_follows_every_change_of_the_variable(monkeypatch):
    # `setting` remembers each raw value it parsed: every change, however it is made, must
    # still be seen on the next call (the same value twice, then another, then back).
    values = ["default", "0", "default", " AVX2 ", "blas", "", "1", "auto", "default"]
    for i, value in enumerate(values):
        if i % 3 == 0:
            monkeypatch.setenv(cpp_extension.ENV, value)
        elif i % 3 == 1:
            os.environ[cpp_extension.ENV] = value  # monkeypatch restores it at the end
        else:
            with mock.patch.dict(os.environ, {cpp_extension.ENV: value}):
                assert cpp_extension.setting() == plain_setting(), value
            assert cpp_extension.setting() == plain_setting(), f"after {value!r}"
        assert cpp_extension.setting() == plain_setting(), value
        assert cpp_extension.enabled() == (plain_setting() != "blas"), value
    monkeypatch.delenv(cpp_extension.ENV)
    assert cpp_extension.setting() == "auto"
    monkeypatch.setenv(cpp_extension.ENV, "fast")  # a bad value raises every time
    for _ in range(2):
        with pytest.raises(ValueError, match="'fast' is not a setting"):
            cpp_extension.setting()


def test_the_setting_is_read_without_os_environs_backing_dict(monkeypatch):
    # Where os.environ has no `_data` (another Python), `setting` reads os.environ.get.
    monkeypatch.setattr(os, "environ", {cpp_extension.ENV: "0"})
    assert cpp_extension.setting() == "blas"
    os.environ[cpp_extension.ENV] = "Default"
    assert cpp_extension.setting() == "default"
    del os.environ[cpp_extension.ENV]
    assert cpp_extension.setting() == "auto"


def test_a_remembered_choice_follows_the_setting(monkeypatch):
    lin, x = linear_and_x(1)
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "default")
    assert cpu_linear.kernel_for(x, lin.weight).isa == cpu_linear.default_variant()
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "0")
    assert cpu_linear.kernel_for(x, lin.weight) is None
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "default")
    assert cpu_linear.kernel_for(x, lin.weight).isa == cpu_linear.default_variant()


# ---------------------------------------------------------------------------- forcing

def linear_and_x(rows=3, k=576, dtype=torch.float32):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(k, 96).to(dtype).requires_grad_(False)
    return lin, torch.randn(rows, k, generator=g).to(dtype)


@pytest.mark.parametrize("setting", ["0", "blas"])
def test_blas_forced_runs_f_linear_everywhere(monkeypatch, setting):
    monkeypatch.setenv("MINILLM_CPU_KERNEL", setting)
    lin, x = linear_and_x()
    assert cpu_linear.kernel_for(x, lin.weight) is None
    assert cpu_kernels.kernel_for(x, 4) is None
    assert not cpu_decode.preferred()
    assert cpu_linear.load_kernel() is None
    assert torch.equal(lin(x), F.linear(x, lin.weight))


@pytest.mark.parametrize("isa", HOST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_named_build_forced_is_the_one_that_runs(monkeypatch, isa, dtype):
    monkeypatch.setenv("MINILLM_CPU_KERNEL", isa)
    for rows in (1, 5, 16):
        lin, x = linear_and_x(rows, dtype=dtype)
        kernel = cpu_linear.kernel_for(x, lin.weight)
        assert kernel is not None and kernel.isa == isa
        assert torch.equal(lin(x), cpu_linear.small_m_linear(x, lin.weight, isa))
        want_quant = cpu_select.forced_variant(cpu_kernels.BUILDS, isa)
        assert cpu_kernels.kernel_for(x.float(), 4) == want_quant
    assert cpu_decode.preferred()
    assert all(cpu_decode.contiguous_preferred(n) for n in (1, 200, 2000))


def test_a_measured_choice_is_what_linear_runs(monkeypatch):
    # The fake measurement makes BLAS fastest at 9-16 rows of fp32 and the avx2 build
    # fastest elsewhere: Linear follows it.
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "1")
    speed = {"avx2": 0.5, "blas": 2.0}
    sel = cpu_select.select(timer=lambda makers: {
        v: [0.1 if v == "blas" and "9-16" in str(makers[v]) else speed.get(v, 1.0)] * 5
        for v in makers})
    monkeypatch.setitem(cpu_select._current, "auto", sel)
    for rows, want in ((1, "avx2"), (4, "avx2"), (8, "avx2"), (9, None), (16, None)):
        lin, x = linear_and_x(rows)
        kernel = cpu_linear.kernel_for(x, lin.weight)
        assert (kernel.isa if kernel else None) == want, rows
        expected = cpu_linear.small_m_linear(x, lin.weight, want) if want else \
            F.linear(x, lin.weight)
        assert torch.equal(lin(x), expected)


def test_default_setting_measures_nothing_and_runs_the_default_builds(monkeypatch):
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "default")
    monkeypatch.setattr(cpu_select, "time_variants", None)  # would fail if called
    sel = cpu_select.current()
    assert sel.timings_ms == {} and sel.source == "not measured"
    lin, x = linear_and_x(1)
    assert cpu_linear.kernel_for(x, lin.weight).isa == cpu_linear.default_variant()
    assert cpu_kernels.kernel_for(x, 4) == cpu_kernels.default_variant()
    assert cpu_decode.preferred()


# ---------------------------------------------------------------------------- the cache

def test_the_cache_is_reused_on_the_same_cpu(monkeypatch):
    calls = []
    first = cpu_select.select("auto", timer=fake_timer({"avx2": 0.5}, calls))
    assert calls and first.source.startswith("measured now")
    path = cpu_select.cache_path()
    assert path.exists() and "-f" in path.name
    calls.clear()
    again = cpu_select.select("auto", timer=fake_timer({}, calls))
    assert not calls and again.choices == first.choices and again.source.startswith("cached")


@pytest.mark.parametrize("field, other", [
    ("family", "25"),  # Zen 4 under a hypervisor that names it "AMD EPYC" like Zen 5
    ("cpu", "Intel(R) Xeon(R) CPU @ 2.50GHz"),
    ("flags", ["avx2", "fma"]),
    ("sources", "0123456789abcdef"),
])
def test_a_selection_cached_by_another_cpu_is_not_reused(field, other):
    key = cpu_select.cpu_key()
    foreign = {**key, field: other}
    # The other CPU's file, written where this CPU looks (as if its name slugged the same):
    # every bucket chose BLAS there.
    groups = cpu_select.groups()
    choices = {g.key(b): "blas" for g in groups for b in g.buckets}
    path = cpu_select.cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": foreign, "choices": choices, "timings_ms": {}}))
    calls = []
    sel = cpu_select.select("auto", timer=fake_timer({"blas": 5.0}, calls))
    assert calls, "the other CPU's selection was reused"
    assert "blas" not in {v for k, v in sel.choices.items() if k.startswith("small_m")}
    assert json.loads(path.read_text())["key"] == key  # overwritten with this CPU's


def test_a_noisy_measurement_runs_the_defaults_and_is_not_cached():
    def noisy(makers):
        return {v: [1.0, 3.0, 1.0, 2.5, 1.0] for v in makers}
    with pytest.warns(RuntimeWarning, match="too noisy"):
        sel = cpu_select.select("auto", timer=noisy)
    assert sel.choices == cpu_select._fixed("default", cpu_select.groups())
    assert not cpu_select.cache_path().exists()


def _measure_in_another_process(cache_dir, started, proceed, done):
    """A second process that takes the measuring lock, says so, waits, then caches its
    selection: what one rank of a distributed run does while the others start."""
    import os
    os.environ["MINILLM_CACHE_DIR"] = cache_dir
    path = cpu_select.cache_path()
    with cpu_select._measuring(path):
        started.set()
        proceed.wait(30)
        cpu_select._measure_and_cache("auto", cpu_select.groups(), cpu_select.cpu_key(), path,
                                      fake_timer({"blas": 5.0}))
    done.set()


def test_one_process_measures_and_the_others_read_its_cache(tmp_path):
    """Ranks that start together must not all measure at once (their rounds would disagree,
    nothing would be cached, and every launch would measure again): one measures under a
    lock; another that wanted the same selection waits and reads what it cached."""
    import multiprocessing as mp
    import threading

    ctx = mp.get_context("spawn")
    started, proceed, done = ctx.Event(), ctx.Event(), ctx.Event()
    other = ctx.Process(target=_measure_in_another_process,
                        args=(str(tmp_path), started, proceed, done))
    other.start()
    try:
        assert started.wait(60), "the other process never took the lock"
        calls, result = [], {}
        here = threading.Thread(target=lambda: result.update(
            sel=cpu_select.select("auto", timer=fake_timer({}, calls))))
        here.start()
        here.join(1.0)
        assert here.is_alive(), "select() measured while another process held the lock"
        proceed.set()
        here.join(60)
        assert done.is_set() and not here.is_alive()
        assert not calls, "this process measured although the other had just cached a selection"
        assert result["sel"].source.startswith("cached")
        assert result["sel"].key == cpu_select.cpu_key()
    finally:
        proceed.set()
        other.join(30)


# ---------------------------------------------------------------------------- visible

def test_info_prints_the_selection(monkeypatch, capsys):
    from minillm import perf
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "1")
    sel = cpu_select.select(timer=fake_timer({HOST[0] if HOST else "generic": 0.5,
                                              "blas": 1.0}))
    monkeypatch.setitem(cpu_select._current, "auto", sel)
    profile = perf.MachineProfile("cpu", "a CPU", 2, 3e10, {"copy": 3e10}, {"blas": 2e10},
                                  {"float32": 1e11}, "now", 1.0, torch.__version__, {})
    monkeypatch.setattr(perf, "measure_machine", lambda refresh=False: profile)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels (MINILLM_CPU_KERNEL=auto" in out
    line = next(x for x in out.splitlines() if "small-M linear, float32 K<1024" in x)
    assert "rows 1: " in line and "2.00x blas" in line
    assert "paged-decode attention, float32:" in out and "W4/W8 linear, w4:" in out
    line = next(x for x in out.splitlines() if "float32 contiguous" in x)
    assert "context 1-127: " in line and "x sdpa" in line and "rows" not in line
