"""benchmarks/step_breakdown.py: the aggregation of profiler kernels and of cProfile's
functions into per-step tables, on hand-made events whose every number is known, and its
two wrappers on the CPU (the path the GPU check's dry run takes)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_breakdown as sb  # noqa: E402

ATEN_FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, "
             "at::detail::Array<char*, 2> >(int, at::native::FillFunctor<long>, "
             "at::detail::Array<char*, 2>)")
CUBLAS = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_"


def test_busy_time_is_the_union_of_the_intervals():
    assert sb.busy_us([]) == 0
    assert sb.busy_us([(0, 10), (20, 25)]) == 15                  # disjoint
    assert sb.busy_us([(20, 25), (0, 10), (5, 12)]) == 17         # overlap, any order
    assert sb.busy_us([(0, 10), (2, 3), (4, 9)]) == 10            # nested: counted once
    assert sb.busy_us([(0, 10), (10, 12)]) == 12                  # touching
    assert sb.busy_us(iter([(1.5, 2.0), (1.75, 3.0)])) == 1.5     # any iterable


def test_kernels_per_step_busy_time_and_top_list():
    """Two steps; C runs on another stream inside the second A: busy time counts it once,
    its own time is still its own, and its share is of the busy time."""
    events = [("A", 0, 10), ("B", 10, 15), ("A", 20, 30), ("C", 22, 28), ("B", 30, 35)]
    kb = sb.kernel_breakdown(events, steps=2)
    assert kb["steps"] == 2 and kb["kernels_per_step"] == 2.5 and kb["distinct_kernels"] == 3
    assert kb["busy_us_per_step"] == 15           # [0, 15] and [20, 35]: 30 µs over 2 steps
    assert kb["kernel_us_per_step"] == 18         # 10 + 5 + 10 + 6 + 5 over 2 steps
    assert [k["kernel"] for k in kb["top"]] == ["A", "B", "C"]   # by total time
    assert [k["per_step"] for k in kb["top"]] == [1, 1, 0.5]
    assert [k["us_per_step"] for k in kb["top"]] == [10, 5, 3]
    assert [k["share"] for k in kb["top"]] == pytest.approx([20 / 30, 10 / 30, 6 / 30])
    assert kb["others"] == {"kernels": 0, "per_step": 0, "us_per_step": 0}
    cut = sb.kernel_breakdown(events, steps=2, top=1)
    assert [k["kernel"] for k in cut["top"]] == ["A"]
    assert cut["others"] == {"kernels": 2, "per_step": 1.5, "us_per_step": 8}
    assert cut["busy_us_per_step"] == 15          # the cut changes the list, not the totals


def test_the_top_list_orders_by_total_time_not_by_count_or_longest_call():
    events = [("many short", i, i + 1) for i in range(0, 30, 3)]   # 10 x 1 µs
    events += [("one long", 100, 108), ("tie b", 200, 203), ("tie a", 210, 213)]
    kb = sb.kernel_breakdown(events, steps=1)
    assert [k["kernel"] for k in kb["top"]] == ["many short", "one long", "tie a", "tie b"]
    assert kb["top"][0]["per_step"] == 10


def test_no_kernels_and_bad_steps():
    kb = sb.kernel_breakdown([], steps=3)
    assert kb["kernels_per_step"] == 0 and kb["busy_us_per_step"] == 0 and kb["top"] == []
    with pytest.raises(ValueError, match="steps must be >= 1"):
        sb.kernel_breakdown([("A", 0, 1)], steps=0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        sb.host_breakdown({}, steps=0)


def test_kernel_names_are_shortened_but_stay_readable():
    assert sb.short_kernel_name(ATEN_FILL) == ("vectorized_elementwise_kernel<4, FillFunctor"
                                               "<long>, Array<c…")
    assert len(sb.short_kernel_name(ATEN_FILL)) == sb.KERNEL_NAME_WIDTH
    assert sb.short_kernel_name(ATEN_FILL, width=200) == (
        "vectorized_elementwise_kernel<4, FillFunctor<long>, Array<char*, 2> >")
    for name in ("_paged_decode_kernel", "Memcpy DtoH (Device -> Pinned)", "aten::mm"):
        assert sb.short_kernel_name(name) == name      # Triton's, copies, CPU operators
    assert sb.short_kernel_name(
        "void at::native::(anonymous namespace)::softmax<float>(float*, int)") == "softmax<float>"


def test_kernels_whose_short_names_collide_keep_distinct_labels():
    long_a, long_b = CUBLAS + "execute_segment_k_off", CUBLAS + "execute_segment_k_on"
    overload_a = "void at::native::reduce_kernel<512, 1>(int)"
    overload_b = "void at::native::reduce_kernel<512, 1>(long)"
    events = [(long_a, 0, 4), (long_b, 4, 7), (overload_a, 7, 9), (overload_b, 9, 10)]
    labels = [k["kernel"] for k in sb.kernel_breakdown(events, steps=1)["top"]]
    assert len(set(labels)) == 4, labels
    assert labels[0] == sb.short_kernel_name(long_a)
    assert labels[1].endswith("segment_k_on") and "…" in labels[1]   # the tail tells them apart
    assert labels[2:] == ["reduce_kernel<512, 1>", "reduce_kernel<512, 1> #2"]
    assert all(len(label) <= sb.KERNEL_NAME_WIDTH for label in labels[:2])


def test_host_functions_by_own_time_per_step():
    site = "/opt/venv/lib/python3.12/site-packages/torch/nn/modules/module.py"
    stats = {  # (file, line, function): (primitive calls, calls, tottime s, cumtime s, callers)
        (str(ROOT / "minillm" / "model.py"), 10, "run"): (4, 4, 0.004, 0.012, {}),
        (site, 1750, "_call_impl"): (8, 8, 0.002, 0.008, {}),
        ("~", 0, "<built-in method torch._C._nn.linear>"): (40, 40, 0.006, 0.006, {}),
        ("~", 0, "<method 'disable' of '_lsprof.Profiler' objects>"): (1, 1, 1.0, 1.0, {}),
    }
    hb = sb.host_breakdown(stats, steps=4)
    assert hb["steps"] == 4 and hb["functions"] == 3  # cProfile's own call left out
    assert hb["host_us_per_step"] == pytest.approx(3000)
    assert [f["function"] for f in hb["top"]] == [
        "{built-in method torch._C._nn.linear}", "minillm/model.py:10(run)",
        "torch/nn/modules/module.py:1750(_call_impl)"]
    assert [f["calls_per_step"] for f in hb["top"]] == [10, 1, 2]
    assert [f["us_per_step"] for f in hb["top"]] == pytest.approx([1500, 1000, 500])
    assert [f["share"] for f in hb["top"]] == pytest.approx([0.5, 1 / 3, 1 / 6])
    assert len(sb.host_breakdown(stats, steps=4, top=2)["top"]) == 2


def test_paths_are_shortened_to_where_a_reader_finds_them():
    venv_in_repo = str(ROOT / ".venv/lib/python3.11/site-packages/triton/runtime/jit.py")
    assert sb.short_path(venv_in_repo) == "triton/runtime/jit.py"
    assert sb.short_path(str(ROOT / "minillm" / "engine" / "step.py")) == "minillm/engine/step.py"
    import threading
    assert sb.short_path(threading.__file__) == "threading.py"
    assert sb.short_path("<frozen importlib._bootstrap>") == "<frozen importlib._bootstrap>"


def test_the_wrappers_on_a_cpu_count_per_step():
    """What the dry run takes: torch.profiler's top-level CPU operators stand for kernels,
    and cProfile counts a helper's calls per step."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA profile_kernels lists kernels, not CPU operators")
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    part = sb.profile_kernels(lambda: (a @ b).relu(), steps=3)
    assert part["kind"] == "kernels" and part["steps"] == 3 and "CPU operators" in part["events"]
    assert part["kernels_per_step"] == 2  # matmul and relu; what they call is not counted
    assert {k["kernel"]: k["per_step"] for k in part["top"]} == {"aten::matmul": 1,
                                                                "aten::relu": 1}
    assert 0 < part["busy_us_per_step"] <= part["wall_us_per_step"]

    def helper(x):
        return x + 1

    calls = []

    def step():
        calls.append(1)
        return [helper(i) for i in range(3)]

    part = sb.profile_host(step, steps=4, warmup=2)
    assert len(calls) == 6  # 2 warm-up calls outside the profile, then 4
    by = {f["function"].split(":")[-1].split("(")[-1]: f for f in part["top"]}
    assert by["helper)"]["calls_per_step"] == 3 and by["step)"]["calls_per_step"] == 1
    assert by["helper)"]["function"].startswith("tests/test_step_breakdown.py:")
    assert "{method 'append' of 'list' objects}" in {f["function"] for f in part["top"]}
    assert part["host_us_per_step"] > 0
