"""The C++ W4/W8 kernels (minillm.quant.cpu_kernels) == dequantize_packed then F.linear, to
fp32 rounding, for every storage width, group size and row count they take; each row the
same bits whatever else shares the call; clear errors; and no graph break under compile."""
import pytest
import torch
import torch.nn.functional as F

from minillm import cpp_extension
from minillm.quant import cpu_kernels, packing, rtn

# Every build of the kernels this CPU runs (the default one on a CPU without AVX2).
BUILDS = [b for b in cpu_kernels.BUILDS if b in cpp_extension.host_isas()] or \
    [cpu_kernels.default_variant()]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    k = cpu_kernels.load_kernel()
    if k is None:
        pytest.skip("the C++ quantized linear kernels could not be built here (see the warning)")
    return k


def packed(n, k, bits, group_size, sym, seed=0):
    g = torch.Generator().manual_seed(seed)
    qw = rtn(torch.randn(n, k, generator=g), bits=bits, group_size=group_size, sym=sym)
    return (*packing.pack(qw), qw.group_size)


def reference(x, qweight, scales, zeros, bits):
    return F.linear(x, packing.dequantize_packed(qweight, scales, zeros, bits))


def assert_matches(y, want, k):
    # Both sides are fp32 sums of k products in different orders (and the kernel's s·Σu·x −
    # s·z·Σx splits each group's sum), so allow a few fp32 roundings of a k-term sum.
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * k ** 0.5)


# (N, K): SmolLM2's shapes, and small odd ones (N % 4 != 0: the row tail; K = 96 with
# g = 32 and g = 96).
SHAPES = [(960, 576), (576, 1536), (3072, 576), (37, 96), (5, 32)]


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("group_size", [32, 64, None])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matches_dequantize_then_linear(bits, group_size, sym, m, variant):
    for n, k in SHAPES:
        if group_size is not None and k % group_size:
            continue
        qweight, scales, zeros, g = packed(n, k, bits, group_size, sym, seed=n + k + m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = cpu_kernels.quant_linear(x, qweight, scales, zeros, g, bits, variant)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_matches(y, reference(x, qweight, scales, zeros, bits), k)


@pytest.mark.parametrize("bits, k, group_size",
                         [(4, 72, 24), (4, 60, 6), (4, 90, 45), (4, 60, 2), (8, 60, 12),
                          (8, 45, 3), (8, 45, 45), (4, 80, 16), (4, 96, 48), (8, 40, 8),
                          (8, 72, 24)])
@pytest.mark.parametrize("variant", BUILDS)
def test_group_sizes_that_leave_a_scalar_tail(bits, k, group_size, variant):
    # Groups that are not a whole number of vector chunks (16 columns for w4, 8 for w8), and
    # for w4 groups of an odd size (their chunks would not start on a byte), take the
    # kernel's scalar path for what is left. Where the build has AVX-512, groups that 16-lane
    # chunks do not tile (w4: g not a multiple of 32; w8: of 16) run on 8 lanes instead:
    # g = 16, 48 (w4) and 8, 24 (w8) check that path.
    qweight, scales, zeros, g = packed(11, k, bits, group_size, sym=False)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    y = cpu_kernels.quant_linear(x, qweight, scales, zeros, g, bits, variant)
    assert_matches(y, reference(x, qweight, scales, zeros, bits), k)


def test_leading_dims_are_kept():
    qweight, scales, zeros, g = packed(40, 64, 4, 32, sym=False)
    x = torch.randn(2, 3, 64)
    y = cpu_kernels.quant_linear(x, qweight, scales, zeros, g, 4)
    assert y.shape == (2, 3, 40)
    assert_matches(y, reference(x, qweight, scales, zeros, 4), 64)


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 16])  # 16 lanes (with AVX-512) and 8 lanes
def test_each_row_is_bit_identical_whatever_shares_the_call(bits, group_size, variant):
    qweight, scales, zeros, g = packed(37, 96, bits, group_size, sym=False)
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([cpu_kernels.quant_linear(x[i:i + 1], qweight, scales, zeros, g, bits,
                                                variant) for i in range(16)])
    for m in (2, 5, 16):
        assert torch.equal(cpu_kernels.quant_linear(x[:m], qweight, scales, zeros, g, bits,
                                                    variant), alone[:m]), m


def test_bad_arguments_get_a_clear_error():
    qweight, scales, zeros, g = packed(8, 64, 4, 32, sym=False)
    q8, s8, z8, _ = packed(8, 64, 8, 32, sym=False)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x must be float32"):
        cpu_kernels.quant_linear(x.double(), qweight, scales, zeros, g, 4)
    with pytest.raises(ValueError, match="x has 48 features"):
        cpu_kernels.quant_linear(torch.randn(2, 48), qweight, scales, zeros, g, 4)
    with pytest.raises(ValueError, match="x has 64 features but qweight"):
        cpu_kernels.quant_linear(x, qweight, scales, zeros, g, 8)  # a w4 weight as w8
    with pytest.raises(ValueError, match="17 rows; this kernel takes 1 to 16"):
        cpu_kernels.quant_linear(torch.randn(17, 64), q8, s8, z8, g, 8)
    with pytest.raises(ValueError, match="scales and zeros must be"):
        cpu_kernels.quant_linear(x, qweight, scales[:, :1], zeros[:, :1], g, 4)
    with pytest.raises(ValueError, match="group_size 48 must divide"):
        cpu_kernels.quant_linear(x, qweight, scales, zeros, 48, 4)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        cpu_kernels.quant_linear(x, qweight.to(torch.int32), scales, zeros, g, 4)
    with pytest.raises(ValueError, match="bits must be an integer from 2 to 8"):
        cpu_kernels.quant_linear(x, qweight, scales, zeros, g, 9)


def test_applies_only_to_few_fp32_cpu_rows_without_autograd():
    qweight = torch.zeros(8, 32, dtype=torch.uint8)
    assert cpu_kernels.applies(torch.randn(1, 64), qweight)
    assert cpu_kernels.applies(torch.randn(2, 8, 64), qweight)  # 16 rows
    assert not cpu_kernels.applies(torch.randn(17, 64), qweight)
    assert not cpu_kernels.applies(torch.randn(1, 64, dtype=torch.bfloat16), qweight)
    assert not cpu_kernels.applies(torch.randn(1, 64, requires_grad=True), qweight)
    with torch.no_grad():
        assert cpu_kernels.applies(torch.randn(1, 64, requires_grad=True), qweight)


@pytest.mark.parametrize("variant", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_call_is_the_custom_op_with_the_same_result(bits, variant):
    qweight, scales, zeros, g = packed(40, 64, bits, 32, sym=True)

    def f(x):
        return cpu_kernels.quant_linear(x, qweight, scales, zeros, g, bits, variant) * 2

    x = torch.randn(1, 3, 64)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)
