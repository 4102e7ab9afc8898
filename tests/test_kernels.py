"""Attention kernels against a float64 reference, on fresh random inputs.

Oracle: ``naive_attention`` run in float64 (itself checked against torch's SDPA below).
Inputs come from ``torch.randn`` with a per-test seed (never zeros); outputs are written
into NaN-poisoned buffers, so a row the kernel forgets to store shows up as NaN.

On a machine without CUDA (the usual case here) the kernels run in Triton's interpreter
in fp32; ``minillm.kernels`` switches the interpreter on by itself. With CUDA the same tests
run the compiled kernels in fp16 and bf16 (those tolerances are untested so far).
The whole file takes well under 3 minutes on 2 CPU cores: keep sizes small.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from minillm.attention import paged_decode_attention_ref
from minillm.kernels import (
    flash_attention,
    flash_attention_varlen,
    naive_attention,
    online_softmax_update,
    paged_decode_attention,
    tiled_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tolerances against the float64 reference. fp32 (interpreter): each output element is a
# convex combination of <= 64 values of |v| < 5, built from length-64 dot products, exp2
# and rescales, each exact to a few fp32 ulps (6e-8 relative); the measured max error is
# ~5e-7, so 2e-5 leaves 40x headroom while any real bug (a missed rescale, an off-by-one
# mask, a wrong KV head) gives errors above 1e-2. fp16 / bf16: P is rounded to the input
# dtype before the P @ V product and the output is stored in it, so the error is a few
# ulps of that dtype (fp16 ulp 1e-3, bf16 ulp 8e-3 near 1).
TOLERANCES = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's own id: fresh inputs per test, reproducible."""
    g = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


def reference(q, k, v, causal=True, sm_scale=None, return_lse=False):
    return naive_attention(q.double(), k.double(), v.double(), causal=causal, sm_scale=sm_scale,
                           return_lse=return_lse)


def assert_close(actual, expected, dtype, what=""):
    tol = TOLERANCES[dtype]
    assert not actual.isnan().any(), f"{what}: NaN in output (a row not written, or 0/0)"
    err = (actual.double() - expected.double()).abs()
    bad = err > tol + tol * expected.double().abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max abs "
                           f"error {err.max().item():.3g} > tol {tol:g}; first bad index "
                           f"{tuple(bad.nonzero()[0].tolist())}")


def poisoned_like(t):
    return torch.full_like(t, float("nan"))


# ----------------------------------------------------------------------------- the oracle


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,t,s", [(3, 3, 37, 37), (9, 3, 20, 45)])
def test_naive_attention_matches_torch_sdpa(gen, causal, hq, hkv, t, s):
    q = randn(gen, 2, hq, t, 64).double().cpu()
    k = randn(gen, 2, hkv, s, 64).double().cpu()
    v = randn(gen, 2, hkv, s, 64).double().cpu()
    mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t) if causal else None
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1), attn_mask=mask)
    torch.testing.assert_close(naive_attention(q, k, v, causal=causal), want, atol=1e-12, rtol=1e-12)


