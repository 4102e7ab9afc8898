"""Closed-form formulas of LLM inference: memory, speed, parallelism, cost, queueing.

Every worked number in the labs, quizzes and widgets is computed here, so the book and the
widgets cannot disagree. Everything is plain Python on ints and floats (no torch, no numpy):
a widget can call it on every slider move.

Conventions (the invariants of this module):
- Units are bytes, seconds and FLOPs. A multiply-add counts as 2 FLOPs.
- Prefixes are SI: 1 GB = 1e9 bytes, 1 TB/s = 1e12 bytes/s. Where a textbook's number is
  really in GiB (2**30 bytes) the docstring says so; the constants ``GB`` and ``GiB`` are
  both here so a cell can show both.
- ``dtype_bytes`` is bytes per element: 4 for fp32, 2 for fp16/bf16, 1 for fp8/int8, 0.5 for
  int4 (see ``DTYPE_BYTES``).
- Bad arguments raise ``ValueError`` whose message names the argument, shows the value
  given and says what is allowed. No function mutates its inputs.
"""

from __future__ import annotations

import math
import numbers
KB = 1e3
MB = 1e6
GB = 1e9
TB = 1e12
GiB = 2**30

#: Average hours in a calendar month (8760 h / 12), the figure cloud bills use.
HOURS_PER_MONTH = 730

#: Bytes per element of the formats the course meets.
DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}


# --------------------------------------------------------------------------- validation


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int(name: str, value, minimum: int = 1) -> int:
    """Return ``value`` as an int, or raise if it is not an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}; got {_describe(value)}.")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def _real(name: str, value, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float, or raise if it is not a finite number > 0 (>= 0)."""
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number {bound}; got {_describe(value)}.")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}.")
    return value


def _probability(name: str, value, *, allow_zero: bool = True) -> float:
    low = "0 <=" if allow_zero else "0 <"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a probability ({low} {name} <= 1); got {_describe(value)}.")
    value = float(value)
    if not (0 <= value <= 1) or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a probability ({low} {name} <= 1); got {value!r}.")
    return value


def _items(name: str, values, what: str) -> list:
    """The elements of a non-empty list, tuple or array (not a string)."""
    try:
        items = [] if isinstance(values, (str, bytes)) else list(values)
    except TypeError:
        items = []
    if not items:
        raise ValueError(f"{name} must be a non-empty list of {what}; got {_describe(values)}.")
    return items


def _lengths(name: str, values) -> list[int]:
    items = _items(name, values, "integers >= 1 (one per request)")
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(items)]


def _heads(num_heads, num_kv_heads) -> tuple[int, int]:
    h = _int("num_heads", num_heads)
    hkv = _int("num_kv_heads", num_kv_heads)
    if hkv > h or h % hkv:
        raise ValueError(
            f"num_kv_heads must divide num_heads (each KV head serves a whole group of query "
            f"heads); got num_heads={h}, num_kv_heads={hkv}. Allowed: a divisor of {h}."
        )
    return h, hkv


# --------------------------------------------------------------------------- KV cache


def kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes=2) -> float:
    """KV-cache bytes one token adds: ``2 · L · H_kv · D · dtype_bytes``.

    The 2 is one K and one V vector per KV head per layer. Llama-2-70B (80 layers, 8 KV
    heads, head_dim 128) in fp16: 327,680 bytes (320 KiB) per token.
    """
    layers = _int("num_layers", num_layers)
    kv_heads = _int("num_kv_heads", num_kv_heads)
    dim = _int("head_dim", head_dim)
    b = _real("dtype_bytes", dtype_bytes)
    return 2 * layers * kv_heads * dim * b


def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, dtype_bytes=2, batch=1) -> float:
    """KV-cache bytes: ``2 · L · H_kv · D · T · dtype_bytes · batch``.

    Llama-2-70B at T = 4096 in fp16: 1.34 GB per sequence (with 64 KV heads, i.e. MHA:
    10.7 GB). Llama-3-8B (32 layers, 8 KV heads, 128) at 8192: 1.07 GB. GPT-3 175B
    (96 layers, 96 heads, 128, MHA) at 4096: 19.3 GB, which is 18.0 GiB, the "about 18 GB"
    many texts quote.
    """
    per_token = kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
    return per_token * _int("seq_len", seq_len) * _int("batch", batch)


