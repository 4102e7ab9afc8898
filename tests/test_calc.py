"""Worked examples of minillm.calc: every number the book quotes, checked exactly."""

import math

import numpy as np
import pytest

from minillm import calc
from minillm.calc import GB, GiB


def approx(x, rel=1e-9):
    return pytest.approx(x, rel=rel)


# --------------------------------------------------------------------------- KV cache


def test_kv_cache_llama2_70b_gqa_and_mha():
    assert calc.kv_cache_bytes(80, 8, 128, 4096) == 1_342_177_280  # 1.34 GB
    assert round(calc.kv_cache_bytes(80, 8, 128, 4096) / GB, 2) == 1.34
    assert round(calc.kv_cache_bytes(80, 64, 128, 4096) / GB, 1) == 10.7


def test_kv_cache_llama3_8b_and_gpt3():
    assert calc.kv_cache_bytes(32, 8, 128, 8192) == 1_073_741_824  # 1.07 GB
    gpt3 = calc.kv_cache_bytes(96, 96, 128, 4096)
    assert round(gpt3 / GB, 1) == 19.3  # SI gigabytes
    assert gpt3 / GiB == 18.0  # the "about 18 GB" of many texts is GiB


def test_kv_cache_batch_dtype_and_per_token():
    per_token = calc.kv_cache_bytes_per_token(80, 8, 128)
    assert per_token == 327_680
    assert calc.kv_cache_bytes(80, 8, 128, 4096, dtype_bytes=1, batch=3) == per_token / 2 * 4096 * 3
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp32 -> 46 KB per token (NOTES.md).
    assert calc.kv_cache_bytes_per_token(30, 3, 64, dtype_bytes=4) == 46_080


def test_gqa_reduction_and_attention_kind():
    assert calc.gqa_reduction(32, 8) == 4
    assert calc.gqa_reduction(64, 8) == 8
    assert calc.gqa_reduction(32, 32) == 1
    assert calc.gqa_reduction(32, 1) == 32
    assert calc.attention_kind(32, 32) == "MHA"
    assert calc.attention_kind(32, 8) == "GQA"
    assert calc.attention_kind(32, 1) == "MQA"
    assert calc.attention_kind(1, 1) == "MHA"
    with pytest.raises(ValueError, match="num_kv_heads"):
        calc.gqa_reduction(32, 6)
    with pytest.raises(ValueError, match="num_kv_heads"):
        calc.attention_kind(8, 16)


def test_attention_matrix_at_128k():
    assert calc.attention_matrix_bytes(128 * 1024) == 32 * GiB
    assert round(calc.attention_matrix_bytes(131072) / GB, 1) == 34.4


# --------------------------------------------------------------------------- weights, memory, decode


