"""Lab 03: its checks fed right and deliberately wrong code, the Triton lab scaffold, the
attention-variants widget, and the quiz bank.

Every wrong version must fail with a message that names its mistake; the stubs the release
tool writes into labs/03-attention.ipynb must report "not implemented yet". Triton inner
loops are written to small modules in a temporary folder (Triton reads a kernel's source),
from one template with the mistake swapped in. The Triton checks run in the CPU
interpreter on T <= 48, so the whole file takes well under a minute.
"""
from __future__ import annotations

import importlib.util
import json
import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from minillm import calc  # noqa: E402
from minillm.config import ModelConfig  # noqa: E402
from minillm.kernels import tiled  # noqa: E402
from quizzes import check  # noqa: E402
from quizzes.checks import CheckFailed, NotImplementedYet  # noqa: E402
from quizzes.questions import answer, expected, load_bank  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234  # fixed seeds: a wrong version must fail the same way on every run


def failure(fn, *args, **kw) -> str:
    with pytest.raises(CheckFailed) as info:
        fn(*args, seed=SEED, **kw)
    return str(info.value)


# ----------------------------------------------------------------------- 1. online softmax update

ref_update = tiled.online_softmax_update


def _pieces(m, l, acc, s):
    m_new = torch.maximum(m, s.amax(-1))
    m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    return m_new, m_safe, torch.exp(m - m_safe), torch.exp(s - m_safe[..., None])


def upd_no_rescale_acc(m, l, acc, s, v):
    m_new, _, alpha, p = _pieces(m, l, acc, s)
    return m_new, l * alpha + p.sum(-1), acc + p @ v


def upd_no_rescale_l(m, l, acc, s, v):
    m_new, _, alpha, p = _pieces(m, l, acc, s)
    return m_new, l + p.sum(-1), acc * alpha[..., None] + p @ v


def upd_block_max(m, l, acc, s, v):  # the "wrong max": forgets the old running max
    _, _, alpha, p = _pieces(m, l, acc, s)
    return s.amax(-1), l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def upd_unsafe(m, l, acc, s, v):  # textbook formula, NaN on rows that saw only -inf
    m_new = torch.maximum(m, s.amax(-1))
    alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def upd_inverse_alpha(m, l, acc, s, v):
    m_new, m_safe, _, p = _pieces(m, l, acc, s)
    inv = torch.exp(m_safe - m)
    return m_new, l * inv + p.sum(-1), acc * inv[..., None] + p @ v


def test_update_accepts_the_reference(capsys):
    check.online_softmax_update(ref_update)
    assert "✓ online_softmax_update: matches the reference on 3 random cases" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (upd_no_rescale_acc, "acc was not rescaled"),
    (upd_no_rescale_l, "l was not rescaled"),
    (upd_block_max, "m is the max of this block only"),
    (upd_unsafe, "NaN in rows that have seen only −inf"),
    (upd_inverse_alpha, "upside down"),
])
def test_update_names_the_mistake(fn, words):
    msg = failure(check.online_softmax_update, fn)
    assert words in msg, msg
    assert "yours (* = differs)" in msg or "NaN" in msg  # the side-by-side view or the NaN note


def test_update_wrong_return_and_stub():
    assert "return the new state as a tuple (m, l, acc)" in failure(
        check.online_softmax_update, lambda m, l, acc, s, v: (m, l))

    def stub(m, l, acc, scores_block, v_block):
        raise NotImplementedError("alpha = exp(m - m_new)")

    with pytest.raises(NotImplementedYet, match="not implemented yet") as info:
        check.online_softmax_update(stub)
    assert "Hint: alpha = exp(m - m_new)" in str(info.value)


# ----------------------------------------------------------------------- 2. tiled attention


