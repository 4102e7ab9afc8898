"""The widgets: each pure data function against minillm.calc, then each view driven like a
student would (set a control's value) with synthetic measurements and the Agg backend.

No display and no kernel are needed: views render to PNG and place it in their Output.
"""
import math

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from minillm import calc, hardware  # noqa: E402
from minillm.measure import OpMeasurement  # noqa: E402
from minillm.perf import MachineProfile  # noqa: E402
from widgets import MODEL_PRESETS, THIS_MACHINE, kv_growth, memory_wall, roofline  # noqa: E402
from widgets import quantization as quantization_widget  # noqa: E402
from widgets.quant_runs import QuantResult  # noqa: E402

BW, PEAK = 20e9, 100e9  # the synthetic machine: ridge at 5 FLOP/byte
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def profile():
    return MachineProfile(
        device="cpu", device_name="Test CPU", num_threads=2, bandwidth_bytes_per_s=BW,
        bandwidth_by_kernel={"copy": BW}, matvec_by_path={"blas": BW}, matmul_flops={"float32": PEAK, "bfloat16": 10e9},
        measured_at="2026-01-01T00:00:00+00:00", measurement_s=0.0, torch_version="x", settings={})


def _decode(batch, seconds, n=134_515_008, ctx=128):
    """A decode step of SmolLM2 in fp32 as measure_decode_steps would report it."""
    weight = calc.weight_bytes(n, 4)
    kv = calc.kv_cache_bytes(30, 3, 64, ctx + 1, 4)
    f = calc.decode_flops(n, ctx + 1, 30, 576)
    return OpMeasurement(f"decode B={batch}", "decode", batch, batch * f, weight + batch * kv, seconds,
                         "float32", "cpu", {"model": "SmolLM2-135M", "num_params": n, "context_len": ctx,
                                            "weight_bytes": weight, "kv_bytes_per_seq": kv,
                                            "flops_per_seq": f})


@pytest.fixture(scope="module")
def ops():
    steps = [_decode(b, s) for b, s in [(1, 0.05), (4, 0.09), (16, 0.12), (64, 0.3)]]
    return steps + [
        OpMeasurement("matmul 512x3072x576", "matmul", 512, 2 * 512 * 3072 * 576,
                      (512 * 576 + 3072 * 576 + 512 * 3072) * 4, 0.02, "float32", "cpu", {}),
        OpMeasurement("matvec 49152x576", "matvec", 1, 2 * 49152 * 576,
                      (49152 * 576 + 576 + 49152) * 4, 0.008, "float32", "cpu", {}),
    ]


def _drawn(view):
    assert view.error is None, view.error
    assert view.png.startswith(PNG)
    assert view.figure.axes, "the figure has no axes"
    (out,) = view.output.outputs
    assert "image/png" in out["data"]
    assert view.summary.value


# --------------------------------------------------------------------------- roofline


def test_attainable_is_min_of_peak_and_bandwidth_slope():
    xs = np.array([0.1, 1, 5, 10, 1000])
    got = roofline.attainable_flops(xs, PEAK, BW)
    assert got == pytest.approx([calc.roofline_flops(x, PEAK, BW) for x in xs])
    assert got == pytest.approx([2e9, 20e9, 100e9, 100e9, 100e9])


def test_roofline_data_against_calc(profile, ops):
    data = roofline.roofline_data(profile, ops, hardware_name="none")
    assert data.machine.ridge == pytest.approx(calc.ridge_point(PEAK, BW)) == pytest.approx(5)
    assert data.machine.attainable == pytest.approx(np.minimum(PEAK, data.machine.intensity * BW))
    for p, op in zip(data.points, ops):
        assert p.intensity == pytest.approx(op.intensity)
        assert p.flops_per_s == pytest.approx(op.flops / op.seconds)
        assert p.attainable == pytest.approx(calc.roofline_flops(op.intensity, PEAK, BW))
        assert p.bound == ("memory" if op.intensity < 5 else "compute")
    assert data.gpu is None and data.predicted == []
    assert data.xlim[0] < min(p.intensity for p in data.points) < data.xlim[1]