def test_parameter_pieces_add_up_to_the_model():
    """SmolLM2-135M's pieces as the docstrings quote them, and a tied and an untied model
    whose torch parameters number exactly what `ModelConfig.num_params` adds up."""
    from minillm import LlamaModel, ModelConfig
    assert calc.attention_params(576, 9, 3, 64) == 884_736
    assert calc.swiglu_params(576, 1536) == 2_654_208
    assert calc.norm_params(576, 30) == 61 * 576
    assert calc.embedding_params(49152, 576, False) == 2 * calc.embedding_params(49152, 576)
    smol = ModelConfig.smollm2_135m()
    assert smol.num_params() == 30 * (884_736 + 2_654_208) + 61 * 576 + 49152 * 576
    for tied in (True, False):
        cfg = ModelConfig.tiny(tie_word_embeddings=tied)
        model = LlamaModel(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    with pytest.raises(ValueError, match="num_kv_heads"):
        calc.attention_params(576, 9, 0, 64)


def test_weight_bytes():
    assert calc.weight_bytes(13e9, 2) == 26 * GB
    assert calc.weight_bytes(70e9, 2) == 140 * GB
    assert calc.weight_bytes(7e9, 0.5) == 3.5 * GB


def test_quantized_weight_bytes():
    assert calc.quantized_weight_bytes(1000, 4) == 500
    assert calc.quantized_weight_bytes(64, 4, group_size=32, scale_bytes=2) == 32 + 4
    # GGUF Q4_1: 32 weights in 16 bytes + fp16 scale + fp16 min = 20 bytes, i.e. 5 bits.
    assert calc.quantized_weight_bytes(32, 4, group_size=32, scale_bytes=4) * 8 / 32 == 5


def test_memory_per_gpu_tp():
    w = calc.weight_bytes(70e9, 2)
    assert [calc.memory_per_gpu(w, tp) / GB for tp in (1, 2, 4, 8)] == [140, 70, 35, 17.5]


def test_max_concurrent_sequences():
    assert calc.max_concurrent_sequences(80 * GB, 14 * GB, 5 * GB) == 13
    assert calc.max_concurrent_sequences(80 * GB, 20 * GB, 5 * GB) == 12  # exact division
    assert calc.max_concurrent_sequences(80 * GB, 14 * GB, 5 * GB, overhead_bytes=2 * GB) == 12
    assert calc.max_concurrent_sequences(16 * GB, 26 * GB, 1 * GB) == 0  # model does not fit
    assert calc.max_concurrent_sequences(16 * GB, 15.5 * GB, 1 * GB) == 0


def test_decode_ceiling_at_2_tb_per_s():
    bw = 2e12
    assert calc.decode_tokens_per_s(70e9, 2, bw) == approx(14.2857142857)
    assert round(calc.decode_tokens_per_s(7e9, 2, bw)) == 143
    assert round(calc.decode_tokens_per_s(405e9, 2, bw), 1) == 2.5
    # KV bytes read per step come on top of the weights.
    assert calc.decode_tokens_per_s(70e9, 2, bw, kv_bytes=60e9) == approx(10.0)


def test_batched_decode_roofline():
    # A100-like: 2 TB/s, 312 TFLOP/s, 7B fp16: 14 GB per step, 14 GFLOP per token.
    t1 = calc.decode_step_time_s(7e9, 2, 2e12, 312e12)
    assert t1 == approx(7e-3)  # memory-bound
    assert calc.batched_decode_tokens_per_s(7e9, 2, 2e12, 312e12, batch=8) == approx(8 / 7e-3)
    # At batch 1024 the compute roof binds: 2*7e9*1024 / 312e12 = 45.9 ms > 7 ms.
    assert calc.decode_step_time_s(7e9, 2, 2e12, 312e12, batch=1024) == approx(2 * 7e9 * 1024 / 312e12)
    assert calc.decode_step_time_s(7e9, 2, 2e12, 312e12, batch=2, kv_bytes_per_seq=1e9) == approx(8e-3)


# --------------------------------------------------------------------------- FLOPs and intensity


def test_prefill_and_decode_flops():
    assert calc.prefill_flops(7e9, 1000) == 1.4e13
    assert calc.decode_flops(7e9) == 1.4e10
    # Attention term: causal prefill sums 4*L*d*t over t = 1..T.
    assert calc.prefill_flops(1e6, 4, num_layers=2, attn_dim=8) == 2e6 * 4 + 4 * 2 * 8 * (1 + 2 + 3 + 4)
    assert calc.decode_flops(1e6, context_len=10, num_layers=2, attn_dim=8) == 2e6 + 4 * 2 * 8 * 10
    with pytest.raises(ValueError, match="num_layers"):
        calc.decode_flops(1e6, context_len=10)
    with pytest.raises(ValueError, match="attn_dim"):
        calc.prefill_flops(1e6, 4, num_layers=2)


def test_intensities():
    assert calc.matvec_intensity(8192, 8192, 2) == approx(2 * 8192**2 / ((8192**2 + 2 * 8192) * 2))
    assert round(calc.matvec_intensity(8192, 8192, 2), 3) == 1.0  # about 1 FLOP/byte in fp16
    assert calc.matmul_intensity(2, 3, 4, 1) == 2 * 2 * 3 * 4 / (8 + 12 + 6)
    assert calc.matmul_intensity(4096, 4096, 4096, 2) == approx(4096 / 3)
    # Batch B through a d x d weight: intensity grows ~linearly with B.
    i1, i16 = (calc.matmul_intensity(b, 4096, 4096, 2) for b in (1, 16))
    assert 15 < i16 / i1 < 16
    assert calc.attention_intensity(4096, 128, 32, dtype_bytes=2) == approx(
        4 * 32 * 4096 * 128 / ((2 * 32 * 4096 * 128 + 2 * 32 * 128) * 2))
    assert round(calc.attention_intensity(4096, 128, 32), 2) == 1.0
    assert round(calc.attention_intensity(4096, 128, 32, 8), 1) == 4.0


def test_ridge_and_roofline():
    assert calc.ridge_point(312e12, 2e12) == 156
    assert round(calc.ridge_point(989e12, 3.35e12)) == 295
    assert calc.roofline_flops(1, 312e12, 2e12) == 2e12
    assert calc.roofline_flops(1000, 312e12, 2e12) == 312e12
    assert calc.roofline_flops(156, 312e12, 2e12) == 312e12


# --------------------------------------------------------------------------- batching


def test_static_batching_waste():
    assert calc.static_batch_wasted_steps([20] * 7 + [500]) == 3360
    assert calc.static_batch_wasted_steps([5]) == 0
    assert calc.static_batch_wasted_steps(tuple([20] * 7 + [500])) == 3360
    assert calc.static_batch_wasted_steps(np.array([20] * 7 + [500])) == 3360  # widgets pass arrays


def test_static_vs_ideal_continuous_throughput():
    lengths = [50] * 7 + [500]
    assert calc.static_batch_throughput(lengths, 0.010) == approx(170.0)
    assert calc.continuous_batch_ideal_throughput(len(lengths), 0.010) == approx(800.0)
    assert calc.static_batch_utilization(lengths) == 0.2125
    assert calc.static_batch_utilization(lengths) * 800 == approx(170.0)


# --------------------------------------------------------------------------- speculative decoding


def test_spec_expected_tokens():
    assert calc.spec_expected_tokens(0.8, 5) == approx(3.68928)
    assert calc.spec_expected_tokens(1.0, 4) == 5
    assert calc.spec_expected_tokens(0.0, 4) == 1
    assert calc.spec_expected_tokens(0.5, 0) == 1
    # Geometric series form, for a few alphas.
    for a in (0.1, 0.5, 0.9):
        assert calc.spec_expected_tokens(a, 6) == approx(sum(a**i for i in range(7)))


def test_spec_naive_overestimates():
    assert calc.spec_expected_tokens_naive(0.8, 5) == 5.0
    for a in (0.3, 0.6, 0.9):
        for k in (2, 4, 8):
            assert calc.spec_expected_tokens_naive(a, k) > calc.spec_expected_tokens(a, k)


def test_spec_speedup_and_optimal_k():
    assert calc.spec_speedup(0.8, 5, 0.05) == approx(3.68928 / 1.25)
    assert calc.spec_speedup(0.8, 0, 0.05) == 1
    # A verification pass that costs two decode steps (a CPU's small GEMM) halves the gain.
    assert calc.spec_speedup(0.8, 5, 0.05, verify_cost=2.0) == approx(3.68928 / 2.25)
    assert calc.spec_speedup(0.8, 0, 0.05, verify_cost=2.0) == 1
    best = calc.spec_optimal_k(0.8, 0.05)
    assert best == 8
    top = calc.spec_speedup(0.8, best, 0.05)
    assert round(top, 2) == 3.09
    # Flat optimum: k = 6..10 are all within 2% of the best.
    assert all(calc.spec_speedup(0.8, k, 0.05) > 0.98 * top for k in range(6, 11))
    assert calc.spec_optimal_k(0.8, 0.1) == 6
    assert calc.spec_optimal_k(0.1, 0.9) == 0  # speculation does not pay
    assert calc.spec_optimal_k(1.0, 0.0, k_max=5) == 5
    # The same speedup from tokens per pass however predicted: runs of acceptances (α at
    # each position 0.5, 1, 1, 1) give 3 tokens a pass where one α = 0.5 gives 1.94.
    assert calc.spec_speedup_from_tokens(3.68928, 5, 0.05) == approx(3.68928 / 1.25)
    e = calc.spec_expected_tokens_by_position([0.5, 1, 1, 1])
    assert calc.spec_speedup_from_tokens(e, 4, 0.05, verify_cost=2.0) == approx(3.0 / 2.2)
    with pytest.raises(ValueError, match="expected_tokens"):
        calc.spec_speedup_from_tokens(-1, 4, 0.05)
    # verify_cost reaches spec_speedup: the best k maximizes the same speedup the widget plots.
    for c in (1.0, 1.5, 3.0):
        k = calc.spec_optimal_k(0.6, 0.02, verify_cost=c)
        assert all(calc.spec_speedup(0.6, k, 0.02, c) >= calc.spec_speedup(0.6, j, 0.02, c)
                   for j in range(17))
    assert calc.spec_optimal_k(0.3, 0.0, verify_cost=1.5) == 0  # E ≤ 1/(1 − α) < 1.5


def test_spec_acceptance_probability():
    assert calc.spec_acceptance_probability(0.3, 0.6) == 0.5
    assert calc.spec_acceptance_probability(0.6, 0.3) == 1
    assert calc.spec_acceptance_probability(0.0, 0.3) == 0
    with pytest.raises(ValueError, match=r"q must be a probability \(0 < q <= 1\); got 0.0"):
        calc.spec_acceptance_probability(0.3, 0)


# --------------------------------------------------------------------------- parallelism


def test_ring_allreduce():
    assert calc.ring_allreduce_bytes(100, 1) == 0
    assert calc.ring_allreduce_bytes(100, 2) == 100
    assert calc.ring_allreduce_bytes(100, 8) == 175
    assert calc.allreduce_time_s(64e6, 8, 900e9) == approx(112e6 / 900e9)
    assert calc.allreduce_time_s(64e6, 8, 64e9) == approx(112e6 / 64e9)
    assert calc.allreduce_time_s(64e6, 4, 100e9, latency_s=1e-5) == approx(96e6 / 100e9 + 6e-5)
    assert calc.tp_allreduces_per_layer() == 2


def test_pp_bubble():
    assert calc.pp_bubble_fraction(4, 1) == 0.75  # (N-1)/N at batch 1
    assert calc.pp_bubble_fraction(4, 12) == 0.2
    assert calc.pp_bubble_fraction(1, 5) == 0


# --------------------------------------------------------------------------- cost and queueing


def test_cost_per_million_tokens():
    assert round(calc.cost_per_million_tokens(2.50, 800), 2) == 0.87
    assert calc.cost_per_million_tokens(3.6, 1000) == approx(1.0)


def test_break_even():
    assert calc.break_even_tokens_per_month(1825, 0.50) == approx(3.65e9)
    assert calc.HOURS_PER_MONTH * 2.50 == 1825


def test_queueing():
    assert calc.utilization(8, 10) == 0.8
    assert calc.mm1_mean_latency(8, 10) == approx(0.5)
    assert calc.mm1_mean_latency(0, 10) == approx(0.1)
    assert calc.mm1_mean_latency(9, 10) == approx(10 * calc.mm1_mean_latency(0, 10))
    assert calc.littles_law_L(8, 0.5) == 4
    with pytest.raises(ValueError, match=r"arrival_rate must be below service_rate.*ρ = 1"):
        calc.mm1_mean_latency(10, 10)
    with pytest.raises(ValueError, match="ρ = 1.2"):
        calc.mm1_mean_latency(12, 10)


def test_e2e_latency():
    assert calc.e2e_latency_s(0.2, 0.03, 1) == 0.2
    assert calc.e2e_latency_s(0.2, 0.03, 101) == approx(3.2)


# --------------------------------------------------------------------------- quantization


def test_symmetric_quantize_worked_example():
    scale, q, deq = calc.symmetric_quantize([0.12, -0.83, 0.45, -0.21], 4)
    assert round(scale, 4) == 0.1186
    assert q == [1, -7, 4, -2]
    assert [round(x, 3) for x in deq] == [0.119, -0.830, 0.474, -0.237]
    err = max(abs(a - b) for a, b in zip([0.12, -0.83, 0.45, -0.21], deq))
    assert round(err, 3) == 0.027


def test_symmetric_quantize_edges():
    scale, q, deq = calc.symmetric_quantize([1.0, -0.5, 0.25], 8)
    assert scale == 1 / 127 and q == [127, -64, 32]  # 63.5 rounds half to even
    assert calc.symmetric_quantize([0.0, 0.0], 4) == (0.0, [0, 0], [0.0, 0.0])
    with pytest.raises(ValueError, match=r"values\[1\] must be a finite number"):
        calc.symmetric_quantize([1.0, math.nan], 4)
    with pytest.raises(ValueError, match="bits must be an integer >= 2; got 1"):
        calc.symmetric_quantize([1.0], 1)


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("call, name, shown", [
    (lambda: calc.kv_cache_bytes(-1, 8, 128, 4096), "num_layers", "-1"),
    (lambda: calc.kv_cache_bytes(80, 0, 128, 4096), "num_kv_heads", "0"),
    (lambda: calc.kv_cache_bytes(80, 8, 128.5, 4096), "head_dim", "128.5"),
    (lambda: calc.kv_cache_bytes(80, 8, 128, "4096"), "seq_len", "'4096'"),
    (lambda: calc.kv_cache_bytes(80, 8, 128, 4096, dtype_bytes=0), "dtype_bytes", "0"),
    (lambda: calc.kv_cache_bytes(80, 8, 128, 4096, batch=True), "batch", "True"),
    (lambda: calc.weight_bytes(-7e9, 2), "num_params", "-7"),
    (lambda: calc.decode_tokens_per_s(7e9, 2, math.inf), "bandwidth_bytes_per_s", "inf"),
    (lambda: calc.max_concurrent_sequences(80e9, 14e9, 0), "kv_bytes_per_seq", "0"),
    (lambda: calc.static_batch_wasted_steps([]), "output_lengths", "[]"),
    (lambda: calc.static_batch_wasted_steps([3, 0]), "output_lengths[1]", "0"),
    (lambda: calc.spec_expected_tokens(1.5, 3), "alpha", "1.5"),
    (lambda: calc.spec_speedup(0.8, -1, 0.05), "k", "-1"),
    (lambda: calc.spec_speedup(0.8, 3, -0.1), "cost_ratio", "-0.1"),
    (lambda: calc.ring_allreduce_bytes(100, 0), "num_gpus", "0"),
    (lambda: calc.memory_per_gpu(140e9, 0), "tp", "0"),
    (lambda: calc.pp_bubble_fraction(4, 0), "num_microbatches", "0"),
    (lambda: calc.cost_per_million_tokens(2.5, 0), "tokens_per_s", "0"),
    (lambda: calc.utilization(1, 0), "service_rate", "0"),
    (lambda: calc.matmul_intensity(0, 4, 4, 2), "m", "0"),
    (lambda: calc.ridge_point(None, 1e12), "peak_flops", "None"),
])
def test_bad_arguments_name_the_argument(call, name, shown):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(name + " must be"), message
    assert shown in message, message
    assert any(word in message for word in (">=", "> 0", "<=", "non-empty")), message