def make_tiled(update=ref_update, mask="ok", scale=None, skip_tail=False, divide=True):
    """A student's tiled attention, optionally with one mistake."""

    def tiled_attention(q, k, v, causal=True, block_n=16):
        t, d = q.shape[-2], q.shape[-1]
        sc = 1 / math.sqrt(d) if scale is None else scale(d)
        m = q.new_full(q.shape[:-1], float("-inf"))
        l, acc = q.new_zeros(q.shape[:-1]), torch.zeros_like(q)
        i = torch.arange(t)[:, None]
        for n0 in range(0, t, block_n):
            n1 = min(n0 + block_n, t)
            if skip_tail and n1 - n0 < block_n:
                break
            s = q @ k[..., n0:n1, :].transpose(-1, -2) * sc
            j = torch.arange(n0, n1)[None, :]
            if causal:
                hide = {"ok": j > i, "strict": j >= i, "local": (j - n0) > i}[mask]
                s = s.masked_fill(hide, float("-inf"))
            m, l, acc = update(m, l, acc, s, v[..., n0:n1, :])
        return acc / l[..., None] if divide else acc

    return tiled_attention


def upd_no_max(m, l, acc, s, v):  # a running sum of exp(s) with no max: overflows
    p = torch.exp(s)
    return m, l + p.sum(-1), acc + p @ v


def test_tiled_accepts_correct_code(capsys):
    check.tiled_attention(make_tiled())
    check.tiled_attention(lambda q, k, v, causal=True, block_n=16:
                          tiled.tiled_attention(q, k, v, causal=causal, block_n=block_n))
    assert capsys.readouterr().out.count("✓ tiled_attention") == 2


@pytest.mark.parametrize("kw, words", [
    (dict(mask="strict"), "off-by-one causal mask"),
    (dict(mask="local"), "the key's position inside the tile"),
    (dict(scale=lambda d: 1 / d), "wrong scale: yours uses 1/D"),
    (dict(scale=lambda d: 1.0), "wrong scale: yours matches softmax(q·kᵀ) with no scale"),
    (dict(update=upd_no_rescale_acc), "acc was not rescaled"),
    (dict(skip_tail=True), "the last, shorter tile was skipped"),
    (dict(divide=False), "unnormalized accumulator"),
    (dict(update=upd_no_max), "overflowed to inf/NaN"),
])
def test_tiled_names_the_mistake(kw, words):
    msg = failure(check.tiled_attention, make_tiled(**kw))
    assert words in msg, msg
    assert "rows = queries" in msg and "✗" in msg  # yours vs reference, wrong rows marked


def test_tiled_stub_is_not_implemented():
    def stub(q, k, v, causal=True, block_n=16):
        raise NotImplementedError("loop over tiles")

    with pytest.raises(NotImplementedYet, match="not implemented yet"):
        check.tiled_attention(stub)


# ----------------------------------------------------------------------- 3. the Triton inner loop

LOOP = '''
import triton
import triton.language as tl


@triton.jit
def attn_inner_loop(acc, m_i, l_i, q, k_base, v_base, offs_m, offs_d, hi, seq_len, sm_scale,
                    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
{BODY}
    return acc, m_i, l_i
'''
BODY = '''
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < seq_len
        tile = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_base + tile, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + tile, mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)){SCALE}
        keep = {KEYMASK}
        if CAUSAL:
            keep = keep & (offs_n[None, :] {CMP} offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = {MNEW}
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = {ACC} + tl.dot(p.to(v.dtype), v)
        m_i = m_new
'''
RIGHT = dict(SCALE=" * sm_scale", KEYMASK="key_ok[None, :]", CMP="<=",
             MNEW="tl.maximum(m_i, tl.max(s, 1))", ACC="acc * alpha[:, None]")


