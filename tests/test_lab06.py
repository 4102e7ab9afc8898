"""Lab 06 (quantization): its checks fed right and deliberately wrong code, the stubs of the
released lab, the measuring helpers of ``widgets.quant_runs`` on a tiny random model, and the
quiz bank. The explorer widget's tests are in test_widgets.py.

Each wrong version must fail with a message that names its mistake. No real model: the
whole file runs in well under a minute.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from minillm import LlamaModel, ModelConfig, quant  # noqa: E402
from minillm.quant.weights import quantize_with  # noqa: E402
from quizzes import check  # noqa: E402
from quizzes.checks import CheckFailed, NotImplementedYet  # noqa: E402
from quizzes.checks.lab06 import reference_awq_scale, reference_gptq_columns, reference_rtn_group  # noqa: E402
from quizzes.questions import answer, expected, load_bank  # noqa: E402
from widgets import quant_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)


def failure(fn, student, seed) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(student, seed=seed)
    return str(info.value)


# ----------------------------------------------------------------------- exercise 1: RTN


def rtn_right(w, bits, sym):
    qw = quant.rtn(w, bits, None, sym)
    return qw.q, qw.scale, qw.zero


def rtn_fp32_scales(w, bits, sym):
    return reference_rtn_group(w, bits, sym, fp16_scale=False)


@pytest.mark.parametrize("seed", SEEDS)
def test_rtn_group_accepts_the_package_and_fp32_scales(seed, capsys):
    check.rtn_group(rtn_right, seed=seed)
    check.rtn_group(rtn_fp32_scales, seed=seed)
    assert "✓ rtn_group: matches the reference on 5 random cases" in capsys.readouterr().out


def test_rtn_worked_example_is_the_books():
    q, scale, zero = rtn_right(torch.tensor([[0.12, -0.83, 0.45, -0.21]]), 4, True)
    assert q.tolist() == [[1, -7, 4, -2]] and round(scale.item(), 4) == 0.1186
    w_hat = (q - zero) * scale
    assert (w_hat - torch.tensor([[0.12, -0.83, 0.45, -0.21]])).abs().max().item() == pytest.approx(0.027, abs=5e-4)
    q, scale, zero = rtn_right(torch.tensor([[0.12, -0.83, 0.45, -0.21]]), 4, False)
    assert q.tolist() == [[11, 0, 15, 8]] and zero.item() == 10


def slip(**kwargs):
    return lambda w, bits, sym: reference_rtn_group(w, bits, sym, **kwargs)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (slip(qmax=15) , "not on the top of an unsigned grid"),  # symmetric at 4 bits with the unsigned range
    (slip(include_zero=False), "it must include 0"),
    (slip(zero_point=False), "has no zero point"),
    (slip(rounding=torch.floor), "not floor"),
    (lambda w, bits, sym: rtn_right(w, bits, sym)[0], "return a tuple (q, scale, zero)"),
    (lambda w, bits, sym: ((rtn_right(w, bits, sym)[0] - rtn_right(w, bits, sym)[2]) * rtn_right(w, bits, sym)[1],)
     + rtn_right(w, bits, sym)[1:], "q"),
])
def test_rtn_group_names_the_mistake(fn, words, seed):
    msg = failure(check.rtn_group, fn, seed)
    assert words in msg, msg


def test_rtn_group_unclamped_is_named():
    def no_clamp(w, bits, sym):
        q, s, z = rtn_right(w, bits, sym)
        s = s * 0.5  # a scale half as large overflows the grid unless clamped
        return torch.round(w / s) + z, s, z

    msg = failure(check.rtn_group, no_clamp, 0)
    assert "scale is" in msg, msg


# ----------------------------------------------------------------------- exercise 2: GPTQ


def gptq_right(W, U, scale, zero, bits, sym):
    return reference_gptq_columns(W, U, scale, zero, bits, sym)


def gptq_student(W, U, scale, zero, bits, sym):
    """The solution notebook's loop, verbatim."""
    W = W.clone()
    Q = torch.zeros_like(W)
    for i in range(W.shape[1]):
        col = W[:, i:i + 1]
        q = quantize_with(col, scale, zero, bits, sym).to(W.dtype)
        Q[:, i] = q[:, 0]
        err = (col - (q - zero) * scale) / U[i, i]
        W[:, i:] -= err @ U[i:i + 1, i:]
    return Q