def test_roofline_flags_points_above_the_measured_roof(profile, ops):
    assert not any("Above the measured roof" in line for line in roofline.roofline_data(profile, ops).summary)
    fast = OpMeasurement("matvec cached", "matvec", 1, 2e6, 4e6, 1e-4, "float32", "cpu", {})
    data = roofline.roofline_data(profile, [*ops, fast])  # 40 GB/s against a 20 GB/s roof
    assert data.points[-1].fraction == pytest.approx(2)
    assert any("Above the measured roof: matvec cached" in line for line in data.summary)
    assert "Test CPU" in data.footnote and "2026-01-01 00:00" in data.footnote


def test_decode_crossover_is_where_decode_intensity_meets_the_ridge(profile, ops):
    data = roofline.roofline_data(profile, ops, "none")
    d = ops[0].details
    b = data.decode_crossover
    assert b * d["flops_per_seq"] / (d["weight_bytes"] + b * d["kv_bytes_per_seq"]) == pytest.approx(5)
    assert any("stops being bandwidth-bound at batch ≈" in line for line in data.summary)
    # A ridge above the KV cache's own intensity is never reached.
    assert roofline.decode_crossover_batch(10.0, 100.0, 1.0, ridge=20) == math.inf


def test_gpu_predictions_rescale_intensity_by_dtype_bytes(profile, ops):
    data = roofline.roofline_data(profile, ops, "H100-SXM", "bf16")
    h100 = hardware.get("H100-SXM")
    assert data.gpu.ridge == pytest.approx(h100.ridge_point("bf16"))
    for pred, op in zip(data.predicted, ops):
        assert pred.intensity == pytest.approx(op.intensity * 2)  # fp32 -> bf16 halves the bytes
        assert pred.flops_per_s == pytest.approx(calc.roofline_flops(pred.intensity, h100.bf16_flops,
                                                                     h100.bandwidth_bytes_per_s))
    # A100 has no fp8: falls back to bf16 and says so.
    a100 = roofline.roofline_data(profile, ops, "A100-80GB", "fp8")
    assert a100.gpu.peak_flops == hardware.get("A100-80GB").bf16_flops
    assert any("no fp8" in line for line in a100.summary)


def test_roofline_highlight_must_be_a_measured_batch(profile, ops):
    assert roofline.roofline_data(profile, ops, "none", highlight_batch=16).highlight.batch == 16
    with pytest.raises(ValueError, match=r"highlight_batch must be a measured decode batch size \(\[1, 4, 16, 64\]\)"):
        roofline.roofline_data(profile, ops, "none", highlight_batch=3)


def test_roofline_view_reacts_to_its_controls(profile, ops):
    view = roofline.view(profile, ops, hardware_name="none")
    _drawn(view)
    assert "minillm-roofline" in view.box._dom_classes
    assert "minillm-roofline-batch" in view.controls["batch"]._dom_classes
    assert view.controls["batch"].description == "decode batch"
    assert view.data.highlight.batch == 1
    view.controls["batch"].value = 64
    assert view.renders == 2 and view.data.highlight.batch == 64
    _drawn(view)
    view.controls["hardware"].value = "A100-80GB"
    assert view.data.gpu.label == "A100-80GB" and len(view.data.predicted) == len(ops)
    _drawn(view)


# --------------------------------------------------------------------------- memory wall


def test_memory_wall_matches_calc():
    d = memory_wall.memory_wall_data("Llama-2-70B", "fp16", 4096, "A100-80GB", batch_sizes=(1, 8, 64))
    a100 = hardware.get("A100-80GB")
    bw, peak = a100.bandwidth_bytes_per_s, a100.fp16_flops
    n, kv = 70e9, calc.kv_cache_bytes(80, 8, 128, 4096, 2)
    assert d.weight_bytes == calc.weight_bytes(n, 2) == 140e9
    assert d.weight_time_s == pytest.approx(140e9 / bw)
    assert d.kv_bytes_per_seq == pytest.approx(kv)
    assert d.kv_time_s == pytest.approx(np.array([1, 8, 64]) * kv / bw)
    assert d.compute_time_s == pytest.approx(2 * n * np.array([1, 8, 64]) / peak)
    assert d.step_time_s == pytest.approx([calc.decode_step_time_s(n, 2, bw, peak, b, kv) for b in (1, 8, 64)])
    assert d.tokens_per_s == pytest.approx(np.array([1, 8, 64]) / d.step_time_s)
    assert not d.fits.any()  # 140 GB of weights on an 80 GB card
    assert any(f"{calc.decode_tokens_per_s(n, 2, bw, kv):.3g} tok/s" in line for line in d.summary)


