"""Check the claim (Lab 10): published-sounding figures, some right and some wrong, each with
the ``minillm.calc`` computation that settles it.

A claim either states a number (``claimed``, in ``unit``), right when it lies within ``rtol``
of the computed value, or states a comparison (``holds`` given), right when ``holds`` is true
of the computed value. ``check`` says how to recompute it (the tool, never the value), for a
student whose verdict is wrong; ``lesson`` names the trap behind a wrong claim, with numbers,
shown only once every verdict is right.

    from quizzes import claims
    claims.report({"gpt3_kv": False, ...})   # one line per claim: calc's value, yours, calc's
                                             # verdict; then the slip behind each wrong claim

Invariants: every computed value comes from ``minillm.calc`` or ``minillm.hardware``, at
call time; ``truth()`` is the reference the check ``claim_verdicts`` marks against; no
``check`` text states a computed value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Claim", "CLAIMS", "truth", "shown", "verdict_lines", "lesson_lines", "report"]


@dataclass(frozen=True)
class Claim:
    id: str
    text: str
    compute: Callable[[], float]
    unit: str
    claimed: float | None = None          # the number the claim states
    rtol: float = 0.02
    holds: Callable[[float], bool] | None = None  # for a comparison instead of a number
    lesson: str = ""
    check: str = ""                       # how to recompute it (no value)

    def value(self) -> float:
        return float(self.compute())

    def is_true(self) -> bool:
        v = self.value()
        if self.holds is not None:
            return bool(self.holds(v))
        return abs(self.claimed - v) <= self.rtol * abs(v)


def _calc():
    from minillm import calc

    return calc


def _gpu(name):
    from minillm import hardware

    return hardware.get(name)


def _int4_vs_fp16_requests() -> float:
    """How many times more 4K requests fit on a 24 GB GPU with a 7B model in int4 (g128)."""
    c = _calc()
    kw = dict(num_layers=32, num_kv_heads=32, head_dim=128, context_len=4096, gpu_memory_bytes=24e9,
              gpu_memory_utilization=1.0, kv_dtype_bytes=2)
    fp16 = c.memory_budget(7e9, dtype_bytes=2, **kw).max_concurrent
    int4 = c.memory_budget(7e9, dtype_bytes=c.quantized_weight_bytes(1, 4, 128), **kw).max_concurrent
    return int4 / fp16


CLAIMS: tuple[Claim, ...] = (
    Claim("llama70b_weights", "Llama-2-70B's weights take 140 GB in fp16.",
          lambda: _calc().weight_bytes(70e9, 2) / 1e9, "GB", claimed=140,
          check="with calc.weight_bytes"),
    Claim("gpt3_kv", "GPT-3 175B's KV cache for a batch of 16 at 4K context is about 24 GB.",
          lambda: _calc().kv_cache_bytes(96, 96, 128, 4096, 2, batch=16) / 1e9, "GB", claimed=24,
          lesson="2 (K and V) × 96 layers × 96 heads × 128 × 2 bytes × 4096 tokens is 19.3 GB "
                 "per sequence, so 309 GB for 16: the 24 GB figure forgets the batch.",
          check="with your kv_cache_gb"),
    Claim("a100_cost", "One A100 at $2.50/h serving 800 tok/s costs about $0.87 per 1M tokens.",
          lambda: _calc().cost_per_million_tokens(2.50, 800), "$", claimed=0.87,
          check="with your dollars_per_million"),
    Claim("spec_speedup", "Speculative decoding with α = 0.7, k = 5 and a draft costing r = 0.07 "
                          "of a target step gives a 3.3× speedup.",
          lambda: _calc().spec_speedup(0.7, 5, 0.07), "x", claimed=3.3,
          lesson="expected tokens per pass are (1 − α^(k+1)) ÷ (1 − α) = 2.94, not k·α + 1 = 4.5; "
                 "divided by the round's cost 1 + 5 × 0.07 = 1.35, that is 2.18×.",
          check="with your tokens_per_pass, then divide by what a round costs in target steps"),
    Claim("h100_peak", "The H100 SXM's dense BF16 peak is 1979 TFLOP/s.",
          lambda: _gpu("H100-SXM").bf16_flops / 1e12, "TFLOP/s", claimed=1979,
          lesson="1979 TFLOP/s is with 2:4 structured sparsity; dense BF16 is about 989.",
          check="from minillm.hardware's H100-SXM entry"),
    Claim("llama3_kv_128k", "Llama-3-8B's KV cache at 128K context takes 16 GB.",
          lambda: _calc().kv_cache_bytes(32, 8, 128, 131072) / 1e9, "GB", claimed=16,
          lesson="it is 16 GiB (2³⁰ bytes each), which is 17.2 GB: the claim mixes the units.",
          check="with your kv_cache_gb, in the unit the claim states"),
    Claim("llama70b_kv_4k", "One Llama-2-70B sequence at 4K context holds 1.34 GB of KV cache in "
                            "fp16 (80 layers, 8 KV heads of 128).",
          lambda: _calc().kv_cache_bytes(80, 8, 128, 4096) / 1e9, "GB", claimed=1.34,
          check="with your kv_cache_gb"),
    Claim("pp_bubble", "A 4-stage pipeline running one microbatch at a time sits idle 75% of the "
                       "time.",
          lambda: _calc().pp_bubble_fraction(4, 1) * 100, "%", claimed=75,
          check="with calc.pp_bubble_fraction"),
    Claim("gqa_llama3", "Llama-3-8B's grouped-query attention (32 query heads, 8 KV heads) makes "
                        "its KV cache 4× smaller than multi-head attention would.",
          lambda: _calc().gqa_reduction(32, 8), "x", claimed=4,
          check="with calc.gqa_reduction"),
    Claim("kv_exceeds_int4", "At 4K context, one request's KV cache (fp16) is larger than a 7B "
                             "model's INT4 weights (Llama-2-7B: 32 layers, 32 KV heads, g128 "
                             "scales).",
          lambda: _calc().kv_cache_bytes(32, 32, 128, 4096) / _calc().quantized_weight_bytes(7e9, 4, 128),
          "× the INT4 weights", holds=lambda ratio: ratio > 1,
          lesson="2.15 GB of KV against 3.61 GB of weights: it takes about 7K tokens, or two "
                 "requests, for the KV to pass the weights.",
          check="with your kv_cache_gb and calc.quantized_weight_bytes"),
    Claim("int4_4x_requests", "INT4 weights let 4× more requests fit (a 7B model on a 24 GB GPU "
                              "at 4K context).",
          _int4_vs_fp16_requests, "x", claimed=4,
          lesson="int4 frees the weights' memory, but each request's KV stays fp16 and the same "
                 "size: 4 requests fit beside the fp16 weights, 9 beside the int4 ones.",
          check="with calc.memory_budget for each weight format (the KV cache's own dtype does not change)"),
    Claim("tp_allreduces", "Tensor parallelism needs one all-reduce per transformer layer.",
          lambda: _calc().tp_allreduces_per_layer(), "per layer", claimed=1, rtol=0,
          lesson="two: one after attention's row-parallel output projection, one after the "
                 "MLP's row-parallel down projection.",
          check="count the row-parallel projections of one transformer block (Lab 08)"),
    Claim("nvlink_900", "NVLink 4 moves 900 GB/s from one H100 to its neighbour.",
          lambda: _gpu("H100-SXM").interconnect_bytes_per_s / 2 / 1e9, "GB/s per direction",
          claimed=900, lesson="900 GB/s counts both directions; one GPU sends 450 GB/s to the "
                              "next, which is what a ring all-reduce step uses.",
          check="from minillm.hardware: what one GPU sends its neighbour in one direction"),
    Claim("w4a16_4x", "W4A16 quantization gives 4× less weight memory than fp16.",
          lambda: 16 / (_calc().quantized_weight_bytes(1e6, 4, 128) * 8 / 1e6), "x", claimed=4,
          lesson="each group of 128 weights also stores an fp16 scale: 4 + 16/128 = 4.125 bits "
                 "per weight, so 16 / 4.125 = 3.88×.",
          check="with calc.quantized_weight_bytes, group scales included"),
)


def truth() -> dict[str, bool]:
    """Whether each claim holds, computed now."""
    return {c.id: c.is_true() for c in CLAIMS}


def shown(claim: Claim) -> str:
    v = claim.value()
    if claim.holds is not None:
        return f"computed {v:.3g} {claim.unit}"
    return f"claimed {claim.claimed:g}, computed {v:.4g} {claim.unit}"


def verdict_lines(verdicts: dict) -> list[str]:
    """One line per claim: the computed value, your verdict, and calc's (for ``report``, once
    every verdict is right)."""
    lines = []
    for c in CLAIMS:
        yours = verdicts.get(c.id)
        right = c.is_true()
        mark = "·" if yours is None else ("✓" if yours == right else "✗")
        said = {True: "right", False: "wrong", None: "no verdict"}.get(yours, repr(yours))
        lines.append(f"{mark} {c.id:<17} {shown(c):<46} you: {said:<10} calc: {'right' if right else 'wrong'}")
    return lines


def lesson_lines() -> list[str]:
    """The slip behind each wrong claim."""
    return [f"- {c.id}: {c.lesson}" for c in CLAIMS if not c.is_true() and c.lesson]


def report(verdicts: dict) -> None:
    print("\n".join(verdict_lines(verdicts) + ["The wrong ones, and the slip behind each:"] + lesson_lines()))