@pytest.mark.parametrize("seed", SEEDS)
def test_gptq_columns_accepts_the_loop(seed, capsys):
    check.gptq_columns(gptq_right, seed=seed)
    check.gptq_columns(gptq_student, seed=seed)
    assert "✓ gptq_columns: matches the reference on 4 random cases" in capsys.readouterr().out


def test_gptq_loop_is_quant_gptq_and_identity_hessian_is_rtn():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(6, 12, generator=g)
    X = torch.randn(60, 12, generator=g) @ (torch.eye(12) + 0.5 * torch.randn(12, 12, generator=g))
    from quizzes.checks.lab06 import gptq_inputs

    H = quant.hessian(X)
    U, s, z = gptq_inputs(W.double(), H, 4, False)
    assert torch.equal(gptq_student(W.double(), U, s, z, 4, False).short(),
                       quant.gptq(W, H, 4, None, blocksize=12).q)
    U, s, z = gptq_inputs(W.double(), torch.eye(12, dtype=torch.float64), 4, False, percdamp=0.0)
    assert torch.equal(gptq_student(W.double(), U, s, z, 4, False).short(), quant.rtn(W, 4, None).q)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fn, words", [
    (lambda W, U, s, z, b, sym: reference_gptq_columns(W, U, s, z, b, sym, feedback=False), "this is plain RTN"),
    (lambda W, U, s, z, b, sym: reference_gptq_columns(W, U, s, z, b, sym, divide=False), "not scaled by row i's diagonal entry of U"),
    (lambda W, U, s, z, b, sym: reference_gptq_columns(W, U, s, z, b, sym, sign=-1.0), "wrong sign"),
    (lambda W, U, s, z, b, sym: (reference_gptq_columns(W, U, s, z, b, sym) - z) * s, "not the dequantized"),
])
def test_gptq_columns_names_the_mistake(fn, words, seed):
    msg = failure(check.gptq_columns, fn, seed)
    assert words in msg, msg


# ----------------------------------------------------------------------- exercise 3: AWQ


def awq_right(w, x, bits, group_size):
    s, alpha, _ = reference_awq_scale(w, x, bits, group_size)
    return s, alpha


def awq_student(w, x, bits, group_size):
    """The solution notebook's search, verbatim."""
    x = x.reshape(-1, x.shape[-1])
    act = x.abs().mean(0)
    ref = x @ w.T
    best = None
    for i in range(20):
        s = act.clamp(min=1e-4) ** (i / 20)
        s = s / (s.max() * s.min()).sqrt()
        w_hat = quant.rtn(w * s, bits, group_size).dequantize() / s
        err = ((x @ w_hat.T - ref) ** 2).mean().item()
        if best is None or err < best[0]:
            best = (err, s, i / 20)
    return best[1], best[2]


@pytest.mark.parametrize("seed", SEEDS)
def test_awq_scale_accepts_the_search(seed, capsys):
    check.awq_scale(awq_right, seed=seed)
    check.awq_scale(awq_student, seed=seed)
    assert "✓ awq_scale: matches the reference on 3 random cases" in capsys.readouterr().out


def _awq(**kwargs):
    from quizzes.checks.lab06 import _awq_variant

    return lambda w, x, bits, g: _awq_variant(w, x, bits, g, **kwargs)


@pytest.mark.parametrize("fn, words", [
    (_awq(normalise=False), "not normalised"),
    (_awq(pick=max), "the largest output error"),
    (lambda w, x, bits, g: awq_right(w, x, bits, g)[0], "return a pair (s, alpha)"),
    (lambda w, x, bits, g: (torch.ones(w.shape[1]), 0.0), ""),
])
def test_awq_scale_names_the_mistake(fn, words):
    for seed in SEEDS:
        msg = failure(check.awq_scale, fn, seed)
        assert words in msg, msg
        assert "✗ awq_scale" in msg


# ----------------------------------------------------------------------- the released stubs


def test_every_stub_reports_not_implemented():
    import nbformat

    from quizzes.release import build_lab, tag_value

    name = "06-quantization.ipynb"
    lab = build_lab(nbformat.read(ROOT / "solutions" / name, as_version=4), name)
    cells = {tag_value(c, "exercise"): c.source for c in lab.cells if tag_value(c, "exercise")}
    assert set(cells) == {"rtn_group", "gptq_columns", "awq_scale"}
    ns = {"torch": torch, "quant": quant, "quantize_with": quantize_with}
    for src in cells.values():
        exec(src, ns)
    for cid in cells:
        with pytest.raises(NotImplementedYet, match=f"✗ {cid}: not implemented yet") as info:
            getattr(check, cid)(ns[cid])
        assert "Hint: " in str(info.value)