def test_memory_wall_on_this_machine_uses_the_profile(profile, ops):
    d = memory_wall.memory_wall_data("SmolLM2-135M", "fp32", 128, THIS_MACHINE, profile,
                                     measured=ops, highlight_batch=16)
    n = MODEL_PRESETS["SmolLM2-135M"].num_params
    assert d.bandwidth == BW and d.peak_flops == PEAK and d.memory_bytes is None
    assert d.weight_time_s[0] == pytest.approx(n * 4 / BW)
    assert d.measured_batches.tolist() == [1, 4, 16, 64]
    assert d.measured_step_s.tolist() == [0.05, 0.09, 0.12, 0.3]
    assert any("Measured here: 120 ms" in line for line in d.summary)
    # On another GPU the CPU's measurements are not drawn.
    assert memory_wall.memory_wall_data("SmolLM2-135M", "fp32", 128, "H100-SXM", measured=ops).measured_batches.size == 0
    with pytest.raises(ValueError, match="needs a MachineProfile"):
        memory_wall.memory_wall_data("SmolLM2-135M", "fp32", 128, THIS_MACHINE)


def test_memory_wall_view_reacts_to_its_controls(profile, ops):
    view = memory_wall.view(profile, measured=ops)
    _drawn(view)
    c = view.controls
    assert "minillm-memory-wall-batch" in c["batch"]._dom_classes
    assert c["hardware"].value == THIS_MACHINE and view.data.measured_batches.size == 4
    before = view.data.per_token_s.copy()
    c["batch"].value = 64
    assert view.data.highlight_batch == 64
    c["model"].value = "Llama-3-8B"  # sets the params slider too, in one render
    assert view.renders == 3
    assert c["params"].value == pytest.approx(8e9) and view.data.num_params == pytest.approx(8e9)
    assert not np.allclose(view.data.per_token_s, before)
    c["hardware"].value = "H100-SXM"
    assert view.data.bandwidth == hardware.get("H100-SXM").bandwidth_bytes_per_s
    assert view.data.measured_batches.size == 0
    _drawn(view)


# --------------------------------------------------------------------------- KV growth


def test_kv_growth_matches_the_book():
    d = kv_growth.kv_growth_data("Llama-2-70B", seq_len=4096, num_seqs=1, attention="GQA",
                                 kv_dtype="fp16", hardware_name="H100-SXM")
    assert d.kv_bytes_per_seq == pytest.approx(calc.kv_cache_bytes(80, 8, 128, 4096, 2))
    assert d.kv_bytes_per_seq == pytest.approx(1.34e9, rel=0.01)
    assert d.variants["MHA"].kv_bytes_per_seq == pytest.approx(10.7e9, rel=0.01)
    assert d.variants["MQA"].num_kv_heads == 1
    assert d.weight_bytes == 140e9 and not d.fits and d.max_concurrent == 0
    assert any("weights alone exceed" in line for line in d.summary)
    d8 = kv_growth.kv_growth_data("Llama-3-8B", seq_len=8192, attention="GQA")
    assert d8.kv_bytes_per_seq == pytest.approx(1.07e9, rel=0.01)


def test_kv_growth_max_sequences_and_oom_point():
    d = kv_growth.kv_growth_data("Llama-3-8B", seq_len=8192, num_seqs=16, attention="GQA",
                                 hardware_name="H100-SXM")
    for v in kv_growth.VARIANTS:
        c = d.variants[v]
        assert c.max_concurrent == calc.max_concurrent_sequences(80e9, 16e9, c.kv_bytes_per_seq)
    assert d.max_concurrent == d.variants["GQA"].max_concurrent == 59
    # At the OOM point, weights + 16 sequences fill the memory exactly.
    t = d.oom_seq_len
    assert 16e9 + 16 * calc.kv_cache_bytes_per_token(32, 8, 128, 2) * t == pytest.approx(80e9)
    assert d.variants["GQA"].total_bytes == pytest.approx(16e9 + 16 * d.variants["GQA"].kv_bytes_per_token * d.seq_lens)
    with pytest.raises(ValueError, match="attention must be one of"):
        kv_growth.kv_growth_data(attention="MLA")