def test_naive_attention_rows_that_see_no_key_are_zero(gen):
    q, k, v = randn(gen, 1, 2, 8, 16).cpu(), randn(gen, 1, 2, 5, 16).cpu(), randn(gen, 1, 2, 5, 16).cpu()
    out, lse = naive_attention(q, k, v, causal=True, return_lse=True)  # S < T: rows 0..2 see nothing
    assert (out[:, :, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()
    assert not out.isnan().any()


# ----------------------------------------------------------------------------- teaching steps


def test_online_softmax_update_block_by_block_equals_softmax(gen):
    scores = randn(gen, 3, 5, 40).double().cpu()
    scores[0, 0, :25] = float("-inf")  # a row whose first blocks are fully masked
    v = randn(gen, 3, 40, 8).double().cpu()
    m = torch.full((3, 5), float("-inf"), dtype=torch.float64)
    l = torch.zeros(3, 5, dtype=torch.float64)
    acc = torch.zeros(3, 5, 8, dtype=torch.float64)
    for n0 in range(0, 40, 12):  # blocks of 12, 12, 12, 4
        m, l, acc = online_softmax_update(m, l, acc, scores[..., n0:n0 + 12], v[:, n0:n0 + 12])
        assert not (m.isnan().any() or l.isnan().any() or acc.isnan().any()), "NaN after a masked block"
    torch.testing.assert_close(acc / l[..., None], torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(m + l.log(), torch.logsumexp(scores, -1))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t,s,block_m,block_n", [(37, 37, 16, 16), (20, 45, 7, 16), (40, 20, 16, 5)])
def test_tiled_attention_matches_reference(gen, causal, t, s, block_m, block_n):
    q, k, v = randn(gen, 2, 9, t, 64), randn(gen, 2, 3, s, 64), randn(gen, 2, 3, s, 64)
    out, lse = tiled_attention(q.double(), k.double(), v.double(), causal=causal,
                               block_m=block_m, block_n=block_n, return_lse=True)
    want, want_lse = reference(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- flash_attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(3, 3), (9, 3), (9, 1)])  # GQA ratios 1, 3, 9
@pytest.mark.parametrize("t,s", [(37, 37), (50, 50), (20, 45), (40, 20), (1, 33)])
def test_flash_attention_matches_reference(gen, dtype, causal, hq, hkv, t, s):
    # (37, 37), (50, 50): T not a multiple of the tile; (20, 45): queries after a cached
    # prefix (bottom-right causal); (40, 20): S < T, causal rows 0..19 see no key -> 0;
    # (1, 33): a single query.
    q, k, v = randn(gen, 1, hq, t, 64, dtype=dtype), randn(gen, 1, hkv, s, 64, dtype=dtype), \
        randn(gen, 1, hkv, s, 64, dtype=dtype)
    out = poisoned_like(q)
    got, lse = flash_attention(q, k, v, causal=causal, return_lse=True, out=out)
    assert got is out and got.dtype == dtype and lse.dtype == torch.float32
    want, want_lse = reference(q, k, v, causal=causal, return_lse=True)
    assert_close(got, want, dtype, f"out (hq={hq}, hkv={hkv}, t={t}, s={s}, causal={causal})")
    hidden = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), hidden), "lse must be -inf exactly for rows that see no key"
    assert_close(lse[~hidden], want_lse[~hidden], torch.float32, "lse")


def test_flash_attention_batch_strides_scale_and_head_dim(gen):
    # Batch 2, inputs in [B, T, H, D] memory viewed as [B, H, T, D] (non-contiguous, like a
    # model's projection output), a custom scale and a head_dim that is not a power of 2.
    q = randn(gen, 2, 29, 6, 48).transpose(1, 2)
    k = randn(gen, 2, 29, 2, 48).transpose(1, 2)
    v = randn(gen, 2, 29, 2, 48).transpose(1, 2)
    got = flash_attention(q, k, v, causal=True, sm_scale=0.3)
    assert_close(got, reference(q, k, v, causal=True, sm_scale=0.3), torch.float32, "strided")


@pytest.mark.skipif(DEVICE != "cpu", reason="fp16 on the interpreter; the CUDA run covers fp16")
def test_flash_attention_fp16_on_interpreter(gen):
    q, k, v = randn(gen, 1, 3, 37, 64), randn(gen, 1, 1, 37, 64), randn(gen, 1, 1, 37, 64)
    got = flash_attention(q.half(), k.half(), v.half())
    assert got.dtype == torch.float16
    assert_close(got, reference(q.half(), k.half(), v.half()), torch.float16, "fp16")


# ----------------------------------------------------------------------------- varlen


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,lens_q,lens_k", [
    (9, 3, [1, 17, 5, 33], [1, 17, 5, 33]),  # plain prefill, ragged, one of length 1
    (9, 3, [1, 17, 3, 16], [30, 40, 3, 33]),  # chunks after cached prefixes (len_k > len_q)
    (9, 9, [4, 1], [4, 50]),                  # one decode-like row with a long prefix
])
def test_flash_attention_varlen_matches_per_sequence_reference(gen, dtype, causal, hq, hkv, lens_q, lens_k):
    q = randn(gen, sum(lens_q), hq, 64, dtype=dtype)
    k = randn(gen, sum(lens_k), hkv, 64, dtype=dtype)
    v = randn(gen, sum(lens_k), hkv, 64, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out = poisoned_like(q)
    got = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, out=out)
    assert got is out
    for i in range(len(lens_q)):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)[None]  # [1, Hq, len_q, D]
        ks = k[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None]
        vs = v[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None]
        want = reference(qs, ks, vs, causal=causal)[0].transpose(0, 1)
        assert_close(got[cu_q[i]:cu_q[i + 1]], want, dtype,
                     f"sequence {i} (len_q={lens_q[i]}, len_k={lens_k[i]}, causal={causal})")