def gqa_reduction(num_heads, num_kv_heads) -> int:
    """How many times smaller the KV cache is than MHA's: ``num_heads / num_kv_heads``.

    MHA gives 1, MQA gives ``num_heads``; GQA 32/8 gives 4, 64/8 gives 8.
    """
    h, hkv = _heads(num_heads, num_kv_heads)
    return h // hkv


def attention_kind(num_heads, num_kv_heads) -> str:
    """Name the attention variant: ``"MHA"`` (one KV head per query head), ``"MQA"`` (one KV
    head in all) or ``"GQA"`` (groups of query heads share a KV head)."""
    h, hkv = _heads(num_heads, num_kv_heads)
    if hkv == h:
        return "MHA"
    if hkv == 1:
        return "MQA"
    return "GQA"


def attention_matrix_bytes(seq_len, dtype_bytes=2, num_heads=1, batch=1) -> float:
    """Bytes of the T×T score matrix naive attention materializes: ``T² · dtype_bytes · H · B``.

    At T = 128K (131,072) in fp16, one head: 34.4 GB = 32 GiB. FlashAttention never stores it.
    """
    t = _int("seq_len", seq_len)
    return t * t * _real("dtype_bytes", dtype_bytes) * _int("num_heads", num_heads) * _int("batch", batch)


# --------------------------------------------------------------------------- weights and memory


def weight_bytes(num_params, dtype_bytes) -> float:
    """Bytes of the weights: ``N · dtype_bytes``. 13B in fp16: 26 GB; 70B: 140 GB."""
    return _real("num_params", num_params) * _real("dtype_bytes", dtype_bytes)


def quantized_weight_bytes(num_params, bits, group_size=None, scale_bytes=2) -> float:
    """Bytes of group-quantized weights: ``N · bits / 8 + (N / group_size) · scale_bytes``.

    ``scale_bytes`` is the metadata stored per group: 2 for one fp16 scale (symmetric), 4
    for an fp16 scale plus an fp16 minimum (GGUF Q4_1). ``group_size=None`` means one scale
    for the whole tensor (its bytes are then negligible and left out). Example: Q4_1 is
    bits=4, group_size=32, scale_bytes=4, i.e. 5 bits per weight.
    """
    n = _real("num_params", num_params)
    b = _int("bits", bits)
    total = n * b / 8
    if group_size is not None:
        total += n / _int("group_size", group_size) * _real("scale_bytes", scale_bytes, allow_zero=True)
    return total


def memory_per_gpu(weight_bytes, tp) -> float:
    """Weight bytes each GPU holds under tensor parallelism of degree ``tp``: ``W / tp``.

    70B in fp16 (140 GB) at tp = 1 / 2 / 4 / 8: 140 / 70 / 35 / 17.5 GB. KV cache and
    activations come on top.
    """
    return _real("weight_bytes", weight_bytes) / _int("tp", tp)


def max_concurrent_sequences(memory_bytes, weight_bytes, kv_bytes_per_seq, overhead_bytes=0) -> int:
    """How many sequences' KV caches fit: ``floor((M − W − overhead) / kv_per_seq)``, at least 0.

    80 GB with a 14 GB model and 5 GB per sequence: floor(66 / 5) = 13.
    """
    memory = _real("memory_bytes", memory_bytes)
    weights = _real("weight_bytes", weight_bytes, allow_zero=True)
    per_seq = _real("kv_bytes_per_seq", kv_bytes_per_seq)
    overhead = _real("overhead_bytes", overhead_bytes, allow_zero=True)
    free = memory - weights - overhead
    if free <= 0:
        return 0
    # The tiny relative slack keeps float noise such as 60e9 / 5e9 = 11.999... from losing one.
    return int(math.floor(free / per_seq * (1 + 1e-12)))


# --------------------------------------------------------------------------- decode speed


def decode_tokens_per_s(num_params, dtype_bytes, bandwidth_bytes_per_s, kv_bytes=0) -> float:
    """Bandwidth-bound ceiling of batch-1 decode: ``bandwidth / (N · dtype_bytes + kv_bytes)``.

    Each step must read every weight once (plus ``kv_bytes`` of KV cache), so no batch-1
    decoder can beat this. At 2 TB/s in fp16: 70B → 14.3 tok/s, 7B → 143, 405B → 2.47.
    """
    bw = _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    per_step = weight_bytes(num_params, dtype_bytes) + _real("kv_bytes", kv_bytes, allow_zero=True)
    return bw / per_step


