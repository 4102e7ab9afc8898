"""The Triton W8A16 matmul against dequantize-then-``F.linear``, on fresh random weights.

Oracle: ``F.linear(x, dequantize_packed(qweight, scales, zeros, 8, x.dtype))`` computed in
float64, i.e. the exact product of x as given and the reference weight. The kernel's
dequantized weight is bit for bit that reference's (``(u − z) · s`` in fp32, cast to x's
dtype), so its only errors are the fp32 sums' order and, in fp16 / bf16, the output's
rounding: the tolerances are tight. Weights are ``torch.randn`` matrices quantized by
``rtn`` (symmetric and asymmetric) and packed by ``packing.pack``; inputs are never zeros.

On a machine without CUDA the kernel runs in Triton's interpreter on CPU tensors, in fp32
and fp16 (``minillm.kernels`` switches the interpreter on by itself); with CUDA the same
tests run the compiled kernel in fp32 and bf16, and the CUDA-only tests at the end capture
it in a CUDA graph and run an 8-bit ``QuantLinear`` through it. The interpreter is slow
(~1.5 ms per program step), so the shapes cover the grid M in {1, 3, 16, 40}, N in {576,
1000, 64}, K in {576, 1536}, groups of 32, 64, 96, 128 and per-channel as a covering
subset; the file takes well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from compile_utils import assert_compiles

pytest.importorskip("triton", reason="the W8A16 kernel is written in Triton")

import minillm.kernels.w8a16 as w8  # noqa: E402
from minillm.kernels import w8a16_linear  # noqa: E402
from minillm.quant import QuantLinear  # noqa: E402
from minillm.quant.packing import dequantize_packed, pack  # noqa: E402
from minillm.quant.weights import rtn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEVICE == "cuda"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
# (rtol, atol) against the exact product (float64) of x and the reference weight in x's
# dtype. fp32: sums of <= 1536 products in another order than float64, |y| < ~200;
# measured max error ~4e-5, while one wrong byte, group or zero point is off by > 1e-2.
# fp16 / bf16: the products are exact in fp32, so the error is the output's rounding
# (half an ulp: 4.9e-4 / 3.9e-3 relative; ~0.03 absolute at |y| ~ 60 in fp16).
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-2),
              torch.bfloat16: (8e-3, 2e-2)}


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's own id: fresh inputs per test, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def packed_weight(g, n, k, group_size, sym, bits=8):
    """(qweight, scales, zeros) of a random [n, k] weight in the 8-bit layout, on DEVICE."""
    qweight, scales, zeros = pack(rtn(torch.randn(n, k, generator=g), bits=bits,
                                      group_size=group_size, sym=sym))
    assert qweight.shape == (n, k)  # one value per byte
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def reference(x, qweight, scales, zeros):
    """``F.linear(x, dequantize_packed(...))`` in float64: exact for the rounded weight."""
    w = dequantize_packed(qweight, scales, zeros, bits=8, dtype=x.dtype)
    return torch.nn.functional.linear(x.double(), w.double())


def assert_close(actual, expected, dtype, what=""):
    rtol, atol = TOLERANCES[dtype]
    assert actual.dtype == dtype, f"{what}: output dtype {actual.dtype}, expected x's {dtype}"
    assert not actual.isnan().any(), f"{what}: NaN in output (an unmasked load or unwritten row)"
    err = (actual.double() - expected).abs()
    bad = err > atol + rtol * expected.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max abs "
                           f"error {err.max().item():.3g}; first bad index "
                           f"{tuple(bad.nonzero()[0].tolist())}")


def label(m, n, k, group_size, sym):
    return f"M={m} N={n} K={k} g={group_size} {'sym' if sym else 'asym'}"


# ----------------------------------------------------------------------------- correctness

# The grid, covered: every M with every N, K and group size (per-channel: g = K) at least
# once, symmetric and asymmetric; BLOCK_K 64 (g 64, 128, 576, 1536) and 32 (g 32, 96).
GRID = [
    (1, 576, 576, 64, False), (1, 1000, 1536, 128, True), (1, 64, 576, 576, True),
    (3, 64, 1536, 32, False), (3, 1000, 576, 96, True), (3, 576, 1536, 1536, False),
    (16, 576, 1536, 1536, False), (16, 64, 576, 32, True), (16, 1000, 576, 64, False),
    (40, 64, 1536, 96, False), (40, 1000, 576, 576, True), (40, 576, 1536, 128, False),
]
# Edges: N odd and below a tile; M = 17 (BLOCK_M 32, one live row in the last tile);
# g = 48 (BLOCK_K 16, what fp32 takes on a GPU); groups of 192 (several steps per group).
EDGES = [
    (1, 37, 96, 32, False), (17, 50, 128, 128, True), (5, 40, 480, 48, False),
    (2, 24, 576, 192, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group_size,sym", GRID + EDGES,
                         ids=[label(*c) for c in GRID + EDGES])
def test_matches_dequantize_then_linear(gen, m, n, k, group_size, sym, dtype):
    qweight, scales, zeros = packed_weight(gen, n, k, group_size, sym)
    x = randn(gen, m, k, dtype=dtype)
    got = w8a16_linear(x, qweight, scales, zeros, group_size)
    assert got.shape == (m, n)
    assert_close(got, reference(x, qweight, scales, zeros), dtype, label(m, n, k, group_size, sym))


FP16_CASES = [(1, 576, 576, 64, False), (3, 1000, 576, 32, True), (16, 64, 1536, 96, False),
              (40, 64, 576, 576, True)]


@pytest.mark.parametrize("m,n,k,group_size,sym", FP16_CASES, ids=[label(*c) for c in FP16_CASES])
def test_fp16(gen, m, n, k, group_size, sym):
    qweight, scales, zeros = packed_weight(gen, n, k, group_size, sym)
    x = randn(gen, m, k, dtype=torch.float16)
    assert_close(w8a16_linear(x, qweight, scales, zeros, group_size),
                 reference(x, qweight, scales, zeros), torch.float16,
                 f"fp16 {label(m, n, k, group_size, sym)}")


def test_block_k_and_tiles():
    gpu_fp32 = 16 if CUDA else 64  # fp32 on a GPU: 16-column steps (no register spills)
    assert [w8._block_k(g, torch.float16) for g in (32, 64, 96, 128, 192, 576, 48, 24, 8)] == \
        [32, 64, 32, 64, 64, 64, 16, None, None]
    assert w8._block_k(128, torch.float32) == gpu_fp32 and w8._block_k(24, torch.float32) is None
    assert [w8._tiles(m, 576)[:2] for m in (1, 16, 17, 64, 65)] == \
        [(16, 64), (16, 64), (32, 64), (32, 64), (64, 64)]
    assert w8._tiles(65, 8192)[:2] == (64, 128) and w8._tiles(16, 49152)[:2] == (16, 64)
    assert w8._tiles(40, 49152)[:2] == (32, 64)


@pytest.mark.parametrize("m,wide", [(65, False), (65, True), (20, True)],
                         ids=["64x64", "64x128", "32x64"])
def test_every_tile_shape(gen, m, wide, monkeypatch):
    """The prefill tiles (BLOCK_M 64; BLOCK_N 128 from WIDE_N outputs, lowered here so that
    a small N takes it): M edges inside the larger tiles too."""
    if wide:
        monkeypatch.setattr(w8, "WIDE_N", 64)
    n, k, group_size = 200, 128, 64
    qweight, scales, zeros = packed_weight(gen, n, k, group_size, sym=False)
    x = randn(gen, m, k, dtype=DTYPES[0])
    assert_close(w8a16_linear(x, qweight, scales, zeros, group_size),
                 reference(x, qweight, scales, zeros), DTYPES[0], f"M={m} wide={wide}")


def test_batched_3d_input(gen):
    qweight, scales, zeros = packed_weight(gen, 40, 128, 64, sym=False)
    x = randn(gen, 2, 3, 128, dtype=DTYPES[0])
    got = w8a16_linear(x, qweight, scales, zeros, 64)
    assert got.shape == (2, 3, 40)
    assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], "x [2, 3, K]")


def test_strided_inputs(gen):
    """Non-contiguous x and a weight cut from a wider packed matrix (strides, not copies)."""
    qweight, scales, zeros = packed_weight(gen, 24, 256, 32, sym=True)
    qweight, scales, zeros = qweight[:, :128], scales[:, :4], zeros[:, :4]  # K = 128 of 256
    assert not qweight.is_contiguous()
    for m in (1, 6):
        x = randn(gen, 128, m, dtype=DTYPES[0]).T  # [m, 128], column stride m
        got = w8a16_linear(x, qweight, scales, zeros, 32)
        assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], f"strided M={m}")


def test_nothing_past_the_edges_is_read(gen):
    """x, scales and zeros are views into NaN-filled buffers: a load past K, past M or past
    the last group (a missing mask) would bring a NaN into the output."""
    qweight, scales, zeros = packed_weight(gen, 37, 96, 32, sym=False)

    def in_nan_buffer(t):
        big = torch.full((t.shape[0] + 3, t.shape[1] + 40), float("nan"), dtype=t.dtype,
                         device=t.device)
        big[: t.shape[0], : t.shape[1]] = t
        return big[: t.shape[0], : t.shape[1]]

    x = randn(gen, 4, 96, dtype=DTYPES[0])
    got = w8a16_linear(in_nan_buffer(x), qweight, in_nan_buffer(scales), in_nan_buffer(zeros),
                       32)
    assert_close(got, reference(x, qweight, scales, zeros), DTYPES[0], "NaN past the edges")


def test_no_rows_gives_an_empty_output(gen):
    qweight, scales, zeros = packed_weight(gen, 8, 64, 32, sym=True)
    got = w8a16_linear(randn(gen, 0, 64, dtype=DTYPES[0]), qweight, scales, zeros, 32)
    assert got.shape == (0, 8)


def test_group_without_a_power_of_two_step_takes_the_plain_path(gen, monkeypatch):
    """g = 24: no power of two >= 16 divides it, so no K step fits inside a group; the plain
    path (dequantize, then F.linear) computes it, still equal to the reference, and the
    kernel is not launched."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the kernel was launched for g = 24")

    monkeypatch.setattr(w8, "_w8a16_kernel", NoLaunch())
    qweight, scales, zeros = packed_weight(gen, 33, 96, 24, sym=False)
    x = randn(gen, 4, 96, dtype=DTYPES[0])
    assert_close(w8a16_linear(x, qweight, scales, zeros, 24),
                 reference(x, qweight, scales, zeros), DTYPES[0], "g=24")