def test_flash_attention_varlen_accepts_int64_cu_seqlens(gen):
    # torch's default integer dtype is int64; the wrapper converts cu_seqlens to the int32
    # the kernel reads, so the result is the int32 one, bit for bit.
    lens_q, lens_k = [1, 17, 3], [30, 17, 3]
    dtype = DTYPES[0]
    q = randn(gen, sum(lens_q), 9, 64, dtype=dtype)
    k = randn(gen, sum(lens_k), 3, 64, dtype=dtype)
    v = randn(gen, sum(lens_k), 3, 64, dtype=dtype)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    want = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    got = flash_attention_varlen(q, k, v, cu_q.long(), cu_k.long(), max(lens_q), max(lens_k),
                                 out=poisoned_like(q))
    assert torch.equal(got, want), "int64 cu_seqlens give a different result than int32 ones"


# ----------------------------------------------------------------------------- paged decode


def _paged_case(gen, ctx, hq, hkv, block_size, dtype, num_blocks=None):
    """Caches full of random K/V, each sequence on a random, shuffled set of blocks."""
    max_blocks = max(-(-n // block_size) for n in ctx) + 1  # one spare column, never read
    num_blocks = num_blocks or len(ctx) * max_blocks + 3
    k_cache = randn(gen, num_blocks, block_size, hkv, 64, dtype=dtype)
    v_cache = randn(gen, num_blocks, block_size, hkv, 64, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(ctx), max_blocks), -1, dtype=torch.int32)  # unused entries: -1
    used = 0
    for i, n in enumerate(ctx):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    q = randn(gen, len(ctx), hq, 64, dtype=dtype)
    return q, k_cache, v_cache, tables.to(DEVICE), torch.tensor(ctx, dtype=torch.int32, device=DEVICE)


def _paged_reference(q, k_cache, v_cache, tables, ctx):
    outs = []
    for i, n in enumerate(ctx.tolist()):
        blocks = tables[i, : -(-n // k_cache.shape[1])].long()
        ks = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]  # [1, Hkv, n, D]
        vs = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]
        outs.append(reference(q[i][None, :, None], ks, vs, causal=False)[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("hq,hkv", [(3, 3), (9, 3), (9, 1)])
def test_paged_decode_matches_reference(gen, dtype, num_splits, hq, hkv):
    ctx = [1, 15, 16, 17, 40]  # around the block boundary of 16
    q, kc, vc, tables, lens = _paged_case(gen, ctx, hq, hkv, 16, dtype)
    out = poisoned_like(q)
    got = paged_decode_attention(q, kc, vc, tables, lens, num_splits=num_splits, out=out)
    assert got is out
    assert_close(got, _paged_reference(q, kc, vc, tables, lens), dtype,
                 f"paged decode hq={hq} hkv={hkv} num_splits={num_splits}")


@pytest.mark.parametrize("block_size,num_splits", [(4, 5), (32, 2)])
def test_paged_decode_other_block_sizes(gen, block_size, num_splits):
    ctx = [3, 4, 5, 70]  # splits of 14 (5 splits) or 35 (2) positions; short sequences leave splits empty
    dtype = DTYPES[0]
    q, kc, vc, tables, lens = _paged_case(gen, ctx, 9, 3, block_size, dtype)
    got = paged_decode_attention(q, kc, vc, tables, lens, sm_scale=0.2, num_splits=num_splits,
                                 max_context_len=max(ctx))
    outs = []
    for i, n in enumerate(ctx):  # reference with the custom scale
        blocks = tables[i, : -(-n // block_size)].long()
        ks = kc[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]
        vs = vc[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]
        outs.append(reference(q[i][None, :, None], ks, vs, causal=False, sm_scale=0.2)[0, :, 0])
    assert_close(got, torch.stack(outs), dtype, f"block_size={block_size}")


def test_paged_decode_splits_only_long_contexts():
    """The split-K heuristic (pure arithmetic, no GPU needed): on an H100 (132 SMs) batch 1
    at context 1024 runs as one launch (split into 4 it took twice as long: BENCHMARKS.md),
    long contexts still split to fill the GPU, and no split is shorter than
    MIN_SPLIT_TOKENS. The kernel's results at any split count are checked above."""
    from minillm.kernels.paged_decode import MIN_SPLIT_TOKENS, _num_splits_for

    h100 = 132
    assert _num_splits_for(1, 3, 1024, h100) == 1
    assert _num_splits_for(16, 3, 1024, h100) == 1
    assert _num_splits_for(1, 3, 2 * MIN_SPLIT_TOKENS - 1, h100) == 1
    assert _num_splits_for(1, 3, 8192, h100) == 8
    assert _num_splits_for(16, 3, 8192, h100) == 6  # two waves: 264 programs / 48
    assert _num_splits_for(256, 3, 8192, h100) == 1  # the batch alone fills the GPU
    for batch in (1, 2, 7, 64, 300):
        for ctx in (1, 100, 1024, 2047, 2048, 5000, 32768):
            for sms in (1, 108, 132):
                n = _num_splits_for(batch, 3, ctx, sms)
                assert n >= 1 and (n == 1 or ctx // n >= MIN_SPLIT_TOKENS), (batch, ctx, sms)
                assert n == 1 or batch * 3 * (n - 1) < 2 * sms, (batch, ctx, sms)  # <= 2 waves


def test_paged_decode_accepts_int64_tables_and_lengths(gen):
    # Block tables and lengths built with torch's default integer dtype (int64) are
    # converted to int32 by the wrapper: same result as int32 ones, and as the reference.
    ctx = [1, 15, 16, 17, 40]
    dtype = DTYPES[0]
    q, kc, vc, tables, lens = _paged_case(gen, ctx, 9, 3, 16, dtype)
    tables64, lens64 = tables.long(), lens.long()
    want = paged_decode_attention(q, kc, vc, tables, lens, num_splits=2)
    got = paged_decode_attention(q, kc, vc, tables64, lens64, num_splits=2, out=poisoned_like(q))
    assert tables64.dtype == lens64.dtype == torch.int64  # the caller's tensors are untouched
    assert torch.equal(got, want), "int64 block_tables/context_lens give a different result than int32"
    assert_close(got, paged_decode_attention_ref(q, kc, vc, tables64, lens64), dtype,
                 "int64 block_tables/context_lens vs paged_decode_attention_ref")


def test_paged_decode_equals_flash_attention_last_row(gen):
    # The decode kernel is the last query row of causal prefill over the same tokens.
    ctx = [23]
    q, kc, vc, tables, lens = _paged_case(gen, ctx, 9, 3, 16, DTYPES[0])
    blocks = tables[0, :2].long()
    k = kc[blocks].flatten(0, 1)[:23].transpose(0, 1)[None]
    v = vc[blocks].flatten(0, 1)[:23].transpose(0, 1)[None]
    qs = torch.cat([randn(gen, 1, 9, 22, 64, dtype=DTYPES[0]), q[0][None, :, None]], dim=2)
    prefill = flash_attention(qs, k, v, causal=True)[0, :, -1]
    decode = paged_decode_attention(q, kc, vc, tables, lens)[0]
    assert_close(decode, prefill.double(), DTYPES[0], "decode vs prefill last row")


# ----------------------------------------------------------------------------- bad inputs


def test_flash_attention_rejects_bad_shapes(gen):
    q4, k4 = randn(gen, 1, 9, 8, 64), randn(gen, 1, 3, 8, 64)
    with pytest.raises(ValueError, match=r"rank 4.*got q \(9, 8, 64\)"):
        flash_attention(q4[0], k4, k4)
    with pytest.raises(ValueError, match=r"Hq=9 query heads must be a multiple of Hkv=2"):
        flash_attention(q4, k4[:, :2], k4[:, :2])
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        flash_attention(q4, k4, k4[:, :, :5])
    with pytest.raises(ValueError, match=r"share batch size and head_dim"):
        flash_attention(q4, k4[..., :32], k4[..., :32])
    with pytest.raises(ValueError, match=r"v has dtype torch.float64 but q has torch.float32"):
        flash_attention(q4, k4, k4.double())
    with pytest.raises(ValueError, match=r"out must be a tensor like q"):
        flash_attention(q4, k4, k4, out=torch.empty(1, 9, 8, 32, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter-only restriction")
def test_interpreter_rejects_bfloat16(gen):
    q = randn(gen, 1, 3, 8, 64).bfloat16()
    with pytest.raises(ValueError, match=r"interpreter cannot compute in torch.bfloat16.*float32"):
        flash_attention(q, q, q)


def test_varlen_rejects_bad_inputs(gen):
    q, k = randn(gen, 10, 9, 64), randn(gen, 10, 3, 64)
    cu = _cu([4, 6])
    with pytest.raises(ValueError, match=r"rank 3"):
        flash_attention_varlen(q[None], k, k, cu, cu, 6, 6)
    with pytest.raises(ValueError, match=r"Hq=9 query heads must be a multiple of Hkv=4"):
        flash_attention_varlen(q, randn(gen, 10, 4, 64), randn(gen, 10, 4, 64), cu, cu, 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be a 1-D torch.int32"):
        flash_attention_varlen(q, k, k, cu.float(), cu, 6, 6)  # any integer dtype is accepted
    if DEVICE == "cpu":  # values are only checked on CPU
        with pytest.raises(ValueError, match=r"pass the true maximum length"):
            flash_attention_varlen(q, k, k, cu, cu, 4, 6)
        with pytest.raises(ValueError, match=r"must start at 0, never decrease"):
            flash_attention_varlen(q, k, k, _cu([4, 6]) + 1, cu, 6, 6)


def test_paged_decode_rejects_bad_inputs(gen):
    q, kc, vc, tables, lens = _paged_case(gen, [5, 20], 9, 3, 16, DTYPES[0])
    with pytest.raises(ValueError, match=r"q must be \[B, Hq, D\]"):
        paged_decode_attention(q[:, None], kc, vc, tables, lens)
    with pytest.raises(ValueError, match=r"Hq=9 query heads must be a multiple of Hkv=2"):
        paged_decode_attention(q, kc[:, :, :2], vc[:, :, :2], tables, lens)
    with pytest.raises(ValueError, match=r"block_tables must be int32"):
        paged_decode_attention(q, kc, vc, tables.float(), lens)  # any integer dtype is accepted
    with pytest.raises(ValueError, match=r"context_lens must be int32 \[B=2\]"):
        paged_decode_attention(q, kc, vc, tables, lens[:1])
    with pytest.raises(ValueError, match=r"context_lens must be .*another integer dtype.*float32"):
        paged_decode_attention(q, kc, vc, tables, lens.float())
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"context_lens must be in \[1, max_context_len"):
            paged_decode_attention(q, kc, vc, tables, torch.tensor([0, 20], dtype=torch.int32))
        bad = tables.clone()
        bad[1, 1] = -1
        with pytest.raises(ValueError, match=r"block_tables\[1\] uses block ids"):
            paged_decode_attention(q, kc, vc, bad, lens)


# ----------------------------------------------------------------------------- set-up


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


_CALL_KERNEL = textwrap.dedent("""
    q = torch.randn(1, 1, 16, 16)
    try:
        out = flash_attention(q, q, q)
    except RuntimeError as e:
        print("ERROR:", e)
    else:
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        print("MAXERR:", float((out - ref).abs().max()))
""")


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU-only set-up")
def test_interpreter_is_switched_on_without_user_help():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = _python("import torch\nfrom minillm.kernels import flash_attention" + _CALL_KERNEL, env)
    assert res.returncode == 0 and "MAXERR:" in res.stdout, res.stderr[-2000:]
    assert float(res.stdout.split("MAXERR:")[1]) < 1e-5
    assert "RuntimeWarning" not in res.stderr


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU-only set-up")
@pytest.mark.parametrize("setup,message", [
    ("import torch._dynamo  # imports triton before minillm can set TRITON_INTERPRET",
     "triton was imported before minillm.kernels"),
    ("import os; os.environ['TRITON_INTERPRET'] = '0'", "Unset TRITON_INTERPRET"),
])
def test_broken_interpreter_setup_warns_then_raises_clearly(setup, message):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = _python(setup + "\nimport torch\nfrom minillm.kernels import flash_attention"
                  + _CALL_KERNEL, env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "RuntimeWarning" in res.stderr and message in res.stderr, res.stderr[-2000:]
    assert "ERROR: minillm.kernels:" in res.stdout and message in res.stdout, res.stdout


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the kernels are compiled by every test")
def test_kernels_compile_for_cuda_sm90_without_a_gpu():
    """The interpreter accepts things the compiler rejects; compile for H100 (sm_90) anyway.

    Uses triton.compile + ASTSource (ahead-of-time compilation, pinned triton 3.7.1) with
    the bundled ptxas, one representative configuration per kernel, fp16 and bf16.

    The softmax scale is compiled both as fp32 (a direct launch) and as fp64: torch.compile
    (Inductor) types a Python float argument of a user-defined Triton kernel as fp64
    (torch._inductor.codegen.triton_utils.signature_of), which once turned the scores and
    acc to fp64 and failed `tl.dot(p, v, acc)` on the H100 (issue 26).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    res = _python("""
        import sys, torch
        torch.cuda.is_available = lambda: True  # define the kernels as compiled, not interpreted
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import minillm.kernels
        fa = sys.modules["minillm.kernels.flash_attention"]
        pd = sys.modules["minillm.kernels.paged_decode"]

        def compile(fn, ptr_types, consts, **options):
            sig = {n: "constexpr" if n in consts else ptr_types.get(n, "i32") for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                               options=options)
            assert "mma" in k.asm["ptx"] or not fn.__name__.startswith("_attn"), "no tensor-core MMA"

        for dt, varlen, scale in (("fp16", False, "fp32"), ("bf16", True, "fp64")):
            types = {n: "*" + dt for n in ("Q", "K", "V", "Out")}
            types.update(Lse="*fp32", cu_seqlens_q="*i32", cu_seqlens_k="*i32", qk_scale=scale)
            compile(fa._attn_fwd_kernel, types, dict(IS_VARLEN=varlen, CAUSAL=True, STORE_LSE=not varlen,
                    BLOCK_M=128, BLOCK_N=64, BLOCK_D=64), num_warps=8, num_stages=3)
        types = dict(Q="*bf16", KC="*bf16", VC="*bf16", BlockTables="*i32", ContextLens="*i32",
                     Out="*fp32", Lse="*fp32", qk_scale="fp32")
        compile(pd._paged_decode_kernel, types, dict(STORE_LSE=True, BLOCK_H=16, BLOCK_N=64, BLOCK_D=64),
                num_warps=4, num_stages=2)
        # What Inductor compiles for a compiled batch-1 decode step: one split, so the kernel
        # writes the bf16 output directly, and the scale as fp64.
        types.update(Out="*bf16", Lse="*bf16", qk_scale="fp64")
        compile(pd._paged_decode_kernel, types, dict(STORE_LSE=False, BLOCK_H=16, BLOCK_N=64, BLOCK_D=64),
                num_warps=4, num_stages=2)
        compile(pd._combine_splits_kernel, dict(Partial="*fp32", Lse="*fp32", Out="*bf16"),
                dict(BLOCK_S=8, BLOCK_D=64), num_warps=4)
        print("compiled")
    """, env)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the real pinned-config path runs in every test")
def test_cuda_dispatch_path_runs_on_the_interpreter(gen, monkeypatch):
    """The compiled-GPU launch (bucket, pinned-config lookup, grid from the config, launch
    options) with small pinned tiles, run by the interpreter on CPU tensors."""
    import triton

    from minillm.kernels import tuning

    fa = sys.modules["minillm.kernels.flash_attention"]
    pd = sys.modules["minillm.kernels.paged_decode"]
    pinned = {fa.FLASH_ATTENTION.name: triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4,
                                                     num_stages=2),
              pd.PAGED_DECODE.name: triton.Config({"BLOCK_N": 16}, num_warps=2, num_stages=2)}
    seen = []

    def fake_pinned(self, bucket, arch):
        seen.append((self.name, tuning.bucket_key(bucket), arch))
        return pinned[self.name]
    monkeypatch.setattr(tuning, "interpreter_enabled", lambda: False)  # take the CUDA branch ...
    monkeypatch.setattr(tuning, "_ready", {})  # nothing resolved before, or kept after
    monkeypatch.setattr(tuning, "device_arch", lambda device=None: 90)
    monkeypatch.setattr(tuning.Tunable, "pinned", fake_pinned)
    monkeypatch.setattr(fa, "_check_device_dtype", lambda tensors: None)  # ... with CPU tensors
    monkeypatch.setattr(pd, "_check_device_dtype", lambda tensors: None)
    monkeypatch.setattr(pd, "interpreter_enabled", lambda: True)  # no GPU to count SMs
    tuning.set_autotune(False)
    try:
        q, k, v = randn(gen, 1, 9, 37, 64), randn(gen, 1, 3, 37, 64), randn(gen, 1, 3, 37, 64)
        assert_close(flash_attention(q, k, v), reference(q, k, v), torch.float32, "pinned dense")
        qp, kc, vc, tables, lens = _paged_case(gen, [17, 40], 9, 3, 16, torch.float32)
        assert_close(paged_decode_attention(qp, kc, vc, tables, lens, num_splits=2),
                     _paged_reference(qp, kc, vc, tables, lens), torch.float32, "pinned decode")
    finally:
        tuning.set_autotune(None)
    assert ("flash_attention", "D=64,L=0,causal=1,dt=32,varlen=0", 90) in seen
    assert ("paged_decode", "D=64,H=16,dt=32,lse=1", 90) in seen


@pytest.mark.skipif(DEVICE != "cpu", reason="reads the compiled kernels' definitions on a CPU")
def test_lengths_that_change_every_step_are_not_specialized_on():
    """Triton compiles a new program when an int argument becomes a multiple of 16 or 1. The
    arguments that change with every engine step (lengths, the block table's width, the
    row count) must not be specialized on, or a serving run compiles mid-request (seen on
    an H100: the first engine run's prefill steps paid seconds of compilation)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = _python("""
        import torch
        torch.cuda.is_available = lambda: True  # define the kernels as compiled, not interpreted
        from minillm.kernels import flash_attention_kernel as fk, paged_decode as pd, w4a16 as wk
        from minillm.kernels import w8a16 as w8
        for fn, names in ((fk._attn_fwd_kernel, ["seqlen_q", "seqlen_k"]),
                          (pd._paged_decode_kernel, ["stride_btb", "tokens_per_split"]),
                          (pd._combine_splits_kernel, ["num_splits"]),
                          (wk._w4a16_kernel, ["M", "stride_ps", "SPLIT_K", "k_per_split"]),
                          (w8._w8a16_kernel, ["M"])):
            free = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
            assert set(names) <= free, (fn.__name__, names, free)
        print("ok")
    """, env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_the_argument_checks_trace_without_a_graph_break():
    """torch.compile must trace through a kernel wrapper's argument checks up to its launch.
    They ask whether the kernels run in the interpreter; Triton's own knob reads the
    environment in C++, which Dynamo cannot trace, so each attention call of a compiled
    decode step broke its graph there (and the layers compiled one frame each)."""
    import torch._dynamo
    from minillm.kernels._checks import _check_device_dtype

    def step(x):
        x = x.sin()
        _check_device_dtype({"x": x, "y": x})
        return x * 2

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(torch.ones(4, dtype=DTYPES[0], device=DEVICE))
    assert explained.graph_break_count == 0, [str(b.reason)[:300] for b in explained.break_reasons]


def test_the_host_grid_arithmetic_equals_tritons():
    """The wrappers size their launches with `minillm.kernels._grid` (plain Python: Triton's
    own are constexpr functions, 1.5 µs a call from Python): the same numbers."""
    import triton

    from minillm.kernels._grid import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(4100)] == [triton.next_power_of_2(n)
                                                         for n in range(4100)]
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(600) for b in range(1, 70))