def load_loop(tmp_path, name: str, body: str):
    path = tmp_path / f"{name}.py"
    path.write_text(LOOP.replace("{BODY}", textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")))
    spec = importlib.util.spec_from_file_location(f"lab03_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.attn_inner_loop


def loop_with(tmp_path, name: str, **mistake):
    return load_loop(tmp_path, name, BODY.format(**{**RIGHT, **mistake}))


def test_triton_check_accepts_a_correct_loop(tmp_path, capsys):
    check.flash_inner_loop(loop_with(tmp_path, "right"))
    assert "✓ flash_inner_loop: matches the reference on 3 random cases" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, words", [
    (dict(CMP="<"), "off-by-one causal mask"),
    (dict(ACC="acc"), "acc was not rescaled"),
    (dict(SCALE=""), "wrong scale: yours matches softmax(q·kᵀ) with no scale"),
    (dict(MNEW="tl.max(s, 1)"), "overflowed to inf/NaN"),  # the wrong max: exact until exp overflows
    (dict(KEYMASK="offs_n[None, :] >= 0"), "keys past the end of the sequence"),
])
def test_triton_check_names_the_mistake(tmp_path, mistake, words):
    msg = failure(check.flash_inner_loop, loop_with(tmp_path, "wrong", **mistake))
    assert words in msg, msg
    assert "yours vs reference" in msg and "rows = queries" in msg and "✗" in msg


def test_triton_stub_is_not_implemented_and_never_launched(tmp_path):
    stub = load_loop(tmp_path, "stub", '# HINT: loop over the tiles\nraise NotImplementedError("loop over the tiles")')
    with pytest.raises(NotImplementedYet) as info:
        check.flash_inner_loop(stub)
    assert "not implemented yet" in str(info.value) and "Hint: loop over the tiles" in str(info.value)


def test_triton_check_explains_other_failures(tmp_path):
    def plain(*args):  # forgot @triton.jit
        return args[:3]

    assert "decorated with @triton.jit" in failure(check.flash_inner_loop, plain)
    broken = load_loop(tmp_path, "broken", "acc = acc + undefined_name")
    msg = failure(check.flash_inner_loop, broken)
    assert "your function raised NameError" in msg and "undefined_name" in msg, msg


def test_lab_kernel_rejects_bad_arguments(tmp_path):
    from minillm.kernels.lab import flash_attention_lab

    q = torch.randn(1, 1, 20, 16)
    with pytest.raises(TypeError, match="@triton.jit"):
        flash_attention_lab(q, q, q, lambda *a: a)
    with pytest.raises(ValueError, match="head_dim must be 16, 32, 64 or 128"):
        flash_attention_lab(torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 8),
                            loop_with(tmp_path, "right"))


# ----------------------------------------------------------------------- 4. the released stubs


def test_every_stub_in_the_lab_reports_not_implemented(tmp_path):
    """Run the exercise cells of the generated lab as the student first sees them."""
    import nbformat

    from quizzes.release import build_lab, tag_value

    lab = build_lab(nbformat.read(ROOT / "solutions" / "03-attention.ipynb", as_version=4), "03-attention.ipynb")
    cells = {tag_value(c, "exercise"): c.source for c in lab.cells if tag_value(c, "exercise")}
    assert set(cells) == {"online_softmax_update", "tiled_attention", "flash_inner_loop"}
    module = tmp_path / "student.py"  # Triton needs the jitted function's source in a file
    module.write_text("import torch\nimport triton\nimport triton.language as tl\n\n" + "\n\n".join(cells.values()))
    spec = importlib.util.spec_from_file_location("lab03_student", module)
    student = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(student)
    for name, fn in (("online_softmax_update", student.online_softmax_update),
                     ("tiled_attention", student.tiled_attention),
                     ("flash_inner_loop", student.attn_inner_loop)):
        with pytest.raises(NotImplementedYet, match=f"✗ {name}: not implemented yet") as info:
            getattr(check, name)(fn)
        assert "Hint: " in str(info.value)


# ----------------------------------------------------------------------- 5. the widget