# ----------------------------------------------------------------------------- bad inputs


def test_rejects_bad_arguments(gen):
    qweight, scales, zeros = packed_weight(gen, 8, 64, 32, sym=False)
    x = randn(gen, 2, 64, dtype=DTYPES[0])
    with pytest.raises(ValueError, match=r"qweight must be a torch.Tensor, got ndarray"):
        w8a16_linear(x, qweight.cpu().numpy(), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"zeros must be a torch.Tensor, got NoneType \(8-bit"):
        w8a16_linear(x, qweight, scales, None, 32)
    with pytest.raises(ValueError, match=r"x must be a float tensor"):
        w8a16_linear(x.long(), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"dtype torch.float64 is not supported"):
        w8a16_linear(x.double(), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"qweight must be a 2-d torch.uint8 tensor \[N, K\]"):
        w8a16_linear(x, qweight.to(torch.int8), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"qweight must be a 2-d torch.uint8 tensor"):
        w8a16_linear(x, qweight.reshape(-1), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"qweight \(8, 64\) holds 64 columns but x has "
                                         r"K = 32 \(x.shape\[-1\]\)"):
        w8a16_linear(x[:, :32], qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"group_size 24 does not divide K = 64"):
        w8a16_linear(x, qweight, scales, zeros, 24)
    with pytest.raises(ValueError, match=r"group_size must be a positive integer, got 0"):
        w8a16_linear(x, qweight, scales, zeros, 0)
    with pytest.raises(ValueError, match=r"scales must be torch.float32 \[N, K / group_size\] "
                                         r"= \[8, 4\], got torch.float32 \(8, 2\)"):
        w8a16_linear(x, qweight, scales, zeros, 16)  # scales hold 2 groups, not 4
    with pytest.raises(ValueError, match=r"zeros must be .* = \[8, 2\], got torch.float32 "
                                         r"\(8, 1\)"):
        w8a16_linear(x, qweight, scales, zeros[:, :1], 32)
    with pytest.raises(ValueError, match=r"scales must be torch.float32 .* got torch.float16"):
        w8a16_linear(x, qweight, scales.half(), zeros, 32)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"interpreter cannot compute in torch.bfloat16"):
            w8a16_linear(x.bfloat16(), qweight, scales, zeros, 32)
    else:
        with pytest.raises(ValueError, match=r"zeros is on cpu but x is on cuda"):
            w8a16_linear(x, qweight, scales, zeros.cpu(), 32)