def decode_step_time_s(num_params, dtype_bytes, bandwidth_bytes_per_s, peak_flops, batch=1,
                       kv_bytes_per_seq=0) -> float:
    """Roofline time of one batched decode step: ``max(bytes / bandwidth, FLOPs / peak)``.

    bytes = ``N · dtype_bytes + batch · kv_bytes_per_seq`` (weights read once, shared by the
    batch); FLOPs = ``2 · N · batch``. Attention FLOPs are left out.
    """
    b = _int("batch", batch)
    moved = weight_bytes(num_params, dtype_bytes) + b * _real("kv_bytes_per_seq", kv_bytes_per_seq, allow_zero=True)
    flops = 2 * _real("num_params", num_params) * b
    return max(moved / _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
               flops / _real("peak_flops", peak_flops))


def batched_decode_tokens_per_s(num_params, dtype_bytes, bandwidth_bytes_per_s, peak_flops,
                                batch=1, kv_bytes_per_seq=0) -> float:
    """Total tokens/s of a decode batch on the roofline: ``batch / decode_step_time_s(...)``.

    Grows almost linearly with ``batch`` while memory-bound, then flattens at the compute roof.
    """
    step = decode_step_time_s(num_params, dtype_bytes, bandwidth_bytes_per_s, peak_flops,
                              batch, kv_bytes_per_seq)
    return _int("batch", batch) / step


# --------------------------------------------------------------------------- FLOPs


def _attention_dims(num_layers, attn_dim) -> tuple[int, int]:
    layers = _int("num_layers", num_layers, minimum=0)
    dim = _int("attn_dim", attn_dim, minimum=0)
    if (layers == 0) != (dim == 0):
        raise ValueError(
            f"num_layers and attn_dim go together (both 0 to leave attention out, both >= 1 "
            f"to count it); got num_layers={layers}, attn_dim={dim}."
        )
    return layers, dim


def prefill_flops(num_params, num_tokens, num_layers=0, attn_dim=0) -> float:
    """FLOPs to prefill a prompt: ``2 · N · T`` (+ causal attention ``2 · L · d · T · (T + 1)``).

    Every token meets every weight once (a multiply-add, 2 FLOPs). With ``num_layers`` and
    ``attn_dim`` (= num_heads · head_dim) the attention term is added: token t scores t
    keys (QKᵀ, 2·d·t FLOPs per layer) and mixes t values (P·V, 2·d·t), summed over
    t = 1..T. It matters only once T approaches ~N / (L·d).
    """
    n = _real("num_params", num_params)
    t = _int("num_tokens", num_tokens)
    layers, dim = _attention_dims(num_layers, attn_dim)
    return 2 * n * t + 2 * layers * dim * t * (t + 1)


def decode_flops(num_params, context_len=0, num_layers=0, attn_dim=0) -> float:
    """FLOPs to decode one token: ``2 · N`` (+ attention ``4 · L · d · context_len``).

    ``context_len`` is the number of positions the new token attends to (cached tokens plus
    itself); the attention term needs ``num_layers`` and ``attn_dim`` (= num_heads ·
    head_dim): QKᵀ and P·V each cost 2·d FLOPs per position per layer. (Kaplan et al.'s
    table writes 2·L·T·d for this term, counting only QKᵀ.) Softmax is left out.
    """
    n = _real("num_params", num_params)
    ctx = _int("context_len", context_len, minimum=0)
    layers, dim = _attention_dims(num_layers, attn_dim)
    if ctx and not layers:
        raise ValueError(
            f"context_len={ctx} needs num_layers and attn_dim to price attention; "
            "pass them too, or leave context_len=0 for the 2·N estimate."
        )
    return 2 * n + 4 * layers * dim * ctx


# --------------------------------------------------------------------------- arithmetic intensity


def matvec_intensity(rows, cols, dtype_bytes) -> float:
    """FLOPs per byte of y = W·x with W rows×cols: ``2·r·c / ((r·c + c + r) · dtype_bytes)``.

    Each operand is read once and the output written once. For a large fp16 W this is
    about 1 FLOP/byte: batch-1 decode, far below any GPU's ridge point.
    """
    r = _int("rows", rows)
    c = _int("cols", cols)
    return 2 * r * c / ((r * c + c + r) * _real("dtype_bytes", dtype_bytes))