def test_kv_growth_view_reacts_to_its_controls():
    view = kv_growth.view()
    _drawn(view)
    c = view.controls
    assert "minillm-kv-growth-seq-len" in c["seq_len"]._dom_classes
    gqa = view.data.kv_bytes_per_seq
    c["attention"].value = "MHA"
    assert view.data.kv_bytes_per_seq == pytest.approx(4 * gqa)  # Llama-3-8B: 32 / 8
    c["seq_len"].value = 1024
    assert view.data.kv_bytes_per_seq == pytest.approx(4 * gqa / 8)
    c["model"].value = "SmolLM2-135M"
    assert view.data.model == "SmolLM2-135M" and view.renders == 4
    _drawn(view)


def test_a_rejected_setting_keeps_the_last_plot_and_says_why():
    view = kv_growth.view()
    png, renders = view.png, view.renders

    def reject():
        raise ValueError("num_seqs must be >= 1; got 0.")

    view.compute = reject
    view.update()
    assert view.error == "num_seqs must be >= 1; got 0." and "num_seqs must be" in view.summary.value
    assert view.png == png and view.renders == renders


# --------------------------------------------------------------------------- speculation (Lab 07)


def test_speculation_data_is_calc():
    from widgets import speculation

    d = speculation.speculation_data(alpha=0.8, k=5, cost_ratio=0.05, verify_cost=1.0)
    assert d.expected_tokens == pytest.approx(calc.spec_expected_tokens(0.8, 5)) == pytest.approx(3.68928)
    assert d.tokens_naive[5] == pytest.approx(5.0)  # the shortcut k·α + 1
    assert (d.tokens_naive[1:] > d.tokens[1:]).all() and d.tokens[0] == d.tokens_naive[0] == 1
    assert d.speedup == pytest.approx([calc.spec_speedup(0.8, k, 0.05) for k in range(17)])
    assert d.optimal_k == calc.spec_optimal_k(0.8, 0.05) == 8
    assert d.speedup[d.optimal_k] == pytest.approx(3.092, abs=1e-3)
    assert any("best k for these α, r, c: 8 (3.09×)" in line for line in d.summary)
    # The verify cost enters the speedup and the best k, but not the tokens per pass.
    slow = speculation.speculation_data(alpha=0.8, k=5, cost_ratio=0.05, verify_cost=2.0)
    assert slow.tokens == pytest.approx(d.tokens)
    assert slow.speedup_at_k == pytest.approx(calc.spec_speedup(0.8, 5, 0.05, verify_cost=2.0))
    assert slow.speedup_one_step == pytest.approx(d.speedup)
    assert slow.optimal_k == calc.spec_optimal_k(0.8, 0.05, verify_cost=2.0)
    none = speculation.speculation_data(alpha=0.2, k=2, cost_ratio=0.3, verify_cost=1.5)
    assert none.optimal_k == 0 and any("does not pay" in line for line in none.summary)
    # Each k's own measured c: a verify pass that grows with k caps the useful k.
    by_k = speculation.speculation_data(alpha=0.8, k=4, cost_ratio=0.0,
                                        verify_cost_by_k={1: 1.0, 4: 1.2, 8: 2.5, 32: 9.0})
    assert list(by_k.speedup_by_k) == [1, 4, 8]      # k beyond k_max is left out
    assert by_k.speedup_by_k[8] == pytest.approx(calc.spec_speedup(0.8, 8, 0.0, verify_cost=2.5))
    assert by_k.optimal_k == 16                      # with c fixed at 1 and r = 0, more is better
    assert any("best k = 4 (" in line for line in by_k.summary)
    with pytest.raises(ValueError, match=r"k must be an int in \[0, 16\]"):
        speculation.speculation_data(k=17)
    with pytest.raises(ValueError, match="alpha"):
        speculation.speculation_data(alpha=1.5)