def test_widget_numbers_match_calc():
    from widgets import attention_variants as av

    data = av.attention_variants_data(4096, 4, measure=False)
    smol = ModelConfig.smollm2_135m()
    assert [v.num_kv_heads for v in data.variants.values()] == [9, 3, 1]
    for v in data.variants.values():
        assert v.reduction == calc.gqa_reduction(9, v.num_kv_heads)
        assert v.kv_bytes_per_token == calc.kv_cache_bytes_per_token(30, v.num_kv_heads, 64, 2)
        assert v.kv_bytes_per_seq == calc.kv_cache_bytes(30, v.num_kv_heads, 64, 4096, 2)
        assert v.step_kv_bytes == calc.kv_cache_bytes(4, v.num_kv_heads, 64, 4097, 4, 4)
        cfg = av.variant_config(v.name, smol, 4, 1024)
        assert v.step_weight_bytes == cfg.num_params() * 4
        assert v.step_s is None and v.achieved_bytes_per_s is None
    assert data.variants["GQA"].kv_bytes_per_token == 23_040  # SmolLM2 in fp16, as in Lab 02
    assert data.variants["MHA"].kv_bytes_per_token == 3 * data.variants["GQA"].kv_bytes_per_token
    assert "1× / 3× / 9× smaller than MHA" in data.summary[0]
    fig = av.draw_attention_variants(data)
    assert fig.axes


TINY = ModelConfig.tiny()  # 4 query heads of 16 dims: MHA 4, GQA 2, MQA 1 KV heads


def test_widget_measures_each_variant():
    from widgets import attention_variants as av

    data = av.attention_variants_data(32, 2, base=TINY, num_layers=1, vocab_size=64, repeats=1,
                                      bandwidth_bytes_per_s=10e9)
    assert [v.num_kv_heads for v in data.variants.values()] == [4, 2, 1]
    for v in data.variants.values():
        assert v.step_s > 0
        assert v.achieved_bytes_per_s == pytest.approx(v.step_bytes / v.step_s)
    assert any("of it" in line for line in data.summary)  # the fraction of the bandwidth
    with pytest.raises(ValueError, match="expected 2 and 1"):
        models = av.build_models(TINY, 1, 64, 64)
        models["GQA"] = models["MHA"]
        av.attention_variants_data(32, 1, base=TINY, num_layers=1, vocab_size=64, models=models)


def test_widget_view_reacts_to_its_controls():
    from widgets import attention_variants as av

    view = av.AttentionVariantsView(16, 1, base=TINY, num_layers=1, vocab_size=64, context_lens=(16, 48),
                                    batch_sizes=(1, 2), repeats=1)
    assert view.error is None and view.renders == 1 and view.data.context_len == 16
    view.controls["context_len"].value = 48
    assert view.data.context_len == 48 and view.renders == 2
    view.controls["batch"].value = 2
    assert view.data.batch == 2 and view.renders == 3
    assert view.data.variants["MHA"].step_kv_bytes == calc.kv_cache_bytes(1, 4, 16, 49, 4, 2)
    assert view.png.startswith(b"\x89PNG") and view.output.outputs and view.summary.value
    assert "minillm-attention-variants" in view.box._dom_classes


def test_memory_benchmark_table(tmp_path):
    from widgets import attention_variants as av

    rows, hw = av.load_memory_benchmark()  # the committed measurement
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows) and hw
    for r in rows:
        assert r["score_matrix_bytes"] == calc.attention_matrix_bytes(r["t"], 4, num_heads=9)
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({"hardware": {"device": "x"}, "memory": [
        dict(t=1024, naive_extra_peak_bytes=100e6, tiled_extra_peak_bytes=10e6, score_matrix_bytes=37748736)]}))
    rows, _ = av.load_memory_benchmark(path)
    assert "10.0×" in av.format_memory_table(rows)
    rows[0]["tiled_extra_peak_bytes"] = 0  # RSS growth can round to nothing: no division by zero
    assert "—" in av.format_memory_table(rows)
    with pytest.raises(FileNotFoundError, match="benchmarks/attention.py"):
        av.load_memory_benchmark(tmp_path / "missing.json")


