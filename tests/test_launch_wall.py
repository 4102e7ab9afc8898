"""The launch wall (`minillm.measure.launch`, Lab 01 section 8): the floors' formulas, the
profiler's counts (`minillm.measure.step_counts`) and the measured steps, on a tiny random
model; on a GPU, the CUDA graph cutting the launches of a step while keeping its kernels,
and the other device defaults.
Also section 9's profile of a decode step (`minillm.measure.step_profile`).

The CPU tests check counts and relations, never timing thresholds: a step is timed, and
only its being positive and consistent with the floors' arithmetic is asserted.
"""
from __future__ import annotations

import pytest
import torch

from minillm import LlamaModel, ModelConfig, calc, devices, measure
from minillm.measure import launch, step_counts

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (gpu_check's pytest section)")


def tiny(device=None):
    dev = devices.resolve_device(device)
    return (LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()
            .to(dev, devices.default_dtype(dev)))


def test_the_floors_formulas():
    assert calc.launch_floor_s(1223, 3.2e-6) == pytest.approx(3.9136e-3)
    assert calc.launch_floor_s(0, 3e-6) == 0
    assert calc.step_floor_s(14e-3, 4e-3, overlapped=False) == pytest.approx(18e-3)  # a CPU
    assert calc.step_floor_s(0.09e-3, 4.5e-3, overlapped=True) == pytest.approx(4.5e-3)  # a GPU
    # a GPU's replayed step: few launches, and its kernels' own floor the largest
    assert calc.step_floor_s(0.062e-3, 0.09e-3, True, 283 * 3e-6) == pytest.approx(0.849e-3)
    assert calc.step_floor_s(14e-3, 4e-3, False, 1e-3) == pytest.approx(18e-3)  # a CPU: none
    with pytest.raises(ValueError, match="kernel_floor"):
        calc.step_floor_s(1e-3, 1e-3, True, -1.0)
    with pytest.raises(ValueError, match="launch_s must be a finite number > 0"):
        calc.launch_floor_s(10, 0)
    with pytest.raises(ValueError, match="launches_per_step"):
        calc.launch_floor_s(-1, 1e-6)


def test_launch_cost_is_microseconds_per_op():
    s = launch.measure_launch_cost(ops=200, repeats=2)
    assert 0 < s < 1e-3


def test_profiler_counts_one_decode_step_without_the_prefill():
    model = tiny()
    prompt = [3, 4, 5, 6]
    c = step_counts.count_step_ops(model, prompt, steps=2, compile=False, cuda_graph=False)
    # every layer issues its norm, projections, RoPE, cache write, attention, MLP and adds
    per_layer_at_least = 8
    assert c.host_ops >= per_layer_at_least * model.config.num_layers
    assert c.launches == c.host_ops and c.kernels >= c.host_ops  # a CPU: nested ops included
    again = step_counts.count_step_ops(model, prompt, steps=4, compile=False, cuda_graph=False)
    assert again.host_ops == c.host_ops  # per step: the same whatever the steps counted


def test_weight_stream_times_every_product_once_and_counts_its_bytes(monkeypatch):
    """measure_weight_stream calls each Linear once per timed pass, in model order, on one row,
    and counts exactly the weights: what the bytes floor of a CPU divides by."""
    from minillm.layers import Linear

    model = tiny()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    calls = []
    originals = {id(m): m.forward for m in linears}
    for m in linears:
        monkeypatch.setattr(m, "forward", lambda x, m=m: (calls.append((id(m), tuple(x.shape))),
                                                          originals[id(m)](x))[1])
    op = measure.measure_weight_stream(model, repeats=2, warmup=1)
    params = sum(m.in_features * m.out_features for m in linears)
    assert op.bytes_moved == params * 4 and op.flops == 2 * params and op.seconds > 0
    assert op.details["num_products"] == len(linears) == 4 * model.config.num_layers + 1
    assert len(calls) % len(linears) == 0 and len(calls) >= 3 * len(linears)  # warm-up + 2 repeats
    assert [c[0] for c in calls[:len(linears)]] == [id(m) for m in linears]   # model order
    assert all(shape[:-1] == (1, 1) for _, shape in calls)                    # one row each
    bw, how = measure.decode_bandwidth(model)                                 # a CPU: this stream
    assert bw > 0 and "weight products alone" in how


def test_weight_stream_refuses_a_model_without_linears():
    with pytest.raises(ValueError, match="minillm.layers.Linear"):
        measure.measure_weight_stream(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_launch_wall_table_and_summary_on_a_cpu():
    model = tiny()
    wall = measure.LaunchWall(model, bandwidth_bytes_per_s=10e9, prompt_len=4, steps=2,
                              count_steps=2, rounds=1)
    assert not wall.overlapped and wall.weight_bytes == measure.matmul_params(model.config) * 4
    run = wall.measure("eager")
    assert run.step_s > 0 and wall.run("eager") is run
    assert wall.predicted_s(run) == pytest.approx(wall.bytes_floor_s + wall.launch_floor_s(run))
    table = wall.table()
    assert "eager" in table and "the two floors added" in table
    assert any("bytes floor" in line for line in wall.summary())
    assert wall.count("eager") is wall.count("eager")  # counted once
    with pytest.raises(ValueError, match="needs a CUDA device"):
        wall.count("CUDA graph")
    with pytest.raises(ValueError, match="a variant is one of"):
        wall.measure("fast")
    with pytest.raises(KeyError, match="no 'compiled' run measured"):
        wall.run("compiled")
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be"):
        measure.LaunchWall(model, bandwidth_bytes_per_s=0)


def test_triton_launches_are_counted_and_priced_apart():
    # The H100 of 2026-11-27: 1,252 operator calls at 9.5 µs were 11.9 ms of a 19.5 ms eager
    # step; its ~95 Triton launches (cuLaunchKernelEx from Triton's launcher, under no
    # operator) the rest. The floor counts them at their own cost, measured on the step's
    # own call.
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    import minillm.kernels.decode_gemv  # noqa: F401  (the step imports it on CUDA)
    import minillm.kernels.glue  # noqa: F401

    names = step_counts.triton_kernel_names()
    assert {"_decode_gemv_kernel", "_rms_norm_kernel", "_paged_decode_kernel"} <= names

    def ev(name, device, parent=None):
        return SimpleNamespace(name=name, device_type=device, cpu_parent=parent)

    linear = ev("aten::linear", DeviceType.CPU)
    events = [linear, ev("cudaLaunchKernel", DeviceType.CPU, linear),
              ev("aten::view", DeviceType.CPU), ev("cuLaunchKernelEx", DeviceType.CPU),
              ev("cuLaunchKernelEx", DeviceType.CPU), ev("nvjet_sm90_tst", DeviceType.CUDA),
              ev("_decode_gemv_kernel", DeviceType.CUDA), ev("_rms_norm_kernel", DeviceType.CUDA)]
    assert step_counts._counts(events, cuda=True) == step_counts.StepCounts(2, 3, 3, 2, 0)
    assert step_counts._counts(events, cuda=True, graph=True).triton_launches == 0  # a replay: none
    assert step_counts._counts(events, cuda=False).triton_launches == 0

    model = tiny("cpu")  # a CPU's wall, whatever the machine has: the arithmetic is the test
    wall = measure.LaunchWall(model, bandwidth_bytes_per_s=10e9, prompt_len=4, steps=2,
                              count_steps=2, rounds=1)
    assert wall.triton_launch_s is None and wall.triton_call is None
    assert launch.measure_triton_call(model) is None
    run = launch.StepRun("eager", 0.02, host_ops=1252, launches=158, kernels=253,
                         triton_launches=95)
    assert wall.launch_floor_s(run) == pytest.approx(1252 * wall.launch_s)  # a CPU: no term
    # The H100's, as a GPU would measure them: a call of 7 operator calls and 80 µs more.
    wall.launch_s, wall.triton_call = 9.5e-6, (80e-6 + 7 * 9.5e-6, 7)
    assert wall.triton_launch_s == pytest.approx(80e-6)  # net of the calls the step counts
    assert wall.launch_floor_s(run) == pytest.approx(1252 * 9.5e-6 + 95 * 80e-6)
    counts = step_counts.StepCounts(1252, 158, 253, 95)  # what q13's predict cell passes
    assert wall.launch_floor_s(counts) == wall.launch_floor_s(run)
    wall.runs = [run]
    table = wall.table()
    assert "one Triton launch 80.0 µs" in table and "triton" in table.splitlines()[1]


def test_launches_from_compiled_code_are_counted_and_priced_apart():
    # A compiled step on a GPU: one call of compiled code (two top-level events), inside it
    # Inductor's kernels, each launched by its generated code (a record_function named after
    # the kernel, then cuLaunchKernelEx), and a product it calls through aten (cuBLAS).
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    import minillm.kernels.paged_decode  # noqa: F401

    def ev(name, device, parent=None, kernels=()):
        return SimpleNamespace(name=name, device_type=device, cpu_parent=parent,
                               kernels=[SimpleNamespace(name=k) for k in kernels])

    region = ev("Torch-Compiled Region: 0/0", DeviceType.CPU)
    graph = ev("## Call CompiledFxGraph abc ##", DeviceType.CPU, region)
    fused = ev("triton_poi_fused_add_0", DeviceType.CPU, graph, kernels=["triton_poi_fused_add_0"])
    paged = ev("_paged_decode_kernel", DeviceType.CPU, graph, kernels=["_paged_decode_kernel"])
    mm = ev("aten::mm", DeviceType.CPU, graph)
    events = [ev("TorchDynamo Cache Lookup", DeviceType.CPU), region, graph, fused,
              ev("cuLaunchKernelEx", DeviceType.CPU, fused), paged,
              ev("cuLaunchKernelEx", DeviceType.CPU, paged), mm,
              ev("cudaLaunchKernel", DeviceType.CPU, mm), ev("aten::argmax", DeviceType.CPU),
              ev("triton_poi_fused_add_0", DeviceType.CUDA),
              ev("_paged_decode_kernel", DeviceType.CUDA), ev("nvjet_sm90_tst", DeviceType.CUDA)]
    counts = step_counts._counts(events, cuda=True)
    # operator calls: 3 top-level events and the product the compiled code dispatches (its
    # launch is the operator's); 3 launches, 2 of them from the compiled code itself
    # (minillm's kernel launched there counts as a compiled launch, not a Triton one: once)
    assert counts == step_counts.StepCounts(4, 3, 3, 0, 2)
    on_a_cpu = step_counts._counts(events, cuda=False)
    assert on_a_cpu.compiled_launches == 0 and on_a_cpu.host_ops == 4

    model = tiny("cpu")
    wall = measure.LaunchWall(model, bandwidth_bytes_per_s=10e9, prompt_len=4, steps=2,
                              count_steps=2, rounds=1)
    assert wall.compiled_launch_s is None and launch.measure_compiled_launch_cost("cpu") is None
    run = launch.StepRun("compiled", 3e-3, host_ops=40, launches=250, kernels=280,
                         compiled_launches=240)
    assert wall.launch_floor_s(run) == pytest.approx(40 * wall.launch_s)  # unmeasured: no term
    # As a GPU would measure them: 9.6 µs an operator call, 40 µs a Triton launch, 6 µs a
    # launch from compiled code.
    wall.overlapped, wall.launch_s, wall.triton_call = True, 9.6e-6, (40e-6, 0)
    wall.compiled_launch_s, wall.kernel_s = 6e-6, 3e-6
    assert wall.launch_floor_s(run) == pytest.approx(40 * 9.6e-6 + 240 * 6e-6)
    assert wall.predicted_s(run) == pytest.approx(40 * 9.6e-6 + 240 * 6e-6)  # above 280 x 3 µs
    wall.runs = [run]
    table = wall.table()
    assert "one launch from compiled code 6.0 µs" in table and "compiled" in table.splitlines()[1]
    assert "+ compiled × one launch from compiled code" in table
    assert table.splitlines()[3].split()[5] == "240"  # its column: after ops, launches, kernels, triton


def test_a_compiled_call_on_a_cpu_is_host_ops_and_no_launches():
    # The CPU's compiled code runs its loops itself: the call is its two top-level events
    # (the cache lookup and the region), and nothing is launched.
    x = torch.randn(8, 8)
    chain = launch._reduction_chain(3)
    compiled = torch.compile(chain, dynamic=False)
    torch.testing.assert_close(compiled(x), chain(x))
    counts = step_counts.profile_counts(lambda: compiled(x), 2, torch.device("cpu"))
    assert counts.compiled_launches == 0 and counts.triton_launches == 0
    assert counts.host_ops == 2 and counts.launches == counts.host_ops


def test_a_compiled_steps_operator_calls_count_as_its_host_ops():
    # On a CPU the compiled step's generated code calls the weight products (the small-M
    # kernel, or BLAS) and attention as operators: each is dispatched like a call from
    # Python, so each counts, besides the step's own top-level calls.
    from minillm.generate import generate

    options = dict(compile=True, cuda_graph=False)
    prompt = [3, 4, 5, 6]
    counts = {}
    for layers in (2, 4):
        model = LlamaModel(ModelConfig.tiny(num_layers=layers)).init_random_weights(seed=0).eval()
        generate(model, prompt, 4, ignore_eos=True, **options)  # compiled first
        counts[layers] = c = step_counts.count_step_ops(model, prompt, steps=2, **options)
        assert c.compiled_launches == 0 and c.launches == c.host_ops
    # each layer adds its 4 products (q|k|v, o, gate|up, down) and attention: the step's
    # top-level calls from Python do not grow with the layers
    assert counts[4].host_ops - counts[2].host_ops >= 2 * 5


@needs_cuda
def test_compiled_code_launches_cost_the_host_microseconds_on_cuda():
    x = torch.zeros(8, 8, device="cuda")
    fns = {n: torch.compile(launch._reduction_chain(n), dynamic=False) for n in (2, 10)}
    for f in fns.values():  # compiled and autotuned before anything is counted
        f(x), f(x)
    launches = {n: step_counts.profile_counts(lambda f=f: f(x), 2, x.device).compiled_launches
                for n, f in fns.items()}
    assert launches[10] - launches[2] == pytest.approx(8, abs=1)  # a kernel a reduction
    s = launch.measure_compiled_launch_cost()
    assert s is not None and 0 < s < 100e-6


def test_a_replayed_steps_kernels_are_its_gpu_floor():
    # Illustrative figures (the H200 of 2026-11-28's, fed to the formulas only): the
    # CUDA-graph step (torch attention) ran 283 kernels in 0.90 ms against a bytes floor of
    # 0.062 ms. A CPU has no such floor (each operation runs as the host issues it: its
    # launch cost holds it).
    model = tiny("cpu")
    wall = measure.LaunchWall(model, bandwidth_bytes_per_s=10e9, prompt_len=4, steps=2,
                              count_steps=2, rounds=1)
    assert wall.kernel_s is None and launch.measure_kernel_cost("cpu") is None
    graph = launch.StepRun("CUDA graph", 0.9e-3, host_ops=9, launches=1.25, kernels=283)
    assert wall.kernel_floor_s(graph) == 0 and "kernel floor" not in wall.table()
    # As a GPU would measure them: 9.6 µs a launch, 3 µs of the device a kernel.
    wall.overlapped, wall.launch_s, wall.kernel_s = True, 9.6e-6, 3e-6
    wall.bandwidth = wall.weight_bytes / 0.062e-3
    assert wall.kernel_floor_s(graph) == pytest.approx(283 * 3e-6)
    assert wall.predicted_s(graph) == pytest.approx(283 * 3e-6)  # above bytes and launches
    eager = launch.StepRun("eager", 19.8e-3, host_ops=1342, launches=158, kernels=253)
    assert wall.predicted_s(eager) == pytest.approx(1342 * 9.6e-6)  # the launches still bind
    wall.runs = [eager, graph]
    assert "kernel floor" in wall.table().splitlines()[1]
    assert "one kernel in a graph 3.00 µs of the device" in wall.table()
    compiled = launch.StepRun("compiled", 2e-3, host_ops=14, launches=14, kernels=400)
    wall.runs = [eager, graph, compiled]  # compiled: its kernels' floor is largest, no graph
    lines = [line for line in wall.summary() if "kernels × 3.00 µs" in line]
    assert len(lines) == 1 and lines[0].startswith("CUDA graph: its 283 kernels")


def test_a_calls_host_ops_and_whether_generate_replays_a_graph():
    x = torch.zeros(4)

    def three_ops():  # what a wrapper around a Triton launch issues: views, an allocation
        torch.empty_like(x.reshape(2, 2).view(4))

    assert step_counts.count_host_ops(three_ops, calls=4) == 3
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert step_counts.replays_graph({}, gpu) and step_counts.replays_graph({"cuda_graph": None}, gpu)
    assert not step_counts.replays_graph({"cuda_graph": False}, gpu)
    assert not step_counts.replays_graph({"cuda_graph": None, "append_fn": print}, gpu)
    assert step_counts.replays_graph({"append_fn": None, "attend_fn": None}, gpu)  # as generate reads them
    assert not step_counts.replays_graph({}, cpu) and not step_counts.replays_graph({"cuda_graph": True}, cpu)


def test_default_variants_follow_the_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert launch.default_variants(cpu) == ("eager", "compiled")
    assert launch.default_variants(cpu, quick=True) == ("eager",)
    assert launch.default_variants(gpu) == ("eager", "compiled", "CUDA graph", "compiled + CUDA graph")
    assert launch.default_variants(gpu, quick=True) == ("eager", "CUDA graph")


@needs_cuda
def test_on_a_gpu_a_cuda_graph_keeps_the_kernels_and_drops_the_launches():
    model = tiny("cuda")
    wall = measure.LaunchWall(model, bandwidth_bytes_per_s=1e12, prompt_len=8, steps=8,
                              count_steps=4, rounds=2)
    eager, graph = wall.measure("eager"), wall.measure("CUDA graph")
    assert wall.overlapped and eager.kernels > 0
    assert eager.launches >= 0.5 * eager.kernels   # eager: about a launch per kernel
    assert graph.launches <= 10                    # inputs, one replay, the argmax
    assert graph.kernels >= 0.5 * eager.kernels    # the same step's kernels, replayed
    assert eager.triton_launches > 0 and graph.triton_launches == 0  # the Triton glue
    call_s, call_ops = wall.triton_call            # Triton's launcher is Python too
    assert call_s > wall.launch_s and call_ops >= 1 and wall.triton_launch_s >= 0
    assert wall.predicted_s(eager) == pytest.approx(max(
        wall.bytes_floor_s, wall.launch_floor_s(eager), wall.kernel_floor_s(eager)))
    assert 0 < wall.kernel_s < 50e-6                # microseconds of the device a kernel
    assert wall.predicted_s(graph) >= wall.kernel_floor_s(graph) > 0
    print(wall.table())


@needs_cuda
def test_on_a_gpu_everything_defaults_to_it():
    from minillm import perf

    dev = devices.default_device()
    assert dev.type == "cuda" and devices.default_dtype() == torch.bfloat16
    op = measure.measure_matvec(256, 128, repeats=1)
    assert op.device == str(dev) and op.dtype == "bfloat16"
    assert measure.measure_attention_decode(1, 64, repeats=1).device == str(dev)
    assert minillm_kv_device() == dev
    profile = perf.measure_machine(bandwidth_bytes=1 << 24, matvec_bytes=1 << 24, matmul_n=256,
                                   repeats=1, refresh=True)
    measure.format_table([op], profile)  # same device: no ValueError
    naive = measure.attention_peak_growth("naive_attention", 1024)
    tiled = measure.attention_peak_growth("tiled_attention", 1024)
    assert naive > 2 * 9 * 1024 * 1024 * 4 and tiled < naive / 4  # T² against T


def minillm_kv_device():
    import minillm

    return minillm.KVCache(ModelConfig.tiny(), 1, 8).k[0].device


def test_profile_decode_step_bins_add_up_and_leave_the_model_as_it_was():
    """Section 9's profile on the default device (a GPU under gpu_check): the bins add up, the
    ranges are found, and the model is left as it was."""
    from minillm.attention.cpu_decode import ContiguousDecode
    from minillm.layers.linear import Linear
    from minillm.measure import profile_decode_step

    model = tiny()

    backend, kernel_call = model.attn_backend, ContiguousDecode.__call__
    prof = profile_decode_step(model, [5, 17, 3, 99], steps=3)
    assert set(prof.bins) == {"weights", "attention", "rest"}
    assert prof.bins["weights"] > 0 and prof.bins["attention"] > 0 and prof.bins["rest"] >= 0
    assert sum(prof.bins.values()) == pytest.approx(prof.step_s)
    assert sum(prof.share(b) for b in prof.bins) == pytest.approx(1.0)
    names = [name for name, _, _ in prof.top_ops]
    assert names and all(s >= 0 for _, s, _ in prof.top_ops)
    if model.device.type == "cpu":  # the C++ weight product runs inside the range: its self time
        assert "minillm::Linear" in names
    assert "bin: weights" in prof.table() and "profiled step" in prof.table()
    assert model.attn_backend is backend and ContiguousDecode.__call__ is kernel_call
    assert not any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)
                   for m in model.modules() if isinstance(m, Linear))
    from minillm.layers import fused
    assert fused.PRODUCT_RANGE is None
    with pytest.raises(ValueError, match="steps"):
        profile_decode_step(model, [5, 17], steps=0)


def test_the_profile_times_the_step_that_runs_the_decode_gemv_included(monkeypatch):
    # Lab 01 section 9 on a GPU: the decode GEMV runs a layer's norm + product in one
    # kernel, without the Linear's forward. Forward hooks turned it off (a hooked Linear
    # keeps its call), so the profile timed another step than the real one. Here the Triton
    # glue runs in the interpreter, as it runs compiled on CUDA.
    from minillm.kernels import decode_gemv as dg
    from minillm.layers import fused
    from minillm.measure import profile_decode_step

    monkeypatch.setattr(fused, "TRITON_ON_CPU", True)
    calls = []
    real = dg.norm_linear

    def counted(*args, **kwargs):
        calls.append(fused.PRODUCT_RANGE)  # the range the call runs in
        return real(*args, **kwargs)
    monkeypatch.setattr(dg, "norm_linear", counted)
    model = tiny("cpu")
    prof = profile_decode_step(model, [5, 17, 3], steps=2)
    assert calls, "the decode GEMV did not run inside the profile"
    assert set(calls) == {"minillm::Linear"}  # binned as weights
    assert prof.bins["weights"] > 0
    assert fused.PRODUCT_RANGE is None  # restored