# ----------------------------------------------------------------------- measuring helpers


class CharTokenizer:
    """Enough of a tokenizer for the tiny model: characters to ids below its vocabulary."""

    def encode(self, text):
        return [3 + ord(c) % 120 for c in text]

    def apply_chat_template(self, messages):
        return self.encode(messages[-1]["content"])[:12]


@pytest.fixture(scope="module")
def tiny():
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()


def test_quant_runs_measure_then_cache(tiny, tmp_path):
    path = tmp_path / "runs.json"
    runs = quant_runs.QuantRuns(tiny, CharTokenizer(), eval_windows=2, calibration_windows=2,
                                decode_tokens=4, window=32, cache_path=path)
    fp32 = runs.fp32()
    assert fp32.kl == 0 and fp32.top1 == 1 and fp32.tok_s > 0
    rtn4, gptq4 = runs.measure_many([("rtn", 4, 32), ("gptq", 4, 32)])
    assert runs.runs == 3 and rtn4.source == "measured" and rtn4.tokens == 2 * 31
    qmodel = quant.quantize_model(tiny, "rtn", 4, 32, progress=False)
    direct = quant.evaluate(qmodel, CharTokenizer(), ref_model=tiny, window=32, max_windows=2)
    assert rtn4.kl == pytest.approx(direct["kl"]) and rtn4.ppl == pytest.approx(direct["ppl"])
    assert rtn4.bytes_per_token == quant.weight_bytes(qmodel)["per_token"] < fp32.bytes_per_token
    assert gptq4.calibration_windows == 2 and gptq4.kl > 0
    # Asked again: from memory; a fresh QuantRuns on the same model: from disk, nothing re-run.
    assert runs.measure("rtn", 4, 32) is rtn4 and runs.runs == 3
    again = quant_runs.QuantRuns(tiny, CharTokenizer(), eval_windows=2, calibration_windows=2,
                                 decode_tokens=4, window=32, cache_path=path)
    hit = again.measure("gptq", 4, 32)
    assert again.runs == 0 and hit.source == "cached" and hit.kl == gptq4.kl
    # Another measurement size is another key.
    bigger = quant_runs.QuantRuns(tiny, CharTokenizer(), eval_windows=3, window=32, cache_path=path,
                                  measure_speed=False)
    assert bigger.cached("rtn", 4, 32) is None
    assert len(json.loads(path.read_text())) == 3
    # A setting the package rejects raises its own message and caches nothing.
    with pytest.raises(ValueError, match="does not divide"):
        runs.measure("rtn", 4, 48)
    assert len(json.loads(path.read_text())) == 3
    assert tiny.layers[0].attn.qkv_proj.__class__.__name__ == "Linear"  # the model is untouched
    per_method = quant_runs.QuantRuns(tiny, CharTokenizer(), calibration_windows={"gptq": 2, "awq": 1},
                                      window=32, cache_path=None, measure_speed=False)
    assert [per_method.windows_for(m) for m in ("rtn", "gptq", "awq")] == [None, 2, 1]
    assert per_method.key("gptq", 4, 32) == runs.key("gptq", 4, 32) != per_method.key("awq", 4, 32)


def test_quant_runs_measures_the_number_formats(tiny, tmp_path):
    """FP8 and NF4 rows: fake-quantized copies scored like the integer ones, their bytes as the
    format stores them, no speed (no kernel reads them), cached like the rest."""
    from minillm.quant import formats

    runs = quant_runs.QuantRuns(tiny, CharTokenizer(), eval_windows=2, window=32,
                                cache_path=tmp_path / "runs.json")
    e4m3, nf4 = runs.measure_many([("e4m3", 8, None), ("nf4", 4, 32)])
    assert e4m3.label == "e4m3 w8 per-channel" and nf4.label == "nf4 w4 g32"
    assert e4m3.tok_s is None and nf4.tok_s is None
    direct = quant.evaluate(formats.fake_quantize_model(tiny, "nf4", 32), CharTokenizer(),
                            ref_model=tiny, window=32, max_windows=2)
    assert nf4.kl == pytest.approx(direct["kl"]) and 0 < e4m3.kl < nf4.kl
    assert nf4.bytes_per_token == formats.weight_bytes(tiny, "nf4", 32)["per_token"]
    assert e4m3.bytes_per_token > nf4.bytes_per_token
    assert runs.measure("e4m3", 8, None) is e4m3 and runs.runs == 2
    with pytest.raises(ValueError, match="bits=8"):
        runs.measure("e5m2", 4, None)
    with pytest.raises(ValueError, match="group_size=None"):
        runs.measure("e5m2", 8, 32)