def test_speculation_view_reacts_and_draws_the_measured_points():
    from widgets import speculation
    from widgets.spec_runs import SpeedupRow

    rows = [SpeedupRow(k, 1.0, s, 0.8, t, k, 0.001, 1.3, 0.0) for k, s, t in ((1, 1.4, 1.8), (4, 2.3, 3.6))]
    view = speculation.view(alpha=0.77, k=4, cost_ratio=0.0002, verify_cost=1.57, measured=rows)
    _drawn(view)
    assert "minillm-speculation" in view.box._dom_classes
    assert "minillm-speculation-verify-cost" in view.controls["verify_cost"]._dom_classes
    assert [(p.k, p.speedup, p.tokens_per_pass) for p in view.data.measured] == [(1, 1.4, 1.8), (4, 2.3, 3.6)]
    assert any("measured: k = 1: 1.40×, k = 4: 2.30×" in line for line in view.data.summary)
    view.controls["verify_cost"].value = 1.0
    assert view.data.speedup_at_k == pytest.approx(calc.spec_speedup(0.77, 4, 0.0002))
    view.controls["alpha"].value = 0.3
    view.controls["k"].value = 8
    assert view.renders == 4 and view.data.k == 8
    assert view.data.optimal_k == calc.spec_optimal_k(0.3, 0.0002, verify_cost=1.0)
    _drawn(view)
    # A measured c beyond the slider's usual range widens it instead of being clipped.
    wide = speculation.view(verify_cost=5.2, measured=[(2, 0.5)])
    assert wide.controls["verify_cost"].value == 5.2 and wide.data.measured[0].tokens_per_pass is None


def test_position_and_batch_figures_from_synthetic_runs():
    from widgets import speculation
    from widgets.spec_runs import BatchCost, PassRecord, SpecTrace

    passes = [PassRecord([1, 2, 3], 3, [1, 2, 3, 4]), PassRecord([5, 6, 7], 0, [9]),
              PassRecord([7, 8], 2, [7, 8, 9]), PassRecord([], 0, [4])]
    trace = SpecTrace(10, 3, passes, [1, 2, 3, 4, 9, 7, 8, 9, 4], 0.0)
    assert trace.acceptance_rate == pytest.approx(5 / 8) and trace.tokens_per_pass == pytest.approx(9 / 4)
    d = speculation.position_data({"t": trace})
    assert d.judged["t"].tolist() == [3, 2, 1]        # guess 3 is judged only in pass 1
    assert d.conditional["t"].tolist() == [2 / 3, 1.0, 1.0]
    assert d.reach["t"] == pytest.approx([2 / 3, 2 / 3, 1 / 2])
    assert "kept at positions 1..3, given the earlier guesses kept: 0.67 of 3, 1.00 of 2, 1.00 of 1" in d.summary[0]
    assert figure_ok(speculation.draw_positions(d))

    cost = BatchCost(np.array([1, 2, 4, 8, 16]), np.array([0.05, 0.055, 0.06, 0.1, 0.2]))
    b = speculation.batch_cost_data(cost, alphas=(0.8, 0.4), k=3)
    assert b.spec_batches.tolist() == [1, 2, 4]       # 4 rows per sequence: up to 16 measured rows
    assert b.verify_cost == pytest.approx([0.06 / 0.05, 0.1 / 0.055, 0.2 / 0.06])
    assert b.speedup[0.8] == pytest.approx([calc.spec_speedup(0.8, 3, 0.0, c) for c in b.verify_cost])
    assert b.speedup[0.8][0] > 1 > b.speedup[0.8][-1]
    assert "more than 2.95 steps: from batch 4 on this machine" in b.summary[-2]   # E(0.8, 3) = 2.952
    assert "more than 1.62 steps: from batch 2 on this machine" in b.summary[-1]   # E(0.4, 3) = 1.624
    never = speculation.batch_cost_data(cost, alphas=(1.0,), k=1)  # E = 2 tokens per pass
    assert "not within the measured batches (the verify pass reached 2.00 steps)" in never.summary[-1]
    with pytest.raises(ValueError, match="room for 4 rows"):
        speculation.batch_cost_data(BatchCost(np.array([1, 2]), np.array([0.05, 0.06])), k=3)
    assert figure_ok(speculation.draw_batch_cost(b))
    assert speculation.figure_image(speculation.draw_batch_cost(b)).data.startswith(PNG)


