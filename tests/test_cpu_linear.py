"""The C++ small-M linear kernel (minillm.layers.cpu_linear) == x @ W.T, row by row the same
bits whatever else shares the call, in every build this CPU runs (avx2, avx512, avx512bf16),
and `Linear` uses it exactly where it should."""
import pytest
import torch
import torch.nn.functional as F

import minillm
from minillm import LlamaModel, ModelConfig, cpp_extension
from minillm.layers import Linear, cpu_linear

# Every build of the kernel this CPU runs (the default one on a CPU without AVX2).
BUILDS = [b for b in cpu_linear.BUILDS if b in cpp_extension.host_isas()] or \
    [cpu_linear.default_variant()]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    k = cpu_linear.load_kernel()
    if k is None:
        pytest.skip("the C++ small-M linear kernel could not be built here")
    return k


# (N, K): SmolLM2's shapes, and odd ones that leave tails (N % 4, K % 8).
SHAPES = [(49152, 576), (3072, 576), (576, 1536), (960, 576), (7, 13), (5, 8), (130, 3)]


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_matches_float64_reference(n, k, m, variant):
    g = torch.Generator().manual_seed(n * 31 + k * 7 + m)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    want = x.double() @ w.double().T
    torch.testing.assert_close(cpu_linear.small_m_linear(x, w, variant).double(), want,
                               rtol=0, atol=2e-6 * k ** 0.5 * 8)


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(49152, 576), (576, 1536), (7, 13)])
def test_each_row_is_bit_identical_whatever_shares_the_call(n, k, dtype, variant):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    alone = torch.cat([cpu_linear.small_m_linear(x[i:i + 1], w, variant) for i in range(16)])
    for m in (2, 5, 16):
        assert torch.equal(cpu_linear.small_m_linear(x[:m], w, variant), alone[:m]), m


def test_avx2_and_avx512bf16_builds_sum_fp32_in_the_same_order():
    # Both sum 8 lanes in the same order, so the builds give the same bits wherever K is a
    # multiple of 8 (the tail's multiply-add may be contracted differently): switching
    # between them never changes a model's fp32 results.
    if not {"avx2", "avx512bf16"} <= set(BUILDS):
        pytest.skip("this CPU does not run both builds")
    g = torch.Generator().manual_seed(5)
    for n, k in [(3072, 576), (576, 1536), (130, 8)]:
        x, w = torch.randn(5, k, generator=g), torch.randn(n, k, generator=g)
        assert torch.equal(cpu_linear.small_m_linear(x, w, "avx2"),
                           cpu_linear.small_m_linear(x, w, "avx512bf16")), (n, k)


@pytest.mark.parametrize("variant", BUILDS)
def test_each_build_runs_as_its_own_operator_under_compile(variant):
    kernel = cpu_linear.load_kernel(variant)
    assert kernel.isa == variant and kernel.op_name == f"small_m_linear_{variant}"
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(2, 3, 64, generator=g), torch.randn(40, 64, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: cpu_linear.linear(x, w, kernel) * 2, fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(x), cpu_linear.small_m_linear(x, w, variant) * 2)


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_bf16_is_the_fp32_product_rounded_once(n, k, m, variant):
    # bf16 x and W are widened exactly, multiplied and summed in fp32 and rounded once: the
    # result is the fp32 product of the same bf16 values, rounded to bf16, give or take one
    # bf16 step where the summation order tips the rounding.
    g = torch.Generator().manual_seed(n * 17 + k + m)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    y = cpu_linear.small_m_linear(x, w, variant)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    exact = x.double() @ w.double().T
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    assert ((y.double() - exact).abs() <= ulp + 1e-5 * k ** 0.5).all()


def test_leading_dims_are_kept():
    x, w = torch.randn(2, 3, 24), torch.randn(40, 24)
    y = cpu_linear.small_m_linear(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, F.linear(x, w))