def test_decode_tok_s_survives_a_stall_in_the_one_token_run(monkeypatch):
    # Simulated clock: generate(1 token) takes 0.10 s and generate(32) 0.41 s (10 ms a
    # token), except the first 1-token run, stalled to 0.40 s by another program. The best
    # of each time gives 31 / (0.41 - 0.10) = 100 tok/s; the best of the differences would
    # have given 31 / 0.01 = 3,100 (what once reached the Lab 06 table).
    clock = [0.0]
    stalls = iter([0.30])

    def fake_generate(model, ids, n, ignore_eos=False):
        clock[0] += 0.10 + 0.01 * (n - 1) + (next(stalls, 0.0) if n == 1 else 0.0)
    monkeypatch.setattr(quant_runs, "generate", fake_generate)
    monkeypatch.setattr(quant_runs.time, "perf_counter", lambda: clock[0])
    assert quant_runs.decode_tok_s(None, [1], new_tokens=32, repeats=3) == pytest.approx(100)
    with pytest.raises(ValueError, match="at least 2"):
        quant_runs.decode_tok_s(None, [1], new_tokens=1)


def test_decode_against_bandwidth_on_this_device(tiny, capsys):
    """The Lab 06 cell's function, on the tiny model and the CPU (the course device here):
    the float model and its w4 copy decode, each against bandwidth / its bytes per token."""
    rows = quant_runs.decode_against_bandwidth(tiny, CharTokenizer(), device="cpu",
                                               bandwidth=2e9, new_tokens=4, repeats=1)
    fp, w4 = rows
    assert fp["model"] == "float32" and w4["model"] == "w4 g64 asym"
    assert w4["MB_per_token"] < fp["MB_per_token"]
    for r in rows:
        assert r["tok_s"] > 0 and r["device"] == "cpu"
        assert r["ceiling_tok_s"] == pytest.approx(2e9 / (r["MB_per_token"] * 1e6))
        assert r["of_ceiling"] == pytest.approx(r["tok_s"] / r["ceiling_tok_s"])
    out = capsys.readouterr().out
    assert "bandwidth 2.0 GB/s" in out and "of ceiling" in out and "w4 g64 asym" in out
    assert tiny.layers[0].attn.qkv_proj.__class__.__name__ == "Linear"  # the model is untouched


def test_activation_maxima_and_projection_input(tiny):
    ids = torch.arange(3, 40)
    maxima = quant_runs.activation_maxima(tiny, ids)
    assert maxima["qkv_proj"].shape == (2, 64) and maxima["down_proj"].shape == (2, 128)
    x = quant_runs.projection_input(tiny, ids, 1, "down_proj")
    assert x.shape == (37, 128)
    assert torch.allclose(x.abs().amax(0), maxima["down_proj"][1])
    x0 = quant_runs.projection_input(tiny, ids, 0, "qkv_proj")
    assert torch.allclose(x0, tiny.layers[0].input_norm(tiny.embed_tokens(ids)), atol=1e-6)


def test_benchmark_rows_reads_the_results_file(tmp_path):
    assert quant_runs.benchmark_rows(tmp_path / "missing.json") is None
    row = {"method": "gptq", "config": "w4 g64", "bits": 4, "group_size": 64, "quantize_s": 100.0,
           "ppl": 20.0, "kl": 0.1, "top1": 0.8, "tokens": 15000, "bytes_per_token": 171449856}
    path = tmp_path / "quant.json"
    path.write_text(json.dumps({"quality": {"machine": {"cpu": "x"}, "eval_tokens": 15000,
                                            "calibration": "128 x 512", "rows": [row]}}))
    rows, info = quant_runs.benchmark_rows(path)
    assert rows[0].label == "gptq w4 g64" and rows[0].kl == 0.1 and info["eval_tokens"] == 15000


# ----------------------------------------------------------------------- the quiz