@pytest.mark.slow
def test_attention_peak_growth_is_quadratic_for_naive_even_under_a_big_parent():
    """Measured in a fresh process: naive attention's peak grows about 4× per doubling of T,
    and a parent with a large resident set (a Jupyter kernel holding a model) does not hide
    it (Linux carries ru_maxrss across fork + exec; the child reads its own VmHWM)."""
    from minillm.measure import attention_peak_growth

    ballast = torch.ones(64, 2**20)  # 256 MB resident in this process
    ballast += 1
    small, large = (attention_peak_growth("naive_attention", t) for t in (1024, 2048))
    assert small > 3 * 9 * 1024 * 1024 * 4 * 0.8  # about three [9, T, T] fp32 matrices
    assert 3.0 < large / small < 5.0
    with pytest.raises(ValueError, match="impl must be one of"):
        attention_peak_growth("flash", 512)


def test_sliding_window_and_rope_scaling_formulas():
    from minillm.model import rope_cos_sin

    assert calc.sliding_window_kv_tokens(32768, 4096) == 4096 and calc.sliding_window_kv_tokens(100, 4096) == 100
    d, theta, s = 64, 100000.0, 4
    wave = calc.rope_max_wavelength(d, theta)
    inv_slowest = theta ** (-(d - 2) / d)   # the slowest pair's angle per position
    assert wave == pytest.approx(2 * math.pi / inv_slowest)
    ntk = calc.rope_ntk_theta(theta, s, d)
    assert calc.rope_max_wavelength(d, ntk) == pytest.approx(s * wave)
    # on minillm's own tables: position s·L with θ' is where position L was with θ (slowest pair)
    cos, _ = rope_cos_sin(d, s * 1000 + 1, theta)
    cos_ntk, _ = rope_cos_sin(d, s * 1000 + 1, ntk)
    assert cos_ntk[s * 1000, d // 2 - 1] == pytest.approx(float(cos[1000, d // 2 - 1]), abs=1e-6)
    assert cos_ntk[1, 0] == cos[1, 0]  # the fastest pair does not move
    for bad in (lambda: calc.rope_ntk_theta(theta, 0.5, d), lambda: calc.rope_max_wavelength(63, theta),
                lambda: calc.sliding_window_kv_tokens(10, 0)):
        with pytest.raises(ValueError):
            bad()


# ----------------------------------------------------------------------- 6. the quiz bank


def test_bank_accepts_its_computed_answers():
    bank = load_bank("lab03")
    assert len(bank.questions) >= 8
    for qid, q in bank.questions.items():
        got = expected(f"lab03.{qid}", getattr(q, "example_measured", None) or None)
        res = answer(f"lab03.{qid}", got if isinstance(got, str) else f"{got}", getattr(q, "example_measured", None) or None)
        assert res.correct, (qid, res.message)


def test_bank_numbers_are_the_books():
    assert expected("lab03.q1") == pytest.approx(8.590 - 1.074, rel=1e-3)  # full at 64K minus the window
    assert not answer("lab03.q1", "1.07 GB").correct  # the window's cache, not what it saves
    assert expected("lab03.q2") == pytest.approx(16 * (1.342 - 0.168), rel=2e-3)
    assert expected("lab03.q4") == pytest.approx(68.72, rel=1e-3)
    assert answer("lab03.q4", "64 GiB").correct
    assert expected("lab03.q9") == pytest.approx(16.0, rel=1e-2)
    assert expected("lab03.q10") == pytest.approx(3.2, rel=1e-2)
    m = {"mha_step_ms": 100.0, "mqa_step_ms": 40.0, "mha_step_bytes": 400e6, "mqa_step_bytes": 100e6}
    assert expected("lab03.q3", m) == pytest.approx(5.0)  # 300 MB more in 60 ms more
    assert answer("lab03.q3", "5 GB/s", m).correct and not answer("lab03.q3", "4 GB/s", m).correct  # 400 MB / 100 ms
    m = {"naive_peak_2048_MB": 464.0}  # predicted as 4 × the 1,024 measurement (119 MB here)
    assert answer("lab03.q5", "476 MB", m).correct and not answer("lab03.q5", "238 MB", m).correct
    m = {"attn_decode_16k_ms": 16.4}  # predicted as 2 × the 8,192-token call (8.3 ms here)
    assert answer("lab03.q11", "16.6 ms", m).correct and not answer("lab03.q11", "8.3 ms", m).correct