@pytest.mark.parametrize("variant", BUILDS)
def test_the_kernel_itself_keeps_leading_dims(variant):
    """The C++ takes x [..., K] as its rows and returns [..., N], so `Linear` reshapes
    nothing around a decode product: each row has the bits of the same row in a 2-D call."""
    kernel = cpu_linear.load_kernel(variant)
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(2, 3, 24, generator=g), torch.randn(40, 24, generator=g)
    y = kernel.small_m_linear(x, w)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y, kernel.small_m_linear(x.reshape(6, 24), w).reshape(2, 3, 40))
    assert torch.equal(kernel.small_m_linear(x[1, 2], w), y[1, 2])  # [K] -> [N]
    assert kernel.small_m_linear(x[:0], w).shape == (0, 3, 40)
    with pytest.raises(RuntimeError, match=r"x \[\.\.\., K\] and W \[N, K\]"):
        kernel.small_m_linear(x, w[0])


def test_bad_arguments_get_a_clear_error():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="x has 12 features, W expects 16"):
        cpu_linear.small_m_linear(torch.randn(2, 12), w)
    with pytest.raises(ValueError, match="must both be float32 or both bfloat16"):
        cpu_linear.small_m_linear(torch.randn(2, 16, dtype=torch.float64), w.double())
    with pytest.raises(ValueError, match="must both be float32 or both bfloat16"):
        cpu_linear.small_m_linear(torch.randn(2, 16), w.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.small_m_linear(torch.randn(2, 16), torch.randn(16, 8).t())


def test_applies_only_to_few_fp32_cpu_rows_without_autograd():
    w = torch.randn(8, 16)
    assert cpu_linear.applies(torch.randn(1, 16), w)
    assert cpu_linear.applies(torch.randn(2, 8, 16), w)  # 16 rows
    assert not cpu_linear.applies(torch.randn(cpu_linear.MAX_ROWS + 1, 16), w)  # prefill
    assert not cpu_linear.applies(torch.randn(0, 16), w)
    assert not cpu_linear.applies(torch.randn(1, 16).double(), w.double())
    assert cpu_linear.applies(torch.randn(1, 16).bfloat16(), w.bfloat16())  # a bf16 model
    assert not cpu_linear.applies(torch.randn(1, 16), w.bfloat16())  # mixed: F.linear
    assert not cpu_linear.applies(torch.randn(1, 16), torch.randn(16, 8).t())  # [in, out]
    assert not cpu_linear.applies(torch.randn(1, 16, requires_grad=True), w)  # training
    with torch.no_grad():
        assert cpu_linear.applies(torch.randn(1, 16, requires_grad=True), w)


def tiny_model():
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    return LlamaModel(cfg).init_random_weights(seed=2).eval()


@torch.inference_mode()
def test_decode_steps_use_the_kernel_and_prefill_uses_blas(monkeypatch):
    model = tiny_model()
    prompt = list(range(3, 23))  # 20 tokens: more than MAX_ROWS, so prefill goes to BLAS
    calls = {"kernel": 0, "blas": 0}
    kernel_linear, blas_linear = cpu_linear.linear, F.linear

    def counted(key, fn):
        def wrapper(*args):
            calls[key] += 1
            return fn(*args)
        return wrapper
    monkeypatch.setattr(cpu_linear, "linear", counted("kernel", kernel_linear))
    monkeypatch.setattr(F, "linear", counted("blas", blas_linear))
    tokens = minillm.generate(model, prompt, 6, ignore_eos=True)
    per_pass = 4 * model.config.num_layers + 1
    # Prefill: 8 projections through BLAS, the LM head on the last row through the kernel;
    # then 5 decode steps of one row each, every product through the kernel.
    assert calls == {"kernel": 1 + 5 * per_pass, "blas": per_pass - 1}
    # Switched off, BLAS does every product, and greedy decoding agrees.
    monkeypatch.setenv("MINILLM_CPU_KERNEL", "0")
    calls.update(kernel=0, blas=0)
    assert minillm.generate(model, prompt, 6, ignore_eos=True) == tokens
    assert calls == {"kernel": 0, "blas": 6 * per_pass}
