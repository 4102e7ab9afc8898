"""The kernel sections of benchmarks/gpu_check.py: every Triton kernel of minillm.kernels
against its reference, on fresh random inputs, and timed against the PyTorch path.

* flash_attention: against float64 ``naive_attention`` on the first and last query rows of
  batch 0 (a full float64 reference at T = 8192 would need tens of GB) and against SDPA on
  everything; the same float64 rows measure SDPA's own error, and the kernel passes when its
  error is within max(tolerance, 2 x SDPA's). TFLOP/s count 4 B Hq T^2 D / 2 (causal).
  SDPA is timed with ``enable_gqa`` and with K/V repeated beforehand; the faster counts.
* paged_decode_attention and flash_attention_varlen: against ``paged_decode_attention_ref``
  / ``paged_prefill_attention_ref`` (varlen's packed K/V are a paged cache of block size 1),
  timed against the PyTorch path the engine takes without Triton (gather + SDPA, and the
  per-sequence SDPA loop of ``TorchBackend.varlen``); GB/s of K/V read against the
  bandwidth measured in this run.
* w4a16_linear: against ``F.linear(x, dequantize_packed(...))`` (QuantLinear's reference
  path), timed against a dense matmul of the dequantized weight in the same dtype (M = 1
  and 16 for SmolLM2's and an 8B model's shapes; the tiled GEMM against dequantize-then-
  matmul at 256 and 1024 rows; the symmetric g96 / g128 / g192 layouts at M = 1), with the
  GB/s of the int4 + scale bytes it reads against the measured bandwidth.
* decode_gemv: the decode GEMV (the glue before a product done in its kernel) against the
  glue kernel + cuBLAS or the W4A16 kernel, SmolLM2's products at M = 1 (and 4).
* gemv_tiles (only when asked: ``--sections gemv_tiles``): the decode GEMV's tiles, each
  candidate of each SmolLM2 product at M = 1 timed against the shape's own (w4 first), so
  that the tiles can be chosen by measurement.

Small calls are timed inside a CUDA graph (``bench_graph``): a paged-decode or W4A16 call
at decode's sizes is a few microseconds of GPU work behind tens of microseconds of Python
and launch, so timed one call at a time (``do_bench``) it measures the host (on the H100,
2026-11-27: every paged-decode row 50-90 us, a W4A16 GEMV 85 us against 8.5 us for the
dense matmul beside it). Their ``us`` columns, and what they are compared with, are the
GPU's time per call replayed from one graph, over copies of the inputs that overflow the L2
cache; ``eager_us`` keeps the one-at-a-time time (the launch wall, as a user calling the
kernel from Python pays it).

On a GPU the first call of each shape compiles its kernel (Triton caches it in
~/.triton/cache; with --autotune it also measures every tile configuration), so
``first_s`` is reported apart from the steady time. In the CPU dry
run the kernels run in Triton's interpreter: the numbers there are not performance.
"""
from __future__ import annotations

import itertools
import time
import zlib

import torch
import torch.nn.functional as F

from attention import max_err
from gpu_check import Section
from minillm.attention import (TorchBackend, paged_decode_attention_ref,
                               paged_prefill_attention_ref)
from minillm.attention.paged import decode_attention_gathered
from minillm.kernels import (flash_attention, flash_attention_varlen, naive_attention,
                             paged_decode_attention, w4a16_linear)
from minillm.kernels.w4a16 import bucket_of_call as w4a16_bucket
from minillm.model import rope_cos_sin
from minillm.quant import packing, rtn
from minillm.timing import time_fn, time_graph

# Kernel error allowed against the reference, per dtype. fp32 is held to fp32's error on a
# GPU too: the kernels' fp32 dots are true fp32 there (minillm/kernels/_dot.py, no TF32).
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}
SMOLLM_HEADS = (9, 3, 64)  # Hq, Hkv, D of SmolLM2-135M


def tol(dtype: torch.dtype) -> float:
    return TOL[dtype]


def bench(run, fn) -> float:
    """Milliseconds per call: triton's do_bench (median, L2 flushed) on CUDA; one timed call
    in the dry run (the interpreter's times mean nothing)."""
    if run.cuda:
        from triton.testing import do_bench
        return do_bench(fn, warmup=run.pick(25, 10, 0), rep=run.pick(100, 30, 1),
                        return_mode="median")
    return 1e3 * time_fn(fn, warmup=0, repeats=1)


# Calls per captured graph at least (its replay's own launch, a few microseconds, is shared
# by them), and at most: the number of input copies is capped here too.
GRAPH_CALLS, GRAPH_CALLS_MAX = 20, 128


