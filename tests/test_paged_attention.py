"""Paged KV storage and reference paged attention == plain attention on contiguous K/V.

K/V are random (fixed seeds, never zeros) and written through slot mappings of a
BlockManager whose free queue was shuffled, so every sequence's blocks are scattered.
Blocks nobody owns hold random noise: reading one by mistake changes the output.
Tolerance: fp32 on both sides, atol = rtol = 1e-5 (only summation order differs).
"""
import random

import pytest
import torch
import torch.nn.functional as F

from minillm.attention import paged_decode_attention_ref, paged_prefill_attention_ref
from minillm.paged import BlockManager, PagedKVCache, block_table_tensor

BS, NUM_BLOCKS, HKV, D = 16, 24, 2, 32
CONTEXT_LENS = [1, 15, 16, 17, 40]  # around the block boundary and across several blocks
TOL = dict(atol=1e-5, rtol=1e-5)


def scattered_manager(seed=0, **kw) -> BlockManager:
    """A BlockManager whose free queue is a shuffled permutation of the block ids."""
    mgr = BlockManager(NUM_BLOCKS, BS, **kw)
    for i in range(NUM_BLOCKS):
        mgr.allocate(("filler", i), [i])
    order = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(order)
    for i in order:
        mgr.free(("filler", i))
    return mgr


def noisy_cache(num_layers=2, seed=1) -> PagedKVCache:
    cache = PagedKVCache(num_layers, NUM_BLOCKS, BS, HKV, D, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for t in cache.k_caches + cache.v_caches:
        t.copy_(torch.randn(t.shape, generator=g) * 3)
    return cache


def contiguous_attention(q, k, v):
    """q [T, Hq, D] = the last T of the L tokens in k, v [L, Hkv, D]; causal, via SDPA."""
    T, L, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    visible = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(group, 1).transpose(0, 1)[None],
        v.repeat_interleave(group, 1).transpose(0, 1)[None], attn_mask=visible)
    return out[0].transpose(0, 1)


def setup_sequences(layer=1, seed=2):
    """Allocate one sequence per CONTEXT_LENS entry and write random K/V for all its
    tokens into `layer` (and different K/V into layer 0). Returns mgr, cache, K, V."""
    mgr, cache = scattered_manager(), noisy_cache()
    g = torch.Generator().manual_seed(seed)
    ks, vs = [], []
    for b, L in enumerate(CONTEXT_LENS):
        assert mgr.allocate(b, [1000 * b + i for i in range(L)]) == 0
        ks.append(torch.randn(L, HKV, D, generator=g))
        vs.append(torch.randn(L, HKV, D, generator=g))
        slots = mgr.slot_mapping(b, 0, L)
        cache.write(layer, ks[-1], vs[-1], slots)
        cache.write(1 - layer, -ks[-1], vs[-1] + 1, slots)
    tables = [mgr.get_block_table(b) for b in range(len(CONTEXT_LENS))]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables if len(t) > 1), \
        "the test wants non-contiguous block tables"
    return mgr, cache, ks, vs


@pytest.mark.parametrize("gqa", [1, 3])
def test_paged_decode_matches_contiguous_attention(gqa):
    mgr, cache, ks, vs = setup_sequences()
    B = len(CONTEXT_LENS)
    q = torch.randn(B, HKV * gqa, D, generator=torch.Generator().manual_seed(3))
    tables = block_table_tensor([mgr.get_block_table(b) for b in range(B)])
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    out = paged_decode_attention_ref(q, cache.k_caches[1], cache.v_caches[1], tables, lens)
    for b in range(B):
        want = contiguous_attention(q[b:b + 1], ks[b], vs[b])[0]
        torch.testing.assert_close(out[b], want, **TOL, msg=f"sequence {b}, context {CONTEXT_LENS[b]}")


@pytest.mark.parametrize("gqa", [1, 3])
def test_paged_prefill_matches_contiguous_causal_attention(gqa):
    mgr, cache, ks, vs = setup_sequences()
    query_lens = [1, 15, 5, 17, 24]  # full prompts, and chunks after a cached prefix
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), HKV * gqa, D, generator=torch.Generator().manual_seed(4))
    tables = block_table_tensor([mgr.get_block_table(b) for b in range(len(CONTEXT_LENS))])
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    out = paged_prefill_attention_ref(q, cache.k_caches[1], cache.v_caches[1], tables, qsl, lens)
    for b in range(len(CONTEXT_LENS)):
        s, e = int(qsl[b]), int(qsl[b + 1])
        torch.testing.assert_close(out[s:e], contiguous_attention(q[s:e], ks[b], vs[b]), **TOL,
                                   msg=f"sequence {b}: {e - s} queries, context {CONTEXT_LENS[b]}")


def test_decode_is_prefill_with_one_query_and_custom_scale():
    mgr, cache, _, _ = setup_sequences()
    B = len(CONTEXT_LENS)
    q = torch.randn(B, 6, D, generator=torch.Generator().manual_seed(5))
    tables = block_table_tensor([mgr.get_block_table(b) for b in range(B)])
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    decode = paged_decode_attention_ref(q, cache.k_caches[1], cache.v_caches[1], tables, lens, sm_scale=0.3)
    prefill = paged_prefill_attention_ref(q, cache.k_caches[1], cache.v_caches[1], tables,
                                          torch.arange(B + 1, dtype=torch.int32), lens, sm_scale=0.3)
    torch.testing.assert_close(decode, prefill, atol=0, rtol=0)