def matmul_intensity(m, n, k, dtype_bytes) -> float:
    """FLOPs per byte of C[m×n] = A[m×k]·B[k×n]: ``2·m·n·k / ((m·k + k·n + m·n) · dtype_bytes)``.

    Each operand read once, the output written once (ideal caching). A decode batch of B
    tokens through a d_out×d_in weight is ``matmul_intensity(B, d_out, d_in, ...)``: the
    intensity grows about linearly with B while B ≪ d.
    """
    m_ = _int("m", m)
    n_ = _int("n", n)
    k_ = _int("k", k)
    return 2 * m_ * n_ * k_ / ((m_ * k_ + k_ * n_ + m_ * n_) * _real("dtype_bytes", dtype_bytes))


def attention_intensity(seq_len, head_dim, num_heads, num_kv_heads=None, dtype_bytes=2) -> float:
    """FLOPs per byte of one decode step's attention (one sequence, one layer).

    FLOPs = ``4 · H · T · D`` (QKᵀ and P·V, softmax left out). Bytes = ``(2 · H_kv · T · D +
    2 · H · D) · dtype_bytes``: the whole K and V cache read once, plus q in and the output
    out. About ``2 · (H / H_kv) / dtype_bytes``: 1 FLOP/byte for MHA in fp16, 4 for GQA 32/8.
    Batching does not help: every sequence reads its own cache.
    """
    t = _int("seq_len", seq_len)
    d = _int("head_dim", head_dim)
    h, hkv = _heads(num_heads, num_heads if num_kv_heads is None else num_kv_heads)
    b = _real("dtype_bytes", dtype_bytes)
    return 4 * h * t * d / ((2 * hkv * t * d + 2 * h * d) * b)


def ridge_point(peak_flops, bandwidth_bytes_per_s) -> float:
    """Intensity (FLOPs/byte) where the roofline turns: ``peak_flops / bandwidth``.

    A100: 312e12 / 2e12 = 156 (153 with the exact 2.039 TB/s). H100 SXM: 989e12 / 3.35e12 = 295.
    """
    return _real("peak_flops", peak_flops) / _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s)


def roofline_flops(intensity, peak_flops, bandwidth) -> float:
    """Attainable FLOP/s at an arithmetic intensity: ``min(peak, intensity · bandwidth)``."""
    return min(_real("peak_flops", peak_flops),
               _real("intensity", intensity) * _real("bandwidth", bandwidth))


# --------------------------------------------------------------------------- batching


def static_batch_wasted_steps(output_lengths) -> int:
    """Slot-steps a static batch wastes: ``Σ (max − len_i)``.

    The batch runs until its longest member finishes; a finished slot idles. 7 requests of
    20 tokens and one of 500: 7 · 480 = 3,360.
    """
    lengths = _lengths("output_lengths", output_lengths)
    longest = max(lengths)
    return sum(longest - n for n in lengths)


def static_batch_utilization(output_lengths) -> float:
    """Fraction of slot-steps doing useful work: ``Σ len_i / (n · max)``. 7×50 + 500: 0.2125."""
    lengths = _lengths("output_lengths", output_lengths)
    return sum(lengths) / (len(lengths) * max(lengths))


def static_batch_throughput(output_lengths, step_time_s) -> float:
    """Tokens/s of one static batch: ``Σ len_i / (max · step_time)``.

    One step emits a token for every unfinished request; the batch lasts ``max`` steps.
    7×50 + 500 at 10 ms/step: 850 tokens / 5 s = 170 tok/s.
    """
    lengths = _lengths("output_lengths", output_lengths)
    return sum(lengths) / (max(lengths) * _real("step_time_s", step_time_s))


def continuous_batch_ideal_throughput(num_slots, step_time_s) -> float:
    """Ideal continuous-batching tokens/s: ``num_slots / step_time``.

    "Ideal" means every slot emits a useful token on every step: a finished request is
    replaced at once by a waiting one (the queue never runs dry), admission and prefill cost
    nothing, and the step time does not change with the batch's makeup. With 8 slots at
    10 ms/step that is 800 tok/s, against 170 for a static batch of 7×50 + 500 (utilization
    0.2125 × 800 = 170). For one fixed batch of 8 with nobody waiting, continuous batching
    also takes 500 steps: the gain needs a queue.
    """
    return _int("num_slots", num_slots) / _real("step_time_s", step_time_s)


# --------------------------------------------------------------------------- speculative decoding