# ----------------------------------------------------------------------------- QuantLinear


@pytest.mark.parametrize("bits,group_size,sym", [(8, 64, False), (8, None, True),
                                                 (6, 32, False)],
                         ids=["w8 g64 asym", "w8 per-channel sym", "w6 g32 asym"])
def test_quant_linear_kernel_equals_reference_forward(gen, bits, group_size, sym):
    """What ``QuantLinear.forward`` runs on CUDA for 8-bit storage (5 to 8 bits), called
    directly (on a CPU the branch is not reachable: x is not a CUDA tensor), against the
    module's own plain path."""
    ql = QuantLinear.from_quantized(rtn(torch.randn(100, 192, generator=gen), bits,
                                        group_size, sym=sym)).to(DEVICE)
    for m in (1, 20):
        x = randn(gen, m, 192)
        got = w8a16_linear(x, ql.qweight, ql.scales, ql.zeros, ql.group_size)
        torch.testing.assert_close(got, ql.reference_forward(x), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: QuantLinear's CUDA branch")
def test_quant_linear_on_cuda_runs_the_kernel(gen, monkeypatch):
    """An 8-bit QuantLinear's forward on CUDA goes through w8a16_linear (once per call) and
    equals its reference_forward, in fp32 and bf16."""
    ql = QuantLinear.from_quantized(rtn(torch.randn(1000, 576, generator=gen), 8, 64)).cuda()
    calls = []
    real = w8.w8a16_linear
    monkeypatch.setattr(w8, "w8a16_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(gen, 3, 576, dtype=dtype)
        assert_close(ql(x), reference(x, ql.qweight, ql.scales, ql.zeros), dtype, f"{dtype}")
    assert len(calls) == 2, "QuantLinear.forward did not take the W8A16 kernel"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: graph capture of the compiled kernel")
def test_kernel_inside_cuda_graph_capture(gen):
    """Captured once, replayed with new inputs: no host sync, no allocation that breaks the
    capture."""
    qweight, scales, zeros = packed_weight(gen, 1000, 1536, 64, sym=False)
    for m in (1, 40):
        x = randn(gen, m, 1536, dtype=torch.bfloat16)
        w8a16_linear(x, qweight, scales, zeros, 64)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w8a16_linear(x, qweight, scales, zeros, 64)
        for _ in range(3):
            x.copy_(randn(gen, m, 1536, dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert_close(y, reference(x, qweight, scales, zeros), torch.bfloat16,
                         f"graph replay M={m}")


# ----------------------------------------------------------------------------- compiled


@pytest.mark.skipif(CUDA, reason="on a GPU the kernel is compiled by every test")
def test_kernel_compiles_for_cuda_sm90_and_sm80_without_a_gpu():
    """The interpreter accepts things the compiler rejects: build every tile ``_tiles`` picks
    (decode, small batch, prefill, wide prefill) with the K step ``_block_k`` picks on a GPU
    (fp32: 16; bf16: 64, and 16 for g = 48), for H100 (sm_90) and A100 (sm_80), in bf16 and
    fp32, with Triton's bundled ptxas and the specializations a real call gets (unit
    strides, 16-aligned pointers and row strides). Each has no register spills (cuobjdump's
    resource usage), fp32 no TF32 (``_dot.dot``), bf16 tensor-core MMAs and, at BLOCK_K
    64, 16-byte copies of its tiles."""
    code = """
        import re
        import subprocess
        import tempfile
        from pathlib import Path
        import torch
        torch.cuda.is_available = lambda: True  # define the kernel as compiled, not interpreted
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import minillm.kernels.w8a16 as w8

        fn = w8._w8a16_kernel
        BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # Triton's own tools
        ones = dict(stride_xk=1, stride_qk=1, stride_sg=1, stride_zg=1, stride_on=1)
        aligned = ("stride_xm", "stride_qn", "stride_om", "N", "K", "group_size")
        for dt, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            for m, n, g in ((1, 576, 64), (1, 576, 48), (40, 1000, 64), (256, 576, 64),
                            (256, 14336, 64)):
                bm, bn, warps, stages = w8._tiles(m, n)
                bk = w8._block_k(g, dtype)
                types = dict(X=f"*{dt}", QW="*u8", Scales="*fp32", Zeros="*fp32", Out=f"*{dt}")
                consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **ones)
                sig = {a: "constexpr" if a in consts else types.get(a, "i32")
                       for a in fn.arg_names}
                attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                         for a in fn.arg_names if a in types or a in aligned}
                for arch in (90, 80):
                    k = triton.compile(ASTSource(fn, sig, consts, attrs),
                                       target=GPUTarget("cuda", arch, 32),
                                       options=dict(num_warps=warps, num_stages=stages))
                    what = f"sm_{arch} {dt} M={m} N={n} tile {bm}x{bn}x{bk} w{warps} s{stages}"
                    ptx = k.asm["ptx"]
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(k.asm["cubin"])
                        f.flush()
                        usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name],
                                               capture_output=True, text=True).stdout
                    assert "REG:" in usage and "STACK:0" in usage and "LOCAL:0" in usage, \\
                        f"{what}: spilled: {usage}"
                    code_lines = [l for l in ptx.splitlines() if not l.strip().startswith("//")]
                    mma = [l for l in code_lines if "mma" in l]
                    if dt == "fp32":
                        assert ".tf32" not in ptx, f"{what}: TF32"
                    else:
                        assert any(".bf16" in l for l in mma), f"{what}: no bf16 MMA"
                    if dt == "bf16" and bk == 64:  # >= 16 bytes of each tile a thread
                        wide = [l for l in code_lines if re.search(
                            r"cp\\.async\\.cg\\.shared\\.global .*, 0x10", l)
                            or "ld.global.v4" in l]
                        assert wide, f"{what}: no 16-byte loads"
        print("compiled")
    """
    assert_compiles(code, timeout=600)