def test_fork_then_copy_on_write_keeps_both_sequences_correct():
    mgr, cache = scattered_manager(), noisy_cache(num_layers=1)
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(17, HKV, D, generator=g), torch.randn(17, HKV, D, generator=g)
    toks = list(range(17))                                   # 2 blocks, the 2nd holds 1 token
    mgr.allocate("p", toks)
    cache.write(0, k, v, mgr.slot_mapping("p", 0, 17))
    mgr.fork("p", "c")
    seqs = {}
    for sid, tok in (("c", 100), ("p", 200)):                # the child writes first
        cache.copy_blocks(mgr.append_slots(sid, toks + [tok], 1))
        k_new, v_new = torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g)
        cache.write(0, k_new, v_new, mgr.slot_mapping(sid, 17, 18))
        seqs[sid] = (torch.cat([k, k_new]), torch.cat([v, v_new]))
    assert mgr.get_block_table("c")[0] == mgr.get_block_table("p")[0]   # shared full block
    assert mgr.get_block_table("c")[1] != mgr.get_block_table("p")[1]   # split partial block
    q = torch.randn(2, 6, D, generator=g)
    tables = block_table_tensor([mgr.get_block_table("p"), mgr.get_block_table("c")])
    out = paged_decode_attention_ref(q, cache.k_caches[0], cache.v_caches[0], tables,
                                     torch.tensor([18, 18], dtype=torch.int32))
    for i, sid in enumerate(("p", "c")):
        torch.testing.assert_close(out[i], contiguous_attention(q[i:i + 1], *seqs[sid])[0], **TOL)


def test_prefix_cache_hit_reads_the_shared_blocks():
    mgr, cache = scattered_manager(), noisy_cache(num_layers=1)
    g = torch.Generator().manual_seed(7)
    prompt_a = list(range(40))
    k_a, v_a = torch.randn(40, HKV, D, generator=g), torch.randn(40, HKV, D, generator=g)
    mgr.allocate("a", prompt_a)
    cache.write(0, k_a, v_a, mgr.slot_mapping("a", 0, 40))
    mgr.cache_blocks("a", prompt_a, 40)
    prompt_b = prompt_a[:32] + [7, 7, 7, 7, 7]
    assert mgr.allocate("b", prompt_b) == 32                 # two shared blocks
    k_b, v_b = torch.randn(5, HKV, D, generator=g), torch.randn(5, HKV, D, generator=g)
    cache.write(0, k_b, v_b, mgr.slot_mapping("b", 32, 37))  # only the new tokens
    q = torch.randn(5, 6, D, generator=g)
    out = paged_prefill_attention_ref(q, cache.k_caches[0], cache.v_caches[0],
                                      block_table_tensor([mgr.get_block_table("b")]),
                                      torch.tensor([0, 5], dtype=torch.int32),
                                      torch.tensor([37], dtype=torch.int32))
    want = contiguous_attention(q, torch.cat([k_a[:32], k_b]), torch.cat([v_a[:32], v_b]))
    torch.testing.assert_close(out, want, **TOL)


def test_copy_blocks_copies_every_layer_and_nothing_else():
    cache = noisy_cache(num_layers=3)
    before = [t.clone() for t in cache.k_caches + cache.v_caches]
    cache.copy_blocks([(3, 7), (5, 0)])
    cache.copy_blocks([])
    for old, new in zip(before, cache.k_caches + cache.v_caches):
        want = old.clone()
        want[7], want[0] = old[3], old[5]
        torch.testing.assert_close(new, want, atol=0, rtol=0)


def test_write_stores_rows_at_their_slots_only():
    cache = noisy_cache(num_layers=1)
    before = cache.k_caches[0].clone()
    k = torch.randn(3, HKV, D, generator=torch.Generator().manual_seed(8))
    cache.write(0, k, k + 1, [5, 16, 383])                   # block 0/5, block 1/0, block 23/15
    want = before.clone()
    want[0, 5], want[1, 0], want[23, 15] = k[0], k[1], k[2]
    torch.testing.assert_close(cache.k_caches[0], want, atol=0, rtol=0)
    torch.testing.assert_close(cache.v_caches[0][23, 15], k[2] + 1, atol=0, rtol=0)
    with pytest.raises(ValueError, match="2 slots for 3 tokens"):
        cache.write(0, k, k, [1, 2])
    with pytest.raises(ValueError, match=r"\[N, 2, 32\]"):
        cache.write(0, k[:, :1], k[:, :1], [1, 2, 3])


def test_block_table_tensor_pads_with_zero():
    t = block_table_tensor([[5, 3], [], [9, 1, 4]])
    assert t.dtype == torch.int32 and t.tolist() == [[5, 3, 0], [0, 0, 0], [9, 1, 4]]
    assert block_table_tensor([]).shape == (0, 1)


def test_sizing_from_a_memory_budget():
    cache = PagedKVCache(2, 4, BS, HKV, D, torch.float16)
    assert cache.bytes_per_block() == 2 * 2 * BS * HKV * D * 2   # K and V, 2 layers, fp16
    per_block = cache.bytes_per_block()
    assert PagedKVCache.num_blocks_for_budget(10 * per_block + 1, 2, BS, HKV, D, torch.float16) == 10
    big = PagedKVCache.from_budget(3 * per_block, 2, BS, HKV, D, torch.float16)
    assert big.num_blocks == 3 and big.k_caches[0].shape == (3, BS, HKV, D)
    # What it holds: its blocks, plus one trash row per layer for K and for V.
    assert big.nbytes() == 3 * per_block + 2 * 2 * HKV * D * 2
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache.num_blocks_for_budget(per_block - 1, 2, BS, HKV, D, torch.float16)
