"""The C++ CPU paged-decode kernel (minillm.attention.cpu_decode) == the PyTorch reference.

Same setting as test_paged_attention: scattered blocks, noise in every block nobody owns,
context lengths around block boundaries, GQA and MHA. These tests do not skip when the
kernel fails to build: on this project's machines (gcc, ninja) it must build, and a
silent fallback would hide a broken kernel behind the slower path.
"""
import pytest
import torch

from minillm.attention import (TorchBackend, choose_decode_path as decode_path, cpu_decode,
                               paged_decode_attention_ref)
from minillm.paged import PagedKVCache, block_table_tensor
from test_paged_attention import CONTEXT_LENS, D, HKV, TOL, contiguous_attention, setup_sequences


@pytest.fixture(scope="module", autouse=True)
def kernel():
    k = cpu_decode.load_kernel()
    assert k is not None, "the CPU paged-decode kernel did not build (see the warning above)"
    return k


def inputs(gqa, seed=3, head_dim=D):
    mgr, cache, ks, vs = setup_sequences()
    B = len(CONTEXT_LENS)
    q = torch.randn(B, HKV * gqa, head_dim, generator=torch.Generator().manual_seed(seed))
    tables = block_table_tensor([mgr.get_block_table(b) for b in range(B)])
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    return q, cache, tables, lens, ks, vs


@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference_and_contiguous_attention(gqa, threads):
    q, cache, tables, lens, ks, vs = inputs(gqa)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_decode.paged_decode_cpu(q, cache.k_caches[1], cache.v_caches[1], tables, lens)
    finally:
        torch.set_num_threads(before)
    ref = paged_decode_attention_ref(q, cache.k_caches[1], cache.v_caches[1], tables, lens)
    torch.testing.assert_close(out, ref, **TOL)
    for b in range(len(CONTEXT_LENS)):
        torch.testing.assert_close(out[b], contiguous_attention(q[b:b + 1], ks[b], vs[b])[0],
                                   **TOL, msg=f"sequence {b}, context {CONTEXT_LENS[b]}")


def test_kernel_scale_dtypes_and_shared_blocks():
    """A custom scale, int64 tables/lengths, a non-contiguous q, and two rows that share
    their blocks (a prefix-cache hit) with different context lengths."""
    q, cache, tables, lens, _, _ = inputs(2, seed=5)
    tables = torch.cat([tables, tables[3:4]]).long()
    lens = torch.cat([lens, torch.tensor([9])]).long()
    q = torch.randn(q.shape[0] + 1, q.shape[2], q.shape[1]).transpose(1, 2)  # not contiguous
    out = cpu_decode.paged_decode_cpu(q, cache.k_caches[1], cache.v_caches[1], tables, lens,
                                      sm_scale=0.3)
    ref = paged_decode_attention_ref(q, cache.k_caches[1], cache.v_caches[1], tables,
                                     lens.int(), sm_scale=0.3)
    torch.testing.assert_close(out, ref, **TOL)


def test_kernel_head_dim_64_and_long_context():
    """SmolLM2's head_dim and a context of hundreds of tokens over many blocks."""
    g = torch.Generator().manual_seed(7)
    cache = PagedKVCache(1, 64, 16, 3, 64)
    cache.k_caches[0].copy_(torch.randn(cache.k_caches[0].shape, generator=g))
    cache.v_caches[0].copy_(torch.randn(cache.v_caches[0].shape, generator=g))
    perm = torch.randperm(64, generator=g)
    tables = torch.stack([perm[:32], perm[32:]]).int()
    lens = torch.tensor([500, 37], dtype=torch.int32)
    q = torch.randn(2, 9, 64, generator=g)
    out = cpu_decode.paged_decode_cpu(q, cache.k_caches[0], cache.v_caches[0], tables, lens)
    ref = paged_decode_attention_ref(q, cache.k_caches[0], cache.v_caches[0], tables, lens)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(lens=torch.tensor([0, 1, 1, 1, 1])), r"context_lens\[0\] = 0"),
    (lambda a: a.update(lens=torch.tensor([1, 1, 1, 1, 10_000])), r"context_lens\[4\] = 10000"),
    (lambda a: a["tables"].__setitem__((2, 0), 999), r"block_tables\[2, 0\] = 999"),
    (lambda a: a["tables"].__setitem__((0, 0), -1), r"block_tables\[0, 0\] = -1"),
    (lambda a: a.update(q=a["q"][:, :5]), r"multiple of Hkv"),
    (lambda a: a.update(q=a["q"][:3]), r"block_tables \[B, max_blocks\]"),
    (lambda a: a.update(q=a["q"].double()), r"q, k_cache and v_cache must be float32"),
    (lambda a: a.update(k=a["k"].half()), r"q, k_cache and v_cache must be float32"),
])
def test_kernel_rejects_bad_arguments_clearly(change, match):
    """Every index the kernel would follow is checked first: an error, never a stray read."""
    q, cache, tables, lens, _, _ = inputs(3)
    args = dict(q=q, k=cache.k_caches[1], v=cache.v_caches[1], tables=tables, lens=lens)
    change(args)
    with pytest.raises(ValueError, match=match):
        cpu_decode.paged_decode_cpu(args["q"], args["k"], args["v"], args["tables"], args["lens"])


def test_decode_path_choice(monkeypatch):
    cache = PagedKVCache(1, 4, 16, 2, 16)
    assert decode_path(TorchBackend(), cache) == "kernel"
    assert decode_path(TorchBackend(), PagedKVCache(1, 4, 16, 2, 12)) == "gather"  # D % 8
    assert decode_path(TorchBackend(), PagedKVCache(1, 4, 16, 2, 16, torch.float64)) == "gather"

    class Other:
        name = "triton"
    assert decode_path(Other(), cache) == "backend"
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "0")
    assert cpu_decode.load_kernel() is None
    assert decode_path(TorchBackend(), cache) == "gather"
    with pytest.raises(ValueError, match="decode_path='kernel' needs an fp32 cache"):
        decode_path(TorchBackend(), cache, "kernel")  # asked for, but switched off
    with pytest.raises(RuntimeError, match="MINILLM_CPU_KERNEL=0"):
        cpu_decode.paged_decode_cpu(torch.zeros(1, 2, 16), cache.k_caches[0],
                                    cache.v_caches[0], torch.zeros(1, 1), torch.ones(1))