def spec_expected_tokens(alpha, k) -> float:
    """Expected tokens per target pass with k drafted tokens: ``(1 − α^(k+1)) / (1 − α)``.

    α is the per-token acceptance rate (assumed independent). Draft token i survives only if
    all before it were accepted, and the pass always adds one token of its own (the
    correction or a bonus token), so E = 1 + α + α² + … + α^k. α = 1 gives k + 1.
    """
    a = _probability("alpha", alpha)
    kk = _int("k", k, minimum=0)
    if a == 1:
        return float(kk + 1)
    return (1 - a ** (kk + 1)) / (1 - a)


def spec_expected_tokens_naive(alpha, k) -> float:
    """The textbook shortcut ``k · α + 1``: it treats draft tokens as accepted independently
    of one another, ignoring that the first rejection discards the rest, so it overestimates
    (α = 0.8, k = 5: 5.0 against the true 3.69)."""
    return _int("k", k, minimum=0) * _probability("alpha", alpha) + 1


def spec_speedup(alpha, k, cost_ratio) -> float:
    """Speedup over plain decoding: ``expected_tokens / (1 + k · r)``.

    ``r`` = cost of one draft step ÷ cost of one target step. One round costs k draft steps
    plus one target pass (verifying k tokens costs about one step while memory-bound).
    k = 0 is plain decoding (speedup 1).
    """
    r = _real("cost_ratio", cost_ratio, allow_zero=True)
    kk = _int("k", k, minimum=0)
    return spec_expected_tokens(alpha, kk) / (1 + kk * r)


def spec_optimal_k(alpha, cost_ratio, k_max=16) -> int:
    """The k in 0..k_max with the highest ``spec_speedup`` (the smallest one on ties).

    0 means speculation does not pay. α = 0.8, r = 0.05 gives k = 8 (speedup 3.09); the curve
    is flat there: every k from 6 to 10 is within 2% of it.
    """
    kmax = _int("k_max", k_max)
    return max(range(kmax + 1), key=lambda kk: (spec_speedup(alpha, kk, cost_ratio), -kk))


def spec_acceptance_probability(p, q) -> float:
    """Probability of accepting a drafted token: ``min(1, p / q)``.

    p = target model's probability of the token, q = draft model's (q > 0, since the draft
    sampled it). p = 0.3, q = 0.6 → 0.5. On rejection, resample from norm(max(0, p − q)).
    """
    p_ = _probability("p", p)
    q_ = _probability("q", q, allow_zero=False)
    return min(1.0, p_ / q_)


# --------------------------------------------------------------------------- parallelism


def ring_allreduce_bytes(message_bytes, num_gpus) -> float:
    """Bytes each GPU sends in a ring all-reduce: ``2 · (N − 1) / N · message_bytes``.

    A reduce-scatter then an all-gather, each N − 1 steps of message/N bytes. N = 1: 0.
    """
    n = _int("num_gpus", num_gpus)
    return 2 * (n - 1) / n * _real("message_bytes", message_bytes, allow_zero=True)


def allreduce_time_s(message_bytes, num_gpus, link_bandwidth_bytes_per_s, latency_s=0.0) -> float:
    """Ring all-reduce time: ``ring_allreduce_bytes / link_bandwidth + 2 · (N − 1) · latency``.

    ``link_bandwidth_bytes_per_s`` is what one GPU can send (NVLink 4: 900 GB/s as quoted,
    PCIe 4 x16: 64 GB/s); ``latency_s`` is paid once per ring step.
    """
    n = _int("num_gpus", num_gpus)
    bw = _real("link_bandwidth_bytes_per_s", link_bandwidth_bytes_per_s)
    lat = _real("latency_s", latency_s, allow_zero=True)
    return ring_allreduce_bytes(message_bytes, n) / bw + 2 * (n - 1) * lat


def tp_allreduces_per_layer() -> int:
    """All-reduces per transformer block under Megatron-style tensor parallelism: 2.

    Attention: column-parallel QKV, row-parallel O, then one all-reduce. MLP: column-parallel
    gate/up, row-parallel down, then another.
    """
    return 2


def pp_bubble_fraction(num_stages, num_microbatches) -> float:
    """Idle fraction of a pipeline: ``(N − 1) / (N − 1 + M)`` for N stages, M microbatches.

    M = 1 (batch 1): (N − 1) / N. More microbatches fill the bubble.
    """
    n = _int("num_stages", num_stages)
    m = _int("num_microbatches", num_microbatches)
    return (n - 1) / (n - 1 + m)


# --------------------------------------------------------------------------- cost