def test_bank_accepts_its_computed_answers():
    bank = load_bank("lab06")
    assert len(bank.questions) >= 8
    for qid, q in bank.questions.items():
        m = getattr(q, "example_measured", None) or None
        got = expected(f"lab06.{qid}", m)
        assert answer(f"lab06.{qid}", got if isinstance(got, str) else f"{got}", m).correct, qid


def test_bank_numbers_are_the_books():
    assert expected("lab06.q1") == pytest.approx(0.83 / 3, abs=5e-5)      # the worked example at 3 bits
    assert expected("lab06.q2") == pytest.approx(0.12, abs=5e-4)          # 0.12 rounds to 0
    assert expected("lab06.q3") == pytest.approx(140.0)
    assert expected("lab06.q4") == pytest.approx(71.09, abs=0.01)
    assert expected("lab06.q5") == pytest.approx(36.09, abs=0.01)
    assert expected("lab06.q6") == pytest.approx(16 / 4.25, abs=0.005)
    assert expected("lab06.q12") == pytest.approx(4.1875)
    assert expected("lab06.q15") == pytest.approx(5.5)
    assert not answer("lab06.q5", "35 GB").correct  # the scales forgotten
    assert not answer("lab06.q6", "4").correct
    # q13: forgetting Q4_1's scale and minimum (and Q8_0's scale) is marked wrong
    m = {"gguf_tensor_mb": 96.58}
    assert answer("lab06.q13", "96.6 MB", m).correct and not answer("lab06.q13", "81.4 MB", m).correct
    # q14: the head at 8 bits replaces 113.2 MB of fp32 head by 29.6 MB
    m = {"head8_mb_per_token": 87.84}
    assert answer("lab06.q14", f"{171.45 - 113.25 + 28.31 * 8.375 / 8:.1f} MB", m).correct
    assert not answer("lab06.q14", f"{171.45 + 28.31:.1f} MB", m).correct   # the float head kept
    # q7: the 1/bytes rule overshoots less than 20% here; a guess that ignores the bytes is wrong
    m = {"head4_tok_s": 94.9}
    assert answer("lab06.q7", "94.9", m).correct and not answer("lab06.q7", "64 tok/s", m).correct


# ----------------------------------------------------------------------- the int8 KV cache


@pytest.mark.parametrize("seed", [0, 1])
def test_int8_kv_roundtrip_against_a_float64_reference(seed):
    from minillm import calc

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 3, 64, generator=g) * torch.rand(2, 7, 3, 1, generator=g) * 5
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 0, dequantizes to zeros
    q, scale = quant.quantize_kv_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.dtype == torch.float16
    assert scale.shape == (2, 7, 3, 1) and int(q.abs().max()) <= 127
    s64 = scale.double()
    ref_q = torch.where(s64 > 0, torch.round(x.double() / torch.where(s64 > 0, s64, 1)), 0).clamp(-127, 127)
    assert torch.equal(q.double(), ref_q)  # rounded against the scale that is stored
    back = quant.dequantize_kv_int8(q, scale)
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    assert ((back - x).abs() <= s64.float() / 2 + 1e-6).all()  # half a step at most
    assert torch.equal(quant.int8_kv_roundtrip(x), back)
    with pytest.raises(ValueError, match="float tensor"):
        quant.quantize_kv_int8(torch.ones(3, dtype=torch.int64))
    # the bytes: head_dim int8 values + one fp16 scale per (token, KV head) vector, for K and V
    assert calc.kv_cache_int8_bytes(32, 8, 128, 8192) == 2 * 32 * 8 * 8192 * (128 + 2)
    assert calc.kv_cache_bytes(32, 8, 128, 8192, 2) / calc.kv_cache_int8_bytes(32, 8, 128, 8192) == \
        pytest.approx(256 / 130)


def test_int8_kv_append_writes_in_place_like_generate_expects(tiny):
    import minillm

    cache_k, cache_v = torch.zeros(1, 10, 2, 16), torch.zeros(1, 10, 2, 16)
    k, v = torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    quant.int8_kv_append(cache_k, cache_v, k, v, 4)
    assert torch.equal(cache_k[:, 4:7], quant.int8_kv_roundtrip(k)) and not cache_k[:, :4].any()
    assert torch.equal(cache_v[:, 4:7], quant.int8_kv_roundtrip(v)) and not cache_v[:, 7:].any()
    prompt = [1, 17, 42, 99, 7, 63]
    plain = minillm.generate(tiny, prompt, 8)
    assert len(minillm.generate(tiny, prompt, 8, append_fn=quant.int8_kv_append)) == len(plain)