def figure_ok(fig):
    from widgets._view import figure_png

    return fig.axes and figure_png(fig).startswith(PNG)


# --------------------------------------------------------------------------- quantization (Lab 06)


def _qresult(method, bits, group, lm_head=False, kl=0.1, nbytes=200e6, tok_s=50.0, source="measured"):
    return QuantResult(method, bits, group, lm_head, 30.0 + kl, kl, 1 - kl, 1000, int(nbytes),
                       int(nbytes), tok_s, 1.0, 2, None, source)


class FakeQuantRuns:
    def __init__(self):
        self.calls = []

    def fp32(self):
        return _qresult("fp32", 32, None, kl=0.0, nbytes=538e6, tok_s=30.0)

    def measure(self, method, bits, group_size, lm_head=False):
        self.calls.append((method, bits, group_size, lm_head))
        if group_size == 128:
            raise ValueError("group_size 128 does not divide the input dimension of qkv_proj")
        return _qresult(method, bits, group_size, lm_head, kl=1.0 / bits ** 2,
                      nbytes=538e6 * bits / 32, tok_s=10.0 * 32 / bits)


def test_explorer_data_summarises_against_fp32():
    fp32 = FakeQuantRuns().fp32()
    cur = _qresult("rtn", 4, 64, kl=0.36, nbytes=171.4e6, tok_s=60.0)
    d = quantization_widget.explorer_data(cur, [cur, _qresult("rtn", 8, None, kl=0.003)], fp32, bandwidth=20e9)
    assert [p.label for p in d.points] == ["fp32", "rtn w8 per-channel", "rtn w4 g64"]
    assert "rtn w4 g64: KL 0.3600" in d.summary[0] and "top-1 agreement 64.0%" in d.summary[0]
    assert "171.4 MB of weights read per token (3.14× less than fp32's 538.0 MB)" in d.summary[1]
    assert "60.0 tok/s batch-1 decode (2.00× fp32's 30.0 tok/s)" in d.summary[2]
    assert "ceiling bandwidth ÷ bytes = 117 tok/s, reached 51%" in d.summary[2]
    cached = quantization_widget.explorer_data(_qresult("rtn", 4, 64, source="cached"), [], fp32)
    assert "cached" in cached.summary[-1]
    assert quantization_widget.figure_image(quantization_widget.draw_tradeoff(d)).data.startswith(PNG)


def test_explorer_view_reacts_and_shows_the_package_error():
    runs = FakeQuantRuns()
    v = quantization_widget.view(runs, bandwidth=20e9)
    assert "minillm-quantization" in v.box._dom_classes
    assert "minillm-quantization-group-size" in v.controls["group_size"]._dom_classes
    assert runs.calls == [("rtn", 4, 64, False)] and v.data.current.label == "rtn w4 g64"
    v.controls["bits"].value = 3
    v.controls["method"].value = "gptq"
    assert v.renders == 3 and v.data.current.label == "gptq w3 g64"
    assert [p.label for p in v.data.points] == ["fp32", "rtn w4 g64", "rtn w3 g64", "gptq w3 g64"]
    v.controls["group_size"].value = 128
    assert v.error and "does not divide" in v.error and "does not divide" in v.summary.value
    assert v.renders == 3 and v.data.current.label == "gptq w3 g64"  # the last plot stays
    v.controls["group_size"].value = None
    v.controls["lm_head"].value = True
    assert v.error is None and v.data.current.label == "gptq w3 per-channel, head w3"
    assert v.png.startswith(PNG)


def test_outlier_data_finds_the_loud_channels():
    m = np.ones((4, 64))
    m[:, 7] = 50.0
    m[2, 9] = 400.0
    d = quantization_widget.outlier_data({"qkv_proj": m})
    assert d.ratio.tolist() == [50.0, 50.0, 400.0, 50.0]
    assert d.outliers.tolist() == [1, 1, 2, 1]
    assert "up to 400× (layer 2)" in d.summary[0] and "9 (max 400.0)" in d.summary[1]
    assert quantization_widget.figure_image(quantization_widget.draw_outliers(d)).data.startswith(PNG)