def cost_per_million_tokens(dollars_per_hour, tokens_per_s) -> float:
    """Dollars per 1M generated tokens: ``$/h ÷ (tok/s · 3600) × 1e6``.

    One A100 at $2.50/h serving 800 tok/s: $0.87 per million tokens.
    """
    return _real("dollars_per_hour", dollars_per_hour) / (_real("tokens_per_s", tokens_per_s) * 3600) * 1e6


def break_even_tokens_per_month(gpu_dollars_per_month, api_dollars_per_million_tokens) -> float:
    """Monthly tokens above which renting the GPU beats paying the API:
    ``gpu $/month ÷ api $/token`` = ``gpu $/month ÷ (api $/1M) × 1e6``.

    Only meaningful if the GPU can serve that many: compare with ``tok/s · 3600 ·
    HOURS_PER_MONTH``.
    """
    gpu = _real("gpu_dollars_per_month", gpu_dollars_per_month, allow_zero=True)
    api = _real("api_dollars_per_million_tokens", api_dollars_per_million_tokens)
    return gpu / api * 1e6


# --------------------------------------------------------------------------- queueing and latency


def utilization(arrival_rate, service_rate) -> float:
    """Server utilization ``ρ = λ / μ`` (requests/s over requests/s). ρ ≥ 1 means the queue
    grows without bound; latency already climbs steeply above about 0.8."""
    return _real("arrival_rate", arrival_rate, allow_zero=True) / _real("service_rate", service_rate)


def mm1_mean_latency(arrival_rate, service_rate) -> float:
    """Mean time in an M/M/1 system (queueing + service): ``W = 1 / (μ − λ)`` seconds.

    Equivalently (1/μ) / (1 − ρ): at ρ = 0.5 twice the service time, at 0.9 ten times.
    Raises ValueError at ρ ≥ 1, where no steady state exists.
    """
    lam = _real("arrival_rate", arrival_rate, allow_zero=True)
    mu = _real("service_rate", service_rate)
    if lam >= mu:
        raise ValueError(
            f"arrival_rate must be below service_rate for a stable queue; got arrival_rate={lam!r}, "
            f"service_rate={mu!r} (ρ = {lam / mu:.3g} >= 1): the queue grows without bound. "
            "Lower the arrival rate or add capacity."
        )
    return 1 / (mu - lam)


def littles_law_L(arrival_rate, mean_time_s) -> float:
    """Little's law: mean number in the system ``L = λ · W`` (requests/s × seconds)."""
    return _real("arrival_rate", arrival_rate, allow_zero=True) * _real("mean_time_s", mean_time_s, allow_zero=True)


def e2e_latency_s(ttft_s, itl_s, num_output_tokens) -> float:
    """End-to-end latency of a request: ``TTFT + (n − 1) · ITL``.

    The first token arrives at TTFT; each of the other n − 1 follows one ITL later. The
    common form TTFT + n · ITL counts one gap too many.
    """
    n = _int("num_output_tokens", num_output_tokens)
    return _real("ttft_s", ttft_s, allow_zero=True) + (n - 1) * _real("itl_s", itl_s, allow_zero=True)


# --------------------------------------------------------------------------- quantization


def symmetric_quantize(values, bits) -> tuple[float, list[int], list[float]]:
    """Symmetric (zero-point-free) quantization of one group, for worked examples.

    scale = max|v| / (2^(bits−1) − 1); q = clamp(round(v / scale), −qmax, qmax);
    dequantized = q · scale. Rounding is half-to-even, like ``torch.round``. Returns
    ``(scale, q, dequantized)``. An all-zero group gives scale 0 and zeros.

    [0.12, −0.83, 0.45, −0.21] at 4 bits: scale 0.1186, q = [1, −7, 4, −2], dequantized
    [0.119, −0.830, 0.474, −0.237], max error 0.027.
    """
    b = _int("bits", bits, minimum=2)
    vals = []
    for i, v in enumerate(_items("values", values, "numbers")):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise ValueError(f"values[{i}] must be a finite number; got {_describe(v)}.")
        vals.append(float(v))
    qmax = 2 ** (b - 1) - 1
    scale = max(abs(v) for v in vals) / qmax
    if scale == 0:
        return 0.0, [0] * len(vals), [0.0] * len(vals)
    q = [max(-qmax, min(qmax, round(v / scale))) for v in vals]
    return scale, q, [qi * scale for qi in q]
