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
from minillm.attention.backends import decode_attention
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


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("lens", [[63], [64], [65, 7], [517], [200, 33], [1000, 999, 40],
                                  [300, 300, 300], [40, 700, 64, 90, 33]])
def test_sequences_cut_by_the_threads_shares_are_split_over_their_positions(threads, lens):
    """The step's positions are cut into equal shares, one per thread: a sequence a cut
    falls inside (a lone one at batch 1, or the middle one of three equal ones on 2 threads)
    is split into chunks whose boundaries fall inside blocks, and their softmax partials
    merged. Peaked scores (a large q) make the chunk maxima differ by far more than exp's
    range, so a merge that did not rescale by exp(m_c - M) would give inf or NaN. Equal to
    the reference, and to the same call on one thread (no split)."""
    g = torch.Generator().manual_seed(sum(lens) + threads)
    block_size, B = 16, len(lens)
    blocks = [-(-n // block_size) for n in lens]
    cache = PagedKVCache(1, sum(blocks) + 3, block_size, 3, 64)
    cache.k_caches[0].copy_(torch.randn(cache.k_caches[0].shape, generator=g))
    cache.v_caches[0].copy_(torch.randn(cache.v_caches[0].shape, generator=g))
    perm = torch.randperm(sum(blocks) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(perm[at:at + n])
        at += n
    for i in perm[at:]:  # blocks nobody owns: any read of them shows as NaN
        cache.k_caches[0][i], cache.v_caches[0][i] = float("nan"), float("nan")
    tables = block_table_tensor(tables)
    lens = torch.tensor(lens, dtype=torch.int32)
    q = 20 * torch.randn(B, 9, 64, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        split = cpu_decode.paged_decode_cpu(q, cache.k_caches[0], cache.v_caches[0], tables, lens)
        torch.set_num_threads(1)
        whole = cpu_decode.paged_decode_cpu(q, cache.k_caches[0], cache.v_caches[0], tables, lens)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(split).all()
    ref = paged_decode_attention_ref(q, cache.k_caches[0], cache.v_caches[0], tables, lens)
    torch.testing.assert_close(split, ref, **TOL)
    torch.testing.assert_close(split, whole, **TOL)


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
    with pytest.raises(ValueError, match="decode_path='kernel' needs an fp32 or bf16 cache"):
        decode_path(TorchBackend(), cache, "kernel")  # asked for, but switched off
    with pytest.raises(RuntimeError, match="MINILLM_CPU_KERNEL=0"):
        cpu_decode.paged_decode_cpu(torch.zeros(1, 2, 16), cache.k_caches[0],
                                    cache.v_caches[0], torch.zeros(1, 1), torch.ones(1))


# ------------------------------------------------------- the contiguous cache of generate()

@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 17, 100, 128])
def test_contiguous_cache_is_read_in_place_up_to_its_length(batch, length):
    """ContiguousDecode == SDPA over the filled slots; the slots beyond are NaN, so a read
    of any of them would show."""
    g = torch.Generator().manual_seed(length + batch)
    k, v = torch.randn(2, batch, 128, 3, 64, generator=g)
    k[:, length:], v[:, length:] = float("nan"), float("nan")
    q = torch.randn(batch, 9, 64, generator=g)
    out = cpu_decode.ContiguousDecode(batch)(q, k, v, length)
    ref = decode_attention(q, k[:, :length].transpose(1, 2), v[:, :length].transpose(1, 2))
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("batch, length", [(1, 1), (1, 100), (3, 37)])
def test_bf16_cache_is_the_fp32_attention_rounded_once(batch, length):
    """A bf16 cache (a bf16 model): K/V widened exactly, every sum in fp32, the output rounded
    to bf16 once, so it is the fp32 attention of the same bf16 values, to within one bf16
    step (the summation order may tip a rounding)."""
    g = torch.Generator().manual_seed(length)
    k, v = torch.randn(2, batch, 128, 3, 64, generator=g).bfloat16()
    q = torch.randn(batch, 9, 64, generator=g).bfloat16()
    out = cpu_decode.ContiguousDecode(batch)(q, k, v, length)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    exact = decode_attention(q.double(), k[:, :length].double().transpose(1, 2),
                             v[:, :length].double().transpose(1, 2))
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    assert ((out.double() - exact).abs() <= ulp + 1e-6).all()
    # the paged layout too: the same rows as 16-slot blocks in a shuffled pool
    blocks = k[:, :128].reshape(batch * 8, 16, 3, 64), v[:, :128].reshape(batch * 8, 16, 3, 64)
    perm = torch.randperm(batch * 8, generator=g)
    tables = torch.argsort(perm).reshape(batch, 8).int()
    paged = cpu_decode.paged_decode_cpu(q, blocks[0][perm], blocks[1][perm], tables,
                                        torch.full((batch,), length))
    assert torch.equal(paged, out)


@pytest.mark.parametrize("length", [0, 129])
def test_contiguous_cache_length_out_of_range_is_refused(length):
    k = torch.zeros(1, 128, 3, 64)
    with pytest.raises(ValueError, match=f"length must be 1 to max_seq = 128, got {length}"):
        cpu_decode.ContiguousDecode(1)(torch.zeros(1, 9, 64), k, k, length)


def record_kernel_lengths(monkeypatch) -> list[int]:
    """The context lengths of every attention call that generate() sends to the kernel."""
    lengths, real = [], cpu_decode.ContiguousDecode.__call__

    def recording(self, q, k_cache, v_cache, length, sm_scale=None):
        lengths.append(length)
        return real(self, q, k_cache, v_cache, length, sm_scale)
    monkeypatch.setattr(cpu_decode.ContiguousDecode, "__call__", recording)
    return lengths


def test_generate_decodes_through_the_kernel_where_chosen(monkeypatch, tiny_model):
    """Every decode step of every layer takes the kernel (MINILLM_CPU_KERNEL=default in the
    tests); the tokens equal those of SDPA (the kernel off for this shape)."""
    import minillm
    lengths = record_kernel_lengths(monkeypatch)
    prompt = [5, 9, 3, 7]
    with_kernel = minillm.generate(tiny_model, prompt, 12, ignore_eos=True)
    layers = tiny_model.config.num_layers
    assert sorted(lengths) == sorted(n for n in range(5, 16) for _ in range(layers))
    lengths.clear()
    monkeypatch.setattr(cpu_decode, "contiguous_preferred", lambda length, dtype: False)
    assert minillm.generate(tiny_model, prompt, 12, ignore_eos=True) == with_kernel
    assert lengths == []


def test_the_choice_is_per_bucket_of_context_lengths(monkeypatch, tiny_model):
    """The selection chose SDPA for short contexts only: the steps over 128+ cached
    positions take the kernel, the ones before do not."""
    import minillm
    from minillm import cpu_select
    real = cpu_select.choice
    monkeypatch.setattr(cpu_select, "choice", lambda kernel, group, bucket: "sdpa" if (
        group == cpu_decode.contiguous_group(torch.float32) and bucket == "context 1-127")
        else real(kernel, group, bucket))
    lengths = record_kernel_lengths(monkeypatch)
    minillm.generate(tiny_model, list(range(3, 123)), 16, ignore_eos=True)  # lengths 121..135
    assert sorted(set(lengths)) == list(range(128, 136))
    assert [cpu_decode.context_bucket(n) for n in (1, 127, 128, 511, 512, 4096)] == [
        "context 1-127", "context 1-127", "context 128-511", "context 128-511",
        "context 512+", "context 512+"]


def test_a_bf16_model_decodes_through_the_kernel(monkeypatch, tiny_model):
    """generate() in bf16 takes the kernel too (its own measured group), and its greedy
    tokens agree with SDPA's on most positions (bf16 rounds differently in the two)."""
    import minillm
    model = tiny_model.to(torch.bfloat16)
    lengths = record_kernel_lengths(monkeypatch)
    with_kernel = minillm.generate(model, [5, 9, 3, 7], 12, ignore_eos=True)
    assert len(lengths) == 11 * model.config.num_layers
    monkeypatch.setattr(cpu_decode, "contiguous_preferred", lambda length, dtype: False)
    sdpa = minillm.generate(model, [5, 9, 3, 7], 12, ignore_eos=True)
    assert sum(a == b for a, b in zip(with_kernel, sdpa)) >= 9


def test_generate_keeps_sdpa_where_the_kernel_cannot_serve(monkeypatch, tiny_model):
    """Left padding (a key padding mask), another backend, autograd, a float64 cache: SDPA."""
    import minillm
    from minillm.attention import ContiguousCacheContext
    from minillm.kv_cache import KVCache
    lengths = record_kernel_lengths(monkeypatch)
    minillm.generate_batch(tiny_model, [[5, 9, 3], [4]], 6)  # padded: a mask
    assert lengths == []
    cache = KVCache(tiny_model.config, 1, 32)
    q = torch.randn(1, 1, 4, 16)

    class Other:
        name = "triton"
    assert not ContiguousCacheContext(Other(), cache, 0)._takes_kernel(q, cache.k[0], 8)
    ctx = ContiguousCacheContext(TorchBackend(), cache, 0)
    assert ctx._takes_kernel(q, cache.k[0], 8)
    assert not ctx._takes_kernel(q.clone().requires_grad_(), cache.k[0], 8)
    wide = KVCache(tiny_model.config, 1, 32, torch.float64)
    assert not ContiguousCacheContext(TorchBackend(), wide, 0)._takes_kernel(
        q.double(), wide.k[0], 8)