def input_copies(run, nbytes: int) -> int:
    """How many copies of one call's inputs (`nbytes` each) the graph should cycle through so
    that, together, they are twice the L2 cache: each call then reads its inputs from memory,
    as a layer's call does in a model, not from L2 where the previous call left them. 1 in
    the dry run (no cache to beat, no graph)."""
    if not run.cuda:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(run.device), "L2_cache_size", 0) or 50 * 2**20
    return int(max(1, min(GRAPH_CALLS_MAX, -(-2 * l2 // max(1, nbytes)))))


def copies_past_l2(run, *tensors) -> list[tuple]:
    """``tensors`` (a None stays None), then clones of them: as many copies as
    `input_copies` asks for, so that a graph cycling through them reads each call's inputs
    from memory."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return [tensors] + [tuple(None if t is None else t.clone() for t in tensors)
                        for _ in range(input_copies(run, nbytes) - 1)]


def bench_graph(run, calls: list) -> float:
    """Milliseconds of GPU work per call: `calls` (one call each on its own copy of the
    inputs, see `input_copies`) cycled to at least GRAPH_CALLS calls, captured into one CUDA
    graph and replayed (``minillm.timing.time_graph``). Every call must be capturable (no
    host sync; the kernels' wrappers are, given their lengths up front). In the dry run: one
    eager call (the interpreter's times mean nothing)."""
    if not run.cuda:
        return 1e3 * time_graph(calls[:1], replays=1)
    fns = [calls[i % len(calls)] for i in range(max(GRAPH_CALLS, len(calls)))]
    return 1e3 * time_graph(fns, replays=run.pick(10, 5, 1), device=run.device)


def first_call(run, fn):
    """(result, seconds) of the first call, autotuning and compilation included."""
    t0 = time.perf_counter()
    out = fn()
    if run.cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def randn(run, *shape, dtype):
    return torch.randn(*shape, device=run.device, dtype=torch.float32).to(dtype)


def kernel_dtype(run) -> torch.dtype:
    """bf16 on a GPU; fp32 in the dry run (the interpreter takes fp32 and fp16 only)."""
    return torch.float32 if run.dry else torch.bfloat16


# ----------------------------------------------------------------------------- FlashAttention


def flash_case(run, b, hq, hkv, t, d, dtype) -> dict:
    torch.manual_seed(zlib.crc32(f"{b} {hq} {t} {d} {dtype}".encode()))
    q, k, v = randn(run, b, hq, t, d, dtype=dtype), *(randn(run, b, hkv, t, d, dtype=dtype)
                                                      for _ in range(2))
    k_rep, v_rep = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    out, first_s = first_call(run, lambda: flash_attention(q, k, v, causal=True))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    r = min(t, run.pick(128, 64, 16))  # float64 rows: the first r and the last r queries
    err, err_sdpa = 0.0, 0.0
    for rows, keys in ((slice(0, r), slice(0, r)), (slice(t - r, t), slice(0, t))):
        ref = naive_attention(q[:1, :, rows].double(), k[:1, :, keys].double(),
                              v[:1, :, keys].double(), causal=True)
        err = max(err, max_err(out[:1, :, rows], ref))
        err_sdpa = max(err_sdpa, max_err(sdpa[:1, :, rows], ref))
    ms = bench(run, lambda: flash_attention(q, k, v, causal=True))
    ms_gqa = bench(run, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True))
    ms_rep = bench(run, lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True))
    ms_sdpa = min(ms_gqa, ms_rep)
    flops = 4 * b * hq * t * t * d * 0.5
    row = {"dtype": str(dtype)[6:], "heads": f"{hq}:{hkv}", "D": d, "T": t, "B": b,
           "err_vs_f64": err, "sdpa_err_vs_f64": err_sdpa, "err_vs_sdpa": max_err(out, sdpa),
           "flash_TFLOPs": flops / ms / 1e9, "sdpa_TFLOPs": flops / ms_sdpa / 1e9,
           "flash_vs_sdpa": ms_sdpa / ms, "sdpa_best": "gqa" if ms_gqa <= ms_rep else "repeat",
           "first_s": first_s, "ok": err <= max(tol(dtype), 2 * err_sdpa)}
    if t >= 2048 and ms > 2 * ms_sdpa:
        run.notes.append(f"flash_attention {row['dtype']} {row['heads']} D={d} T={t} is "
                         f"{ms / ms_sdpa:.1f}x slower than SDPA (more than 2x at T >= 2048)")
    return row


# (dtype, (Hq, Hkv), D, T) of the full run: bf16 over every length 512..8192 for both
# head dims and both GQA shapes (SmolLM2's 9:3, a Llama-8B-like 32:8); fp16 once per head
# dim and GQA shape, at T = 2048 (its own compile, the same arithmetic otherwise).
FLASH_FULL = ([("bf16", heads, d, t) for d in (64, 128) for heads in ((9, 3), (32, 8))
               for t in (512, 1024, 2048, 4096, 8192)]
              + [("fp16", heads, d, 2048) for d in (64, 128) for heads in ((9, 3), (32, 8))])
FLASH_QUICK = [("bf16", (9, 3), 64, t) for t in (1024, 2048)]  # one length bucket
FLASH_DRY = [("fp32", heads, 64, t) for heads in ((9, 3), (32, 8)) for t in (32, 48)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_flash(run) -> None:
    tokens = run.pick(16384, 8192, 64)  # B * T per case
    for name, (hq, hkv), d, t in run.pick(FLASH_FULL, FLASH_QUICK, FLASH_DRY):
        dtype, b = DTYPES[name], max(1, tokens // t)
        run.case(f"{str(dtype)[6:]} {hq}:{hkv} D={d} T={t}",
                 lambda: flash_case(run, b, hq, hkv, t, d, dtype))


# ----------------------------------------------------------------------------- paged decode


def kv_gbps(run, nbytes: int, ms: float) -> tuple[float, float]:
    """(GB/s, fraction of the bandwidth measured in this run)."""
    gbs = nbytes / ms / 1e6
    return gbs, gbs / run.env["bandwidth_GBps"]


def paged_case(run, b, ctx, dtype, block_size=16) -> dict:
    hq, hkv, d = SMOLLM_HEADS
    torch.manual_seed(b * 100003 + ctx)
    nblk = -(-ctx // block_size)
    lens = torch.randint(max(1, ctx - block_size + 1), ctx + 1, (b,))  # ragged last blocks
    kc, vc = (randn(run, b * nblk, block_size, hkv, d, dtype=dtype) for _ in range(2))
    tables = torch.randperm(b * nblk).view(b, nblk).to(run.device, torch.int32)
    lens_dev = lens.to(run.device, torch.int32)
    q = randn(run, b, hq, d, dtype=dtype)
    call = lambda: paged_decode_attention(q, kc, vc, tables, lens_dev,  # noqa: E731
                                          max_context_len=ctx)
    out, first_s = first_call(run, call)
    err = max_err(out, paged_decode_attention_ref(q, kc, vc, tables, lens_dev))
    pos = torch.arange(ctx, device=run.device).expand(b, ctx)  # the engine's gather path
    mask = pos < lens_dev[:, None]
    slots = (tables.long().gather(1, pos // block_size) * block_size
             + pos % block_size).masked_fill(~mask, 0)
    ms_eager = bench(run, call)  # one call at a time: the host's launch included
    caches = copies_past_l2(run, kc, vc)
    ms = bench_graph(run, [lambda k=k, v=v: paged_decode_attention(
        q, k, v, tables, lens_dev, max_context_len=ctx) for k, v in caches])
    ms_torch = bench_graph(run, [lambda k=k, v=v: decode_attention_gathered(q, k, v, slots, mask)
                                 for k, v in caches])
    del caches
    nbytes = 2 * int(lens.sum()) * hkv * d * kc.element_size()
    gbs, frac = kv_gbps(run, nbytes, ms)
    return {"dtype": str(dtype)[6:], "B": b, "context": ctx, "err_vs_ref": err, "us": 1e3 * ms,
            "GBps": gbs, "of_bandwidth": frac, "gather_sdpa_us": 1e3 * ms_torch,
            "vs_gather_sdpa": ms_torch / ms, "eager_us": 1e3 * ms_eager, "first_s": first_s,
            "ok": err <= tol(dtype)}


def check_paged(run) -> None:
    dtype = kernel_dtype(run)
    for ctx in run.pick((128, 1024, 8192), (1024, 8192), (17, 40)):
        for b in run.pick((1, 16, 64, 256), (1, 256), (1, 3)):
            run.case(f"B={b} context={ctx}", lambda: paged_case(run, b, ctx, dtype))
    run.notes.append("K/V of SmolLM2's attention (Hq 9, Hkv 3, D 64), block size 16, block "
                     "tables shuffled, context lengths ragged within the last block; GB/s "
                     "counts the K/V bytes read; us and gather_sdpa_us: GPU time per call, "
                     "replayed from a CUDA graph over K/V copies larger than the L2 cache; "
                     "eager_us: the kernel called one at a time from Python (host launch "
                     "included: the launch wall)")


# ----------------------------------------------------------------------------- varlen


def varlen_case(run, b, ctx, dtype, chunk) -> dict:
    hq, hkv, d = SMOLLM_HEADS
    torch.manual_seed(b * 7919 + ctx)
    lens_k = torch.randint(max(1, ctx // 2), ctx + 1, (b,)) if b > 1 else torch.tensor([ctx])
    lens_q = lens_k.clamp(max=chunk)  # a prefill chunk after its cached prefix
    cu_k, cu_q = (torch.cat([torch.zeros(1, dtype=torch.long), x.cumsum(0)])
                  for x in (lens_k, lens_q))
    q = randn(run, int(cu_q[-1]), hq, d, dtype=dtype)
    k, v = (randn(run, int(cu_k[-1]), hkv, d, dtype=dtype) for _ in range(2))
    cu_q_dev, cu_k_dev = cu_q.to(run.device, torch.int32), cu_k.to(run.device, torch.int32)
    mq, mk = int(lens_q.max()), int(lens_k.max())
    call = lambda: flash_attention_varlen(q, k, v, cu_q_dev, cu_k_dev, mq, mk)  # noqa: E731
    out, first_s = first_call(run, call)
    # Packed K/V seen as a paged cache of block size 1: sequence i's block j is row cu_k[i]+j.
    tables = (cu_k[:-1, None] + torch.arange(mk)[None]).clamp(max=int(cu_k[-1]) - 1)
    ref = paged_prefill_attention_ref(q, k[:, None], v[:, None], tables.to(run.device),
                                      cu_q_dev, lens_k.to(run.device))
    err = max_err(out, ref)
    ms = bench(run, call)
    ms_torch = bench(run, lambda: TorchBackend().varlen(q, k, v, cu_q_dev, cu_k_dev, mq, mk))
    pairs = sum(int(lq) * (int(lk) - int(lq)) + int(lq) * (int(lq) + 1) // 2
                for lq, lk in zip(lens_q, lens_k))
    nbytes = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
    gbs, frac = kv_gbps(run, nbytes, ms)
    return {"dtype": str(dtype)[6:], "B": b, "context": ctx, "queries": int(cu_q[-1]),
            "err_vs_ref": err, "us": 1e3 * ms, "TFLOPs": 4 * hq * d * pairs / ms / 1e9,
            "GBps": gbs, "of_bandwidth": frac, "sdpa_loop_us": 1e3 * ms_torch,
            "vs_sdpa_loop": ms_torch / ms, "first_s": first_s, "ok": err <= tol(dtype)}


def check_varlen(run) -> None:
    dtype, chunk = kernel_dtype(run), run.pick(512, 512, 16)
    for ctx in run.pick((128, 1024, 8192), (1024, 8192), (20, 40)):
        for b in run.pick((1, 16, 256), (1, 64), (1, 3)):
            run.case(f"B={b} context={ctx}", lambda: varlen_case(run, b, ctx, dtype, chunk))
    run.notes.append(f"each sequence's context uniform in [context/2, context] (B > 1), its "
                     f"queries the last min(context, {chunk}) positions (chunked prefill); "
                     "GB/s counts q, k, v and the output once")


# ----------------------------------------------------------------------------- W4A16


_W4_WEIGHTS: dict = {}  # (N, K, group, sym) -> packed weight, for one section run
GEMV_MAX_ROWS = 4  # minillm.kernels.decode_gemv.MAX_ROWS (not imported here: it loads triton)


def w4_weight(run, n, k, group_size=64, sym=False) -> tuple:
    """(qweight, scales, zeros) of a random [n, k] weight quantized by RTN: one per shape
    and layout, shared by the rows of a section run (`_W4_WEIGHTS`)."""
    key = (n, k, group_size, sym)
    if key not in _W4_WEIGHTS:
        torch.manual_seed(n * 31 + k * 7)
        w = torch.randn(n, k, device=run.device) * 0.02  # quantized on the device: fast
        _W4_WEIGHTS[key] = packing.pack(rtn(w, 4, group_size, sym))
    return _W4_WEIGHTS[key]


def w4a16_case(run, n, k, m, dtype, group_size=64, sym=False) -> dict:
    """One W4A16 product against a dense matmul of the same (dequantized) weight: time,
    the GB/s of the bytes it reads (packed int4 + fp32 scales, + fp32 zeros if asymmetric)
    and their fraction of the bandwidth measured in this run; from 256 rows also the
    dequantize-then-torch.matmul path (the wrapper switches to it from DEQUANT_MIN_M)."""
    qweight, scales, zeros = w4_weight(run, n, k, group_size, sym)
    z = None if sym else zeros
    torch.manual_seed(m)
    x = randn(run, m, k, dtype=dtype)
    gemm_path = {"dequantize_first": False} if m >= 256 else {}
    call = lambda: w4a16_linear(x, qweight, scales, z, group_size, **gemm_path)  # noqa: E731
    out, first_s = first_call(run, call)
    dense_w = packing.dequantize_packed(qweight, scales, zeros, 4, dtype)
    ref = F.linear(x, dense_w)  # QuantLinear.reference_forward
    err = max_err(out, ref) / max(float(ref.abs().max()), 1e-12)
    ms_eager = bench(run, call)  # one call at a time: the wrapper's Python and launch included
    # Like for like: the W4A16 call and the dense matmul both timed from a CUDA graph, each
    # over weight copies larger than the L2 cache (the first call of each, outside the
    # capture, also allocates the split-K counters).
    nbytes = sum(t.numel() * t.element_size() for t in (qweight, scales, *([] if sym else [zeros])))
    packed = copies_past_l2(run, qweight, scales, z)
    ms = bench_graph(run, [lambda w=w: w4a16_linear(x, *w, group_size, **gemm_path)
                           for w in packed])
    denses = copies_past_l2(run, dense_w)
    ms_dense = bench_graph(run, [lambda w=w: F.linear(x, *w) for w in denses])
    del denses
    gbs, frac = kv_gbps(run, nbytes, ms)
    found = w4a16_bucket(x, qweight, group_size, **gemm_path)
    row = {"dtype": str(dtype)[6:], "N": n, "K": k, "M": m,
           "layout": f"g{group_size} {'sym' if sym else 'asym'}", "rel_err": err,
           "us": 1e3 * ms, "weight_GBps": gbs, "of_bandwidth": frac, "dense_us": 1e3 * ms_dense,
           "vs_dense": ms_dense / ms, "eager_us": 1e3 * ms_eager, "first_s": first_s,
           "config": "interpreter" if not run.cuda or found is None else _config_str(
               found[0].config_for(found[1], run.device))}
    if m <= GEMV_MAX_ROWS:  # the decode GEMV's int4 path on the same weights: the other candidate
        from minillm.kernels import decode_gemv as dg
        int4 = [dg.int4_weight(*w, group_size) for w in packed]
        if int4[0] is not None:
            gemv_err = max_err(dg.linear(x, int4[0]), ref) / max(float(ref.abs().max()), 1e-12)
            ms_gemv = bench_graph(run, [lambda w=w: dg.linear(x, w) for w in int4])
            row.update(decode_gemv_us=1e3 * ms_gemv, decode_gemv_vs_dense=ms_dense / ms_gemv,
                       decode_gemv_rel_err=gemv_err)
    if m >= 256:
        ms_deq = bench_graph(run, [lambda w=w: w4a16_linear(x, *w, group_size,
                                                            dequantize_first=True)
                                   for w in packed])
        row.update(dequant_matmul_us=1e3 * ms_deq, gemm_vs_dequant=ms_deq / ms)
    row["ok"] = max(err, row.get("decode_gemv_rel_err", 0.0)) <= tol(dtype)
    return row


def _config_str(cfg) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.kwargs.items()) + \
        f" w{cfg.num_warps} s{cfg.num_stages}"


def check_w4a16(run) -> None:
    dtype = kernel_dtype(run)
    # SmolLM2's MLP and LM head (K = 576) and an 8B model's (K = 4096), at decode's M = 1
    # and at M = 16 (a speculative verify, a small batch), M = 4 once (the small-M class
    # whose candidates include the GEMV once per row), then the tiled GEMM at 256 and
    # 1024 rows against dequantize-then-matmul; all g64 asymmetric (quantize_model's
    # default). Last, the symmetric layouts of the layout study at M = 1 (a time box cuts
    # those first).
    shapes = [(3072, 576), (49152, 576), (4096, 4096), (14336, 4096)]
    full = [(n, k, m, 64, False) for n, k in shapes for m in (1, 16)] + [
        (4096, 4096, 4, 64, False), (4096, 4096, 256, 64, False), (4096, 4096, 1024, 64, False),
        (3072, 576, 1, 96, True), (3072, 576, 1, 192, True), (49152, 576, 1, 192, True),
        (4096, 4096, 1, 128, True), (14336, 4096, 1, 128, True)]
    cases = run.pick(full, [(4096, 4096, 1, 64, False), (4096, 4096, 16, 64, False)],
                     [(96, 128, 1, 64, False), (40, 64, 256, 32, True)])  # dry: both paths
    try:
        for n, k, m, g, sym in cases:
            run.case(f"N={n} K={k} M={m} g{g}{' sym' if sym else ''}",
                     lambda: w4a16_case(run, n, k, m, dtype, g, sym))
    finally:
        _W4_WEIGHTS.clear()
    run.notes.append("RTN 4-bit; error relative to the output's max; GB/s counts what the "
                     "kernel reads: the packed weight, fp32 scales and (asymmetric) fp32 "
                     "zeros; us, dense_us and dequant_matmul_us: GPU time per call, replayed "
                     "from a CUDA graph over weight copies larger than the L2 cache; "
                     "eager_us: the W4A16 call one at a time from Python (its wrapper and "
                     "launch included: the launch wall); vs_dense: the dense bf16 matmul's "
                     "time over the kernel's (both from graphs); from M = 256 the kernel is "
                     "the tiled GEMM, dequant_matmul_us the dequantize kernel + "
                     "torch.matmul; decode_gemv_us (M <= 4): the same product by "
                     "minillm.kernels.decode_gemv's int4 path (no glue), the other "
                     "candidate for decode; config: the pinned tiles used")


# ----------------------------------------------------------------------------- decode GEMV


# SmolLM2's three products that the decode GEMV takes with their glue: (name, N, K, prologue),
# and o_proj, which has no glue before it: the GEMV alone against cuBLAS / the W4A16 kernel
# (the H100 of 2026-11-27 measured 1.30x in bf16, and the model now sends o_proj to it).
# q|k|v as the model runs it: RoPE and the K/V store in the product's epilogue (SmolLM2's
# 9 + 2 * 3 heads: D = N / 15); the unfused side then runs glue.rope_kv after the product.
GEMV_HEADS = (9, 3)
GEMV_PRODUCTS = [("qkv", 960, 576, "add+norm+rope"), ("gate_up", 3072, 576, "add+norm"),
                 ("down", 576, 1536, "silu·up"), ("o_proj", 576, 576, "none")]


def gemv_group(k: int) -> int:
    """The 4-bit group size of the decode GEMV rows' weights (g64, or g32 where 64 does not
    divide K)."""
    return 64 if k % 64 == 0 else 32


def gemv_stand_in(weight: str, k: int):
    """What `decode_gemv.launch_tiles` / `bucket_of` need of a row's weight ("w4" or
    "dense"): its kind, and a 4-bit one's group size."""
    from minillm.kernels import decode_gemv as dg

    return dg.Int4Weight(None, None, None, gemv_group(k)) if weight == "w4" else torch.empty(0)


def gemv_case(run, name, n, k, prologue, m, weight, dtype, tiles=None) -> dict:
    """One fused call (`decode_gemv.norm_linear` / `silu_mul_linear`) against the kernels it
    replaces (the Triton glue, then cuBLAS or the W4A16 kernel), both from CUDA graphs over
    weight copies larger than L2, as a layer's products run in a graph step. With ``tiles``
    ({block_n, warps, unroll, split}: `decode_gemv.tiles`) the fused call runs those tiles
    and only it is timed (the unfused result still checks it)."""
    from minillm.kernels import decode_gemv as dg

    if tiles is not None:
        with dg.tiles(**tiles):
            return _gemv_case(run, name, n, k, prologue, m, weight, dtype, tiles)
    return _gemv_case(run, name, n, k, prologue, m, weight, dtype, None)


def _gemv_case(run, name, n, k, prologue, m, weight, dtype, tiles) -> dict:
    from minillm.kernels import decode_gemv as dg
    from minillm.kernels import glue

    torch.manual_seed(zlib.crc32(f"{name} {m} {weight}".encode()))
    w = torch.randn(n, k, device=run.device) * k ** -0.5
    if weight == "w4":
        qw, scales, zeros = packing.pack(rtn(w, 4, gemv_group(k), False))
        group = k // scales.shape[1]
        fused_w = lambda c: dg.Int4Weight(*c, group)  # noqa: E731
        product = lambda h, c: w4a16_linear(h, *c, group)  # noqa: E731
        copies = copies_past_l2(run, qw, scales, zeros)
    else:
        fused_w = lambda c: c[0]  # noqa: E731
        product = lambda h, c: F.linear(h, *c)  # noqa: E731
        copies = copies_past_l2(run, w.to(dtype))
    if prologue.startswith("add+norm"):
        x, d = randn(run, m, k, dtype=dtype), randn(run, m, k, dtype=dtype)
        nw = 1 + 0.1 * randn(run, k, dtype=dtype)
        rope, finish = None, lambda y: y  # noqa: E731
        if prologue.endswith("+rope"):  # the model's fp32 tables; K/V to slots 0..m-1
            num_q, num_kv = GEMV_HEADS
            dim = n // (num_q + 2 * num_kv)
            cos, sin = (t[-m:] for t in rope_cos_sin(dim, 300 + m, 10000.0, run.device))
            caches = [torch.zeros(m + 1, num_kv, dim, device=run.device, dtype=dtype)
                      for _ in range(2)]
            kv = (*caches, torch.arange(m, device=run.device))
            rope = dg.Rope(num_q, num_kv, dim, cos, sin, kv)
            finish = lambda y: glue.rope_kv(  # noqa: E731
                y.view(m, -1, dim), num_q, num_kv, cos, sin, kv).view(m, n)
        fused = lambda c: dg.norm_linear(x, d, nw, 1e-5, fused_w(c), rope=rope)[1]  # noqa: E731
        unfused = lambda c: finish(product(glue.add_rms_norm(x, d, nw, 1e-5)[1], c))  # noqa: E731
    elif prologue == "silu·up":
        gu = randn(run, m, 2 * k, dtype=dtype)
        fused = lambda c: dg.silu_mul_linear(gu, fused_w(c))  # noqa: E731
        unfused = lambda c: product(glue.silu_mul(gu), c)  # noqa: E731
    else:
        x = randn(run, m, k, dtype=dtype)
        fused = lambda c: dg.linear(x, fused_w(c))  # noqa: E731
        unfused = lambda c: product(x, c)  # noqa: E731
    out, first_s = first_call(run, lambda: fused(copies[0]))
    ref = unfused(copies[0])
    err = max_err(out, ref) / max(float(ref.abs().max()), 1e-12)
    ms = bench_graph(run, [lambda c=c: fused(c) for c in copies])
    row = {"product": name, "prologue": prologue, "weight": weight,
           "dtype": str(dtype)[6:], "N": n, "K": k, "M": m, "rel_err": err, "us": 1e3 * ms}
    if tiles is not None:  # the tiles that ran (a None of `tiles` is the shape's own)
        b_n, warps, unroll, split = dg.launch_tiles(n, k, fused_w(copies[0]), dtype,
                                                    GEMV_PROLOGUE[prologue])
        row.update(BLOCK_N=b_n, warps=warps, UNROLL=unroll, SPLIT=split, first_s=first_s,
                   ok=err <= tol(dtype))
        return row
    ms_unfused = bench_graph(run, [lambda c=c: unfused(c) for c in copies])
    # the unfused product sums in another order (cuBLAS), and w4's reference rounds
    # nothing more: both within the dtype's tolerance of the kernel
    return {**row, "unfused_us": 1e3 * ms_unfused, "vs_unfused": ms_unfused / ms,
            "first_s": first_s, "ok": err <= tol(dtype)}


def check_decode_gemv(run) -> None:
    dtype = kernel_dtype(run)
    cases = [(p, 1, wt) for wt in ("dense", "w4") for p in GEMV_PRODUCTS] + [
        (GEMV_PRODUCTS[0], 4, "dense"), (GEMV_PRODUCTS[0], 4, "w4")]
    quick = [cases[0], cases[len(GEMV_PRODUCTS)]]  # qkv, dense and w4
    for (name, n, k, prologue), m, weight in run.pick(cases, quick, quick):
        if run.dry:  # the interpreter: a small twin of the shape (K a multiple of 64)
            n, k = n // 8, 64 * (k // 576)
        run.case(f"{name} {weight} M={m}",
                 lambda name=name, n=n, k=k, prologue=prologue, m=m, weight=weight:
                 gemv_case(run, name, n, k, prologue, m, weight, dtype))
    run.notes.append("decode GEMV (minillm.kernels.decode_gemv): the glue before a weight "
                     "product done in the product's kernel (and for qkv, RoPE and the K/V "
                     "store after it); us: the fused call, unfused_us: the Triton glue kernel "
                     "then cuBLAS (dense) or the W4A16 kernel (w4, g64 asym; o_proj: no glue, "
                     "the product alone), then for qkv glue.rope_kv, all GPU time per call "
                     "replayed from a CUDA graph over weight "
                     "copies larger than L2; vs_unfused > 1: the fused call is faster; "
                     "rel_err against the unfused result, relative to its max")


# ----------------------------------------------------------------------------- gemv_tiles

# The decode GEMV's pinned tiles are its rule's (`decode_gemv._analytic`) until measured. On
# the H100 of 2026-11-27 (evening) SmolLM2's w4 batch-1 step lost to bf16 by 0.77x, and the
# decode_gemv section named where: SiLU·up + down in int4, 8.61 µs against 5.30 in bf16, its
# 4-row, one-warp tile giving N = 576 only 144 programs. This opt-in section times the
# candidates (`decode_gemv.INT4_TILES`, `DENSE_TILES`) of every SmolLM2 product at M = 1
# (`decode_gemv.tiles`), w4 first, and keeps each product's fastest for its shape class
# (`tuning.record_measured`): the sections after it in the same run (or a later process
# given the tuned file, MINILLM_TUNED) decode with them, and `pin_configs.py --merge` pins
# them. `gpu_check.py --sections gemv_tiles`.
GEMV_TILE_ORDER = ("down", "o_proj", "gate_up", "qkv")  # the losers first


def gemv_tile_candidates(weight: str, k: int, group: int = 64) -> list[dict]:
    """{block_n, warps, unroll, split} to time for one product (`decode_gemv.INT4_TILES`,
    `DENSE_TILES`): 4-bit, one chunk a step with 8 chunks a loop (the default past 12) or
    4, or all of K in one loop; or SPLIT chunks side by side, 1 or 3 steps a loop; float,
    {block_n, warps} (K's own step)."""
    from minillm.kernels import decode_gemv as dg

    if weight == "w4":
        chunks = k // group
        unrolls = {dg._int4_unroll(k, group), min(4, chunks), chunks}
        return [{"block_n": b, "warps": w, "unroll": u, "split": sp}
                for b, w, u, sp in dg.INT4_TILES if sp > 1 or u in unrolls]
    return [{"block_n": b, "warps": w} for b, w, _, _ in dg.DENSE_TILES]


def check_gemv_tiles(run) -> None:
    from minillm.kernels import decode_gemv as dg

    dtype = kernel_dtype(run)
    products = sorted(GEMV_PRODUCTS, key=lambda p: GEMV_TILE_ORDER.index(p[0]))
    cases = []
    for weight in ("w4", "dense"):
        for name, n, k, prologue in products:
            if run.dry:  # the interpreter: a small twin (K kept: the candidates' steps)
                n = n // 8
            cands = gemv_tile_candidates(weight, k)
            if not run.dry:  # the pinned tiles first, so a quick run or a cut box times them
                cands.sort(key=lambda c, n=n, k=k, prologue=prologue, weight=weight:
                           not tiles_are_default(dg, n, k, prologue, weight, c, dtype))
            cases += [(name, n, k, prologue, weight, c) for c in
                      run.pick(cands, cands[:4] if name in ("down", "o_proj") else [], cands[:1])]
    if run.dry:
        cases = cases[:2] + [c for c in cases if c[4] == "dense"][:1]
    for name, n, k, prologue, weight, tiles in cases:
        label = f"{name} {weight} " + " ".join(f"{a}={b}" for a, b in tiles.items())
        run.case(label, lambda name=name, n=n, k=k, prologue=prologue, weight=weight,
                 tiles=tiles: tile_case(run, dg, name, n, k, prologue, weight, dtype, tiles))
    fastest = fastest_tiles(run.rows, dtype)
    for bucket, cfg, best, own in fastest:
        vs = (f", {own['us'] / best['us']:.2f}x the pinned tiles' {own['us']:.2f} µs" if own
              else ", not compared with the pinned tiles (not timed): not kept")
        split = f" SPLIT={best['SPLIT']}" if best.get("SPLIT", 1) > 1 else ""
        run.notes.append(f"{best['product']} {best['weight']}: fastest BLOCK_N={best['BLOCK_N']} "
                         f"warps={best['warps']} UNROLL={best['UNROLL']}{split}, "
                         f"{best['us']:.2f} µs" + vs)
    if not run.dry:  # from here on this process launches them; gpu_check writes them out
        from minillm.kernels import tuning

        arch = tuning.device_arch(run.device)
        for bucket, cfg, best, _ in kept_tiles(fastest):
            tuning.record_measured("decode_gemv", arch, bucket, cfg, best["us"])
            best["kept"] = True  # in the report: what the sections after this one launch
        run.notes.append("each product's fastest tiles, where the pinned ones were timed too, "
                         "are kept for its shape class: the sections after this one launch "
                         "them, and <out>.tuned.json has them for benchmarks/pin_configs.py "
                         "--merge")
    run.notes.append("decode GEMV tiles (decode_gemv.tiles) at M = 1, each timed from a CUDA "
                     "graph over weight copies larger than L2, as the decode_gemv section "
                     "times the pinned ones; default: the tiles pinned for the shape")


def kept_tiles(fastest: list[tuple]) -> list[tuple]:
    """The `fastest_tiles` entries to keep: those timed against the pinned tiles (a product
    whose pinned row a quick run or the box left out has no winner worth pinning)."""
    return [f for f in fastest if f[3] is not None]


# What each product's prologue is called by `decode_gemv.launch_tiles`.
GEMV_PROLOGUE = {"add+norm+rope": "norm", "add+norm": "norm", "silu·up": "silu", "none": "none"}


def fastest_tiles(rows: list[dict], dtype) -> list[tuple]:
    """(decode GEMV bucket, its config, the fastest correct row, the pinned tiles' row or
    None) for each product and weight of a gemv_tiles run, in the rows' order. A row that
    failed, or erred beyond the dtype's tolerance, is never the fastest."""
    from minillm.kernels import decode_gemv as dg

    prologue = {name: GEMV_PROLOGUE[p] for name, _, _, p in GEMV_PRODUCTS}
    out = []
    timed = [r for r in rows if "us" in r and r.get("ok")]
    for (name, weight), group in itertools.groupby(timed, key=lambda r: (r["product"],
                                                                         r["weight"])):
        group = list(group)
        best = min(group, key=lambda r: r["us"])
        own = next((r for r in group if r.get("default")), None)
        bucket = dg.bucket_of(best["N"], best["K"], gemv_stand_in(weight, best["K"]), dtype,
                              prologue[name])
        out.append((bucket, dg._config(best["BLOCK_N"], best["warps"], best["UNROLL"],
                                       best.get("SPLIT", 1)), best, own))
    return out


def tile_case(run, dg, name, n, k, prologue, weight, dtype, tiles) -> dict:
    """One candidate's row; a candidate the GPU cannot run (Triton's OutOfResources: more
    registers or shared memory than it has) is a row that says so, not a failure."""
    try:
        row = gemv_case(run, name, n, k, prologue, 1, weight, dtype, tiles)
    except Exception as e:  # noqa: BLE001
        if type(e).__name__ != "OutOfResources":
            raise
        return {"product": name, "weight": weight, "N": n, "K": k, "M": 1,
                "BLOCK_N": tiles["block_n"], "warps": tiles["warps"],
                "UNROLL": tiles.get("unroll", 1), "SPLIT": tiles.get("split", 1),
                "error": f"does not fit: {e}"[:200]}
    return {**row, "default": tiles_are_default(dg, n, k, prologue, weight, tiles, dtype)}


def tiles_are_default(dg, n, k, prologue, weight, tiles, dtype, arch=None) -> bool:
    """Whether ``tiles`` are the ones a launch of this shape gets without `decode_gemv.tiles`
    (on a GPU of ``arch``; None: this process's)."""
    own = dg.launch_tiles(n, k, gemv_stand_in(weight, k), dtype, GEMV_PROLOGUE[prologue], arch)
    return own == (tiles["block_n"], tiles["warps"], tiles.get("unroll", 1),
                   tiles.get("split", 1))


# ----------------------------------------------------------------------------- w4a16_tiles

# The W4A16 kernel's pinned tiles at M = 1 (`w4a16.W4A16_GEMV`) and M = 16 (`W4A16_SMALL_M`)
# were chosen on the H100 of 2026-11-26 by the autotuner, whose do_bench loop re-reads a
# weight that fits in the 50 MB L2 (4,096 x 4,096 in 4 bits is 10 MB), or follow a rule:
# the tiles of a kernel reading from L2, where a decode step reads from HBM. On the H200
# (2026-11-28) its int4 weight streamed at most 1.29 TB/s of 4.3, and at M = 16 it was
# 0.62-0.92x dense. This opt-in section times every candidate of both (40 at M = 1, 31 at
# M = 16) at the w4a16 section's four shapes, each from a CUDA graph over weight copies
# larger than L2 as that section times them: every class's pinned tiles first, then the
# other candidates taking turns across the classes, so that a box cutting the tail leaves
# each class compared with its pinned tiles. Each class's fastest is kept
# (`tuning.record_measured`: `<out>.tuned.json`, then `pin_configs.py --merge <tuned>
# --kernel w4a16_gemv` and `--kernel w4a16_small_m`). `gpu_check.py --sections w4a16_tiles`.
W4A16_TILE_SHAPES = [(4096, 4096), (14336, 4096), (3072, 576), (49152, 576)]
W4A16_TILE_ROWS = (1, 16)


def w4a16_tile_candidates(tunable, pinned) -> list:
    """The pinned config first, then every other candidate of ``tunable``."""
    from minillm.kernels import tuning

    key = repr(tuning.config_to_dict(pinned))
    return [pinned] + [c for c in tunable.configs if repr(tuning.config_to_dict(c)) != key]


def w4a16_tile_case(run, n, k, m, dtype, cfg, pinned) -> dict:
    """One candidate config of the W4A16 kernel at [m, k] x [n, k] (g64 asymmetric), launched
    through `w4a16_linear` itself (`tuning.trying`), timed as the w4a16 section times it."""
    from minillm.kernels import tuning
    from minillm.kernels import w4a16 as wk

    qweight, scales, zeros = w4_weight(run, n, k)
    torch.manual_seed(m)
    x = randn(run, m, k, dtype=dtype)
    tunable, bucket = wk.bucket_for(m, n, k, 64, dtype)
    arch = tuning.device_arch(run.device) if run.cuda else 0  # the interpreter: its own tiles
    head = {"dtype": str(dtype)[6:], "N": n, "K": k, "M": m, "layout": "g64 asym",
            "config": _config_str(cfg)}
    with tuning.trying(tunable.name, arch, bucket, cfg):
        out, first_s = first_call(run, lambda: w4a16_linear(x, qweight, scales, zeros, 64))
        if run.cuda and tunable.config_for(bucket, run.device) is not cfg:  # it fell back
            return {**head, "error": "does not fit this GPU: the launch fell back to "
                                     + _config_str(tunable.config_for(bucket, run.device))}
        ref = F.linear(x, packing.dequantize_packed(qweight, scales, zeros, 4, dtype))
        err = max_err(out, ref) / max(float(ref.abs().max()), 1e-12)
        nbytes = sum(t.numel() * t.element_size() for t in (qweight, scales, zeros))
        packed = copies_past_l2(run, qweight, scales, zeros)
        ms = bench_graph(run, [lambda w=w: w4a16_linear(x, *w, 64) for w in packed])
    gbs, frac = kv_gbps(run, nbytes, ms)
    same = repr(tuning.config_to_dict(cfg)) == repr(tuning.config_to_dict(pinned))
    return {**head, "rel_err": err, "us": 1e3 * ms, "weight_GBps": gbs, "of_bandwidth": frac,
            "first_s": first_s, "ok": err <= tol(dtype), "default": same}


def check_w4a16_tiles(run) -> None:
    from minillm.kernels import tuning
    from minillm.kernels import w4a16 as wk

    dtype = kernel_dtype(run)
    classes = run.pick([(n, k, m) for m in W4A16_TILE_ROWS for n, k in W4A16_TILE_SHAPES],
                       [(4096, 4096, 1), (4096, 4096, 16)], [(96, 128, 1), (96, 128, 16)])
    arch = tuning.device_arch(run.device) if run.cuda else None
    plans = []
    for n, k, m in classes:
        tunable, bucket = wk.bucket_for(m, n, k, 64, dtype)
        pinned = tunable.config_on(bucket, arch) if arch else tunable.interpreter
        cands = w4a16_tile_candidates(tunable, pinned)
        plans.append((n, k, m, tunable, bucket, pinned, run.pick(cands, cands[:6], cands[:2])))
    # Every class's pinned tiles first, then the other candidates taking turns.
    turns = itertools.zip_longest(*[[(n, k, m, pinned, c) for c in cands[1:]]
                                    for n, k, m, _, _, pinned, cands in plans])
    order = [(n, k, m, pinned, cands[0]) for n, k, m, _, _, pinned, cands in plans] + [
        t for turn in turns for t in turn if t is not None]
    try:
        for n, k, m, pinned, cfg in order:
            run.case(f"N={n} K={k} M={m} {_config_str(cfg)}",
                     lambda n=n, k=k, m=m, cfg=cfg, pinned=pinned:
                     w4a16_tile_case(run, n, k, m, dtype, cfg, pinned))
    finally:
        _W4_WEIGHTS.clear()
    for n, k, m, tunable, bucket, _, cands in plans:
        rows = [r for r in run.rows if (r.get("N"), r.get("K"), r.get("M")) == (n, k, m)
                and "us" in r]
        good = [r for r in rows if r.get("ok")]
        if not good:
            continue
        best = min(good, key=lambda r: r["us"])
        own = next((r for r in rows if r["default"]), None)
        run.notes.append(f"{n} x {k}, M = {m}: fastest {best['config']}, {best['us']:.2f} µs, "
                         f"{best['weight_GBps']:.0f} GB/s" + (
                             f", {own['us'] / best['us']:.2f}x the pinned tiles' "
                             f"{own['us']:.2f} µs" if own else
                             ", not compared with the pinned tiles (not timed): not kept"))
        if arch and own is not None:  # from here on this process launches it
            cfg = next(c for c in cands if _config_str(c) == best["config"])
            tuning.record_measured(tunable.name, arch, bucket, cfg, best["us"])
            best["kept"] = True
    run.notes.append("W4A16 candidates (w4a16.W4A16_GEMV at M = 1, W4A16_SMALL_M at 16), g64 "
                     "asymmetric, each launched through w4a16_linear (tuning.trying) and timed "
                     "from a CUDA graph over weight copies larger than L2; GB/s counts the "
                     "packed weight, fp32 scales and zeros; default: the tiles pinned for the "
                     "class; kept: the fastest, for its class (<out>.tuned.json)"
                     + ("" if run.cuda else "; on the interpreter every candidate runs the "
                        "interpreter's own tiles"))


# Time boxes (s), planned for an H100 with the pinned tile configs (a first call of a new
# shape compiles one configuration, 0.2-2.6 s): see TOTAL_BUDGET_S in gpu_check.py. Full
# run, against what the H100 took in the evening of 2026-11-27 (a fresh machine: every
# kernel compiled; 89 s in all):
#   flash_attention  28  (24 s, every row)
#   paged_decode     10  (8 s, every row, each timed from a CUDA graph)
#   varlen           38  (34 s, every row, context 8192 included)
#   w4a16            17  (14 s, every row and layout)
#   decode_gemv      18  (9.1 s for 7 of its 10 rows: the box of 8 cut o_proj w4 and the
#                         two M = 4 rows, ~2 s each with their compiles)
SECTIONS = [
    Section("flash_attention", "FlashAttention (causal, GQA) against SDPA and float64",
            check_flash, {"full": 28, "quick": 15, "dry": 120}),
    Section("paged_decode", "Paged decode attention against the PyTorch paged reference",
            check_paged, {"full": 10, "quick": 8, "dry": 60}),
    Section("varlen", "FlashAttention varlen (chunked prefill) against the paged reference",
            check_varlen, {"full": 38, "quick": 8, "dry": 60}),
    Section("w4a16", "W4A16 matmul against a dense matmul and dequantize-then-matmul",
            check_w4a16, {"full": 17, "quick": 6, "dry": 60}),
    Section("decode_gemv", "Decode GEMV with its glue fused, against glue + product",
            check_decode_gemv, {"full": 18, "quick": 4, "dry": 60}),
]
# Run only when asked for (`--sections gemv_tiles`), outside the check's 8 minutes, with a
# budget of its own: 107 candidates (83 w4 first, then 24 bf16) of ~1 s each (a compile,
# then a graph; int4 at UNROLL 24 compiles for longer), so the box may cut the bf16 tail.
# (The H200, 2026-11-28: 110 of 113 candidates in 150 s; the 3 cut were bf16 tiles of 8
# and 16 rows, the slowest of every other product.)
# w4a16_tiles: 284 candidates (40 a shape at M = 1, 31 at M = 16; SPLIT_K is a run-time
# argument: 8 and 7 programs a shape compiled), each timed from a graph; not yet run on a
# GPU: the box may cut the tail, which takes turns across the classes.
ASKED_ONLY = [
    Section("gemv_tiles", "Decode GEMV tiles: candidates timed against the shape's own",
            check_gemv_tiles, {"full": 150, "quick": 30, "dry": 120}),
    Section("w4a16_tiles", "W4A16 tiles (M = 1 and 16): candidates timed against the pinned",
            check_w4a16_tiles, {"full": 150, "quick": 25, "dry": 120}),
]
