"""Labs 01 and 02: every check fed the right code, a stub, and deliberately wrong code (each
failure must name the problem), and every quiz question of the two banks fed its computed
answer and a wrong one. No model, no notebook: each check runs on tiny random tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from minillm import calc
from minillm.kv_cache import cached_attention as ref_attention
from minillm.kv_cache import kv_cache_append as ref_append
from quizzes import check
from quizzes.checks import CheckFailed, NotImplementedYet
from quizzes.questions import Choice, answer, expected, load_bank

SEEDS = (0, 1, 2)  # each check is run from several base seeds: a slip must show on every one


def fails(check_fn, fn, seed) -> str:
    with pytest.raises(CheckFailed) as info:
        check_fn(fn, seed=seed)
    return str(info.value)


def stub(*args, **kwargs):
    raise NotImplementedError("fill me in")


# ------------------------------------------------------------------ Lab 01: formulas

LAB01_GOOD = {
    "decode_ceiling": lambda n, b, bw, kv=0: bw / (n * b + kv),
    "matvec_intensity": lambda r, c, b: 2 * r * c / ((r * c + r + c) * b),
    "matmul_intensity": lambda m, n, k, b: 2 * m * n * k / ((m * k + k * n + m * n) * b),
    "ridge_point": lambda peak, bw: peak / bw,
    "decode_crossover_batch": calc.decode_crossover_batch,
}


@pytest.mark.parametrize("name", sorted(LAB01_GOOD))
def test_lab01_checks_pass_correct_code_and_flag_stubs(name, capsys):
    getattr(check, name)(LAB01_GOOD[name])
    assert capsys.readouterr().out.startswith(f"✓ {name}: matches the reference on")
    with pytest.raises(NotImplementedYet, match="not implemented yet"):
        getattr(check, name)(stub)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name, wrong, message", [
    ("decode_ceiling", lambda n, b, bw, kv: bw / (n * b), "You left out the KV cache"),
    ("decode_ceiling", lambda n, b, bw, kv: bw / (n + kv), "You left out dtype_bytes"),
    ("decode_ceiling", lambda n, b, bw, kv: bw / ((n + kv) * b), "kv_bytes is already in bytes"),
    ("decode_ceiling", lambda n, b, bw, kv: (n * b + kv) / bw, "Upside down: that is seconds per token"),
    ("decode_ceiling", lambda n, b, bw, kv: bw / (2 * (n * b + kv)), "No factor 2 here"),
    ("decode_ceiling", lambda n, b, bw, kv: None, "expected one number (a float), got NoneType"),
    ("matvec_intensity", lambda r, c, b: 2 / b, "You counted only W's bytes"),
    ("matvec_intensity", lambda r, c, b: r * c / ((r * c + r + c) * b), "a multiply-add is 2 FLOPs"),
    ("matmul_intensity", lambda m, n, k, b: 2 * m * n * k / (k * n * b), "You counted only B's bytes"),
    ("matmul_intensity", lambda m, n, k, b: 2 * m * n * k / ((m * k + k * n) * b), "You left out writing C"),
    ("matmul_intensity", lambda m, n, k, b: (m * k + k * n + m * n) * b / (2 * m * n * k), "Upside down"),
    ("ridge_point", lambda peak, bw: bw / peak, "Upside down: the ridge is in FLOPs per byte"),
    ("decode_crossover_batch", lambda f, w, k, r: r * w / f, "You left out the KV cache"),
    ("decode_crossover_batch", lambda f, w, k, r: r * w / (f - r * k), "expected math.inf"),
    ("decode_crossover_batch", lambda f, w, k, r: math.inf if f <= r * k else r * w / (f + r * k),
     "The KV term has the wrong sign"),
    ("decode_crossover_batch", lambda f, w, k, r: math.inf, "return math.inf only when no positive batch does"),
    ("ridge_point", lambda peak, bw: peak / bw * 1.1, "yours is 1.1 × the reference"),
])
def test_lab01_checks_name_the_slip(name, wrong, message, seed):
    msg = fails(getattr(check, name), wrong, seed)
    assert msg.startswith(f"✗ {name}: case "), msg
    assert message in msg, msg
    assert f"check.{name}(..., seed=" in msg


# ------------------------------------------------------------------ Lab 02: the cache


def good_append(k_cache, v_cache, k_new, v_new, start_pos):
    ref_append(k_cache, v_cache, k_new, v_new, start_pos)


def append_shifted(shift):
    def fn(k_cache, v_cache, k_new, v_new, start_pos):
        t = k_new.shape[1]
        k_cache[:, start_pos + shift:start_pos + shift + t] = k_new
        v_cache[:, start_pos + shift:start_pos + shift + t] = v_new
    return fn


def append_cat(k_cache, v_cache, k_new, v_new, start_pos):
    return torch.cat([k_cache, k_new], dim=1), torch.cat([v_cache, v_new], dim=1)


def append_swapped(k_cache, v_cache, k_new, v_new, start_pos):
    ref_append(k_cache, v_cache, v_new, k_new, start_pos)


def append_to_the_end(k_cache, v_cache, k_new, v_new, start_pos):  # overwrites the later slots too
    k_cache[:, start_pos:] = k_new[:, :1]
    v_cache[:, start_pos:] = v_new[:, :1]


def attention(q, k_cache, v_cache, start_pos, *, scale=None, keys_delta=0, mask=True, tile=False,
              out_layout="BTHD", dtype=None):
    """Plain attention with knobs for the slips students make."""
    B, T, Hq, D = q.shape
    S = start_pos + T + keys_delta
    k, v = k_cache[:, :S].transpose(1, 2), v_cache[:, :S].transpose(1, 2)
    g = Hq // k.shape[1]
    k, v = (k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)) if tile else (
        k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    scores = q.transpose(1, 2) @ k.transpose(-1, -2) * (1 / math.sqrt(D) if scale is None else scale)
    if mask:
        future = torch.arange(S)[None, :] > torch.arange(start_pos, start_pos + T)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    out = out.transpose(1, 2) if out_layout == "BTHD" else out
    return out.to(dtype) if dtype is not None else out


@pytest.mark.parametrize("name, good", [("kv_append", good_append), ("cached_attention", attention)])
def test_lab02_cache_checks_pass_correct_code_and_flag_stubs(name, good, capsys):
    getattr(check, name)(good)
    assert capsys.readouterr().out == f"✓ {name}: matches the reference on 4 random cases\n"
    with pytest.raises(NotImplementedYet, match="not implemented yet"):
        getattr(check, name)(stub)


def test_the_reference_functions_pass_their_own_checks(capsys):
    check.kv_append(ref_append)
    check.cached_attention(ref_attention)
    assert capsys.readouterr().out.count("✓") == 2


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("wrong, message", [
    (append_shifted(1), "off by +1"),
    (append_cat, "the K cache was not changed. Write into the tensor you were given, in place"),
    (append_swapped, "K and V are swapped"),
])
def test_kv_append_names_the_slip(wrong, message, seed):
    msg = fails(check.kv_append, wrong, seed)
    assert message in msg, msg


def test_kv_append_off_by_one_names_positions():
    msg = fails(check.kv_append, append_shifted(1), 0)
    assert "your new K was written at positions 1..1, but it belongs at start_pos..start_pos+T-1 = 0..0" in msg


def test_kv_append_that_overwrites_later_slots_names_the_first_wrong_position():
    msg = fails(check.kv_append, append_to_the_end, 0)
    assert "differs from the reference first at position 1" in msg
    assert "must not change" in msg and "yours" in msg and "reference" in msg


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kwargs, messages", [
    (dict(scale=1.0), ["values differ from the reference", "max error", "allowed |yours − reference| ≤",
                       "the scores are not scaled"]),
    (dict(keys_delta=-1, mask=False), ["first mismatch at", "one too few (off by one)"]),
    (dict(keys_delta=1, mask=False), ["one too many (off by one)"]),
    (dict(tile=True), ["query head h uses KV head h //", "repeat_interleave, not repeat"]),
    (dict(out_layout="BHTD"), ["shape: expected", "= [B, Hq, T, D]. Transpose back"]),
    (dict(dtype=torch.float32), ["dtype: expected float64, got float32"]),
])
def test_cached_attention_names_the_slip(kwargs, messages, seed):
    msg = fails(check.cached_attention, lambda q, k, v, s: attention(q, k, v, s, **kwargs), seed)
    for m in messages:
        assert m in msg, msg


def test_cached_attention_scale_slip_reports_max_error_against_tolerance():
    msg = fails(check.cached_attention, lambda q, k, v, s: attention(q, k, v, s, scale=1 / q.shape[-1]), 0)
    assert "the scores are scaled by 1/D; the scale is 1/√D" in msg
    assert "max error" in msg and "allowed |yours − reference| ≤ 1e-05 + 0.0001·|reference|" in msg


def test_cached_attention_missing_causal_mask_is_named():
    # cases 2 and 4 have T > 1 new tokens, where the mask matters
    msgs = []
    for seed in SEEDS:
        with pytest.raises(CheckFailed) as info:
            check.cached_attention(lambda q, k, v, s: attention(q, k, v, s, mask=False), seed=seed)
        msgs.append(str(info.value))
    assert all("the causal mask is missing" in m for m in msgs), msgs


def test_cached_attention_exception_names_the_line():
    def broken(q, k_cache, v_cache, start_pos):
        return q @ k_cache  # wrong shapes
    msg = fails(check.cached_attention, broken, 0)
    assert "your function raised RuntimeError" in msg


def test_student_functions_plug_into_generate(tiny_model):
    """The reference-equivalent functions the lab asks for give the same tokens as no cache."""
    from minillm import generate

    prompt = [5, 17, 3, 99, 42]
    ours = generate(tiny_model, prompt, 12, append_fn=good_append, attend_fn=attention, ignore_eos=True)
    assert ours == generate(tiny_model, prompt, 12, use_cache=False, ignore_eos=True)
    broken = generate(tiny_model, prompt, 12, append_fn=append_shifted(1), attend_fn=attention, ignore_eos=True)
    assert broken != ours  # the oracle catches an off-by-one in the append


# ------------------------------------------------------------------ Lab 02: sizes

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name, good, wrong, message", [
    ("kv_cache_bytes", calc.kv_cache_bytes, lambda L, h, d, s, b=2, B=1: L * h * d * s * b * B, "Missing the factor 2"),
    ("kv_cache_bytes", calc.kv_cache_bytes, lambda L, h, d, s, b=2, B=1: 2 * L * h * d * s * b, "You left out batch"),
    ("kv_cache_bytes", calc.kv_cache_bytes, lambda L, h, d, s, b=2, B=1: 2 * L * h * d * s * b * B / 1e9, "return bytes, not GB"),
    ("max_kv_heads", calc.max_kv_heads,
     lambda h, L, d, s, budget, db=2: int(budget // calc.kv_cache_bytes(L, 1, d, s, db)), "cannot be split evenly"),
    ("max_kv_heads", calc.max_kv_heads, lambda h, L, d, s, budget, db=2: 1, "1 is MQA"),
])
def test_size_checks(name, good, wrong, message, seed, capsys):
    getattr(check, name)(good, seed=seed)
    assert capsys.readouterr().out.startswith(f"✓ {name}")
    msg = fails(getattr(check, name), wrong, seed)
    assert message in msg, msg
    with pytest.raises(NotImplementedYet, match="not implemented yet"):
        getattr(check, name)(stub)


# ------------------------------------------------------------------ the quiz banks

BANK_IDS = [qid for bank in ("lab01", "lab02") for qid in load_bank(bank).ids()]


def _wrong_value(q, right):
    return right * 3 + 1  # outside every tolerance in these banks (the widest is 150%), not a units slip


@pytest.mark.parametrize("qid", BANK_IDS)
def test_bank_question_accepts_its_answer_and_rejects_a_wrong_one(qid):
    bank_name, local = qid.split(".")
    q = load_bank(bank_name).questions[local]
    if isinstance(q, Choice):
        right = expected(qid)
        assert answer(qid, right).correct
        wrong = next(o for o in q.options if not o.correct)
        result = answer(qid, wrong.text)
        assert not result.correct and result.status == "wrong" and wrong.why in result.message
        return
    measured = dict(q.example_measured)
    value = expected(qid, measured)
    assert answer(qid, f"{value!r} {q.unit}".strip(), measured_values=measured).correct
    bad = answer(qid, repr(_wrong_value(q, value)), measured_values=measured)
    assert not bad.correct and bad.status == "wrong", bad.message
    assert q.explanation


@pytest.mark.parametrize("qid, typed", [
    ("lab01.q1", "26 GB"), ("lab01.q2", "7 TB/s"), ("lab01.q3", "3.95"), ("lab01.q4", "247"),
    ("lab01.q5", "192"), ("lab01.q6", "2"), ("lab01.q8", "14 TFLOP"),
    ("lab02.q1", "8.05 GB"), ("lab02.q2", "30518"), ("lab02.q3", "8"), ("lab02.q4", "2.15 GB"),
    ("lab02.q5", "15"), ("lab02.q6", "59"), ("lab02.q7", "46 KB"),
])
def test_textbook_numbers_as_a_student_types_them(qid, typed):
    assert answer(qid, typed).correct, answer(qid, typed).message


def test_textbook_slips_get_useful_feedback():
    assert "Check your units" in answer("lab01.q1", "26e9").message  # bytes typed into a GB question
    assert not answer("lab02.q6", "59.6").correct                     # a sequence cannot be split
    assert not answer("lab02.q5", "15.0 GB").correct                  # sequences, not bytes
    assert not answer("lab01.q5", "156").correct                      # the ridge itself, KV ignored


def test_measured_questions_read_this_machines_values():
    compiled = {"compiled_step_ms": 17.1}
    assert answer("lab01.q9", "16.0 ms", measured_values=compiled).correct   # the bytes floor: 6% off
    assert not answer("lab01.q9", "23.0 ms", measured_values=compiled).correct  # eager's launch floor added
    assert answer("lab01.q9", "16", measured_values={}).status == "invalid"   # not measured yet
    prefill = {"prefill_tok_s": 629.0, "decode_tok_s": 36.2}
    assert answer("lab01.q12", "17.4x", measured_values=prefill).correct
    assert not answer("lab01.q12", "128", measured_values=prefill).correct    # tokens, not speed
    eager = {"eager_step_ms": 24.9}
    assert answer("lab01.q13", "27.0 ms", measured_values=eager).correct
    assert answer("lab01.q13", "0.027 s", measured_values=eager).correct
    assert not answer("lab01.q13", "2.5 ms", measured_values=eager).correct   # the launch floor alone
    prof = {"profile_step_ms": 32.0, "profile_weights_ms": 25.0}
    assert answer("lab01.q15", "1.64", measured_values=prof).correct          # 32 / (32 - 12.5)
    assert not answer("lab01.q15", "2", measured_values=prof).correct         # Amdahl ignored
    assert answer("lab02.q8", "12.1 MB", measured_values={"kv_bytes": 46080 * 263}).correct
    assert answer("lab02.q9", "12.0x", measured_values={"speedup_max": 12.3}).correct
    assert not answer("lab02.q9", "40x", measured_values={"speedup_max": 12.3}).correct
    assert answer("lab02.q13", "2.86 s", measured_values={"uncached_32_s": 3.0}).correct
    assert not answer("lab02.q13", "0.92 s", measured_values={"uncached_32_s": 3.0}).correct  # T × cached step


# ------------------------------------------------------------------ the oracles the labs added


def test_decode_crossover_batch_is_where_the_step_meets_the_ridge():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        f, w, ridge = (float(x) for x in torch.rand(3, generator=gen) * torch.tensor([1e11, 1e11, 300]) + 1)
        k = float(torch.rand(1, generator=gen)) * f / ridge * 2  # half the cases never reach it
        b = calc.decode_crossover_batch(f, w, k, ridge)
        if f <= ridge * k:
            assert b == math.inf
        else:
            assert b * f / (w + b * k) == pytest.approx(ridge, rel=1e-9)
    assert calc.decode_crossover_batch(140e9, 140e9, 0, 156) == pytest.approx(156)  # no KV: B = ridge·W/f
    with pytest.raises(ValueError, match="ridge"):
        calc.decode_crossover_batch(1e9, 1e9, 0, 0)


def test_max_kv_heads_is_the_largest_divisor_that_fits():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        h = int(torch.randint(1, 65, (1,), generator=gen))
        layers, d, seq = int(torch.randint(1, 40, (1,), generator=gen)), 64, int(torch.randint(1, 9000, (1,), generator=gen))
        per_head = calc.kv_cache_bytes(layers, 1, d, seq, 2)
        budget = float(torch.rand(1, generator=gen)) * (h + 1) * per_head
        want = max([g for g in range(1, h + 1) if h % g == 0 and calc.kv_cache_bytes(layers, g, d, seq, 2) <= budget],
                   default=0)
        assert calc.max_kv_heads(h, layers, d, seq, budget) == want
    assert calc.max_kv_heads(64, 80, 128, 32768, 8e9) == 4   # 5 fit by bytes; 5 does not divide 64
    assert calc.max_kv_heads(64, 80, 128, 32768, 1e9) == 0   # not even MQA

