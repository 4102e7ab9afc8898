"""Lab 02 checks: the KV cache, written by the student, plugged into minillm.

    check.kv_append(kv_append)              # (k_cache, v_cache, k_new, v_new, start_pos) -> None, in place
    check.cached_attention(cached_attention)  # (q, k_cache, v_cache, start_pos) -> [B, T, Hq, D]
    check.kv_cache_bytes(kv_cache_bytes)    # (num_layers, num_kv_heads, head_dim, seq_len, dtype_bytes, batch)
    check.max_kv_heads(max_kv_heads)        # (num_heads, num_layers, head_dim, seq_len, budget_bytes, dtype_bytes)

Layouts are minillm's (``minillm.kv_cache``): caches are [B, max_seq, Hkv, D], new K/V and
queries [B, T, H, D]; the T new tokens sit at positions start_pos .. start_pos+T-1. The
oracles are ``minillm.kv_cache.kv_cache_append`` / ``cached_attention`` and
``minillm.calc``; a function that passes plugs into
``minillm.generate(..., append_fn=..., attend_fn=...)``.

Invariants: every cache slot starts as random numbers (never zeros), including the slots
beyond start_pos+T, so reading or writing one position too far shows up. Cases cover a
decode step (T = 1) and a chunk of T > 1 tokens at start_pos > 0, GQA groups of 1 to 3
query heads per KV head, and float64 as well as float32 (a hard-coded dtype shows). The
student's function gets clones; a mistake is named only when it reproduces the
student's output exactly (within tolerance) and the correct answer does not. Messages
say what is wrong and where; none spells out a line of the exercise's solution.
"""

from __future__ import annotations

import math

from .core import Case, _Difference, register
from .lab01 import _judge

__all__ = ["kv_append", "cached_attention", "kv_cache_bytes", "max_kv_heads"]

_ATT_TOL = dict(atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- kv_append


def _positions_written(cache, new, before) -> list[int]:
    """Start positions s where cache[:, s:s+T] equals new (and did not before)."""
    import torch

    T, S = new.shape[1], cache.shape[1]
    hits = []
    for s in range(S - T + 1):
        if torch.equal(cache[:, s:s + T], new) and not torch.equal(before[:, s:s + T], new):
            hits.append(s)
    return hits


def _diagnose_append(name: str, yours, ref, before, new, other_new, start: int) -> str | None:
    """A message for the first thing wrong with one cache (K or V), or None if it is right."""
    import torch

    if torch.equal(yours, ref):
        return None
    T = new.shape[1]
    if torch.equal(yours, before):
        return (f"the {name} cache was not changed. Write into the tensor you were given, in place: "
                "generate() keeps using the buffers it passed you, so a new tensor (torch.cat, or a "
                "name rebound to a copy) is lost.")
    landed = _positions_written(yours, new, before)
    if landed and start not in landed:
        s = landed[0]
        return (f"your new {name} was written at positions {s}..{s + T - 1}, but it belongs at "
                f"start_pos..start_pos+T-1 = {start}..{start + T - 1} (off by {s - start:+d}). "
                "Position p of the sequence lives in slot p of the cache.")
    if _positions_written(yours, other_new, before):
        other = "V" if name == "K" else "K"
        return f"the {name} cache holds the new {other}: K and V are swapped."
    bad = (yours != ref).reshape(yours.shape[0], yours.shape[1], -1).any(-1).any(0)
    first = int(torch.nonzero(bad)[0, 0])
    where = ("a slot outside start_pos..start_pos+T-1 = "
             f"{start}..{start + T - 1}, which holds another token (or is still free) and must not change"
             if not start <= first < start + T else "one of the new slots")
    yv, rv = yours[0, first].flatten()[0].item(), ref[0, first].flatten()[0].item()
    return (f"the {name} cache differs from the reference first at position {first}, {where}: "
            f"yours {yv:.6g}, reference {rv:.6g} (at [0, {first}, 0, 0]).")


@register(
    cases=4,
    nudge="Which positions (dim 1) of the cache belong to the T new tokens, and does your code write "
          "into the caller's tensor or into a new one?",
    concept="A KV cache is a preallocated buffer indexed by position: token p of the sequence lives in "
            "slot p. Appending writes the new tokens' slots in place and leaves every other slot alone, "
            "because earlier tokens live there and later steps will fill the rest.")
def kv_append(case: Case, fn) -> None:
    """Your kv_append(k_cache, v_cache, k_new, v_new, start_pos): write the T new tokens'
    K and V ([B, T, Hkv, D]) into the caches ([B, max_seq, Hkv, D]) at positions
    start_pos .. start_pos+T-1, in place; every other slot unchanged."""
    import torch

    from minillm.kv_cache import kv_cache_append as reference

    b, hkv, d = case.size(1, 3), case.size(1, 4), case.choice([4, 8, 16])
    max_seq = case.size(6, 16)
    t = 1 if case.index % 2 == 0 else case.size(2, 4)
    start = case.size(1, max_seq - t) if case.index else 0
    dtype = torch.float64 if case.index == case.total - 1 else torch.float32
    k_cache, v_cache = case.randn(b, max_seq, hkv, d, dtype=dtype), case.randn(b, max_seq, hkv, d, dtype=dtype)
    k_new, v_new = case.randn(b, t, hkv, d, dtype=dtype), case.randn(b, t, hkv, d, dtype=dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference(ref_k, ref_v, k_new, v_new, start)
    your_k, your_v = k_cache.clone(), v_cache.clone()
    case.call(fn, your_k, your_v, k_new.clone(), v_new.clone(), start, copy_args=False)
    for name, yours, ref, new, other in (("K", your_k, ref_k, k_new, v_new), ("V", your_v, ref_v, v_new, k_new)):
        message = _diagnose_append(name, yours, ref, k_cache if name == "K" else v_cache, new, other, start)
        if message:
            raise _Difference(f"start_pos={start}, T={t}: {message}")


# --------------------------------------------------------------------------- cached_attention


def _attention(q, k_cache, v_cache, start: int, *, keys: int | None = None, scale: float | None = None,
               causal: bool = True, gqa: str = "interleave"):
    """Plain attention over the first ``keys`` cache slots, with knobs for the usual slips."""
    import torch

    B, T, Hq, D = q.shape
    S = start + T if keys is None else keys
    k, v = k_cache[:, :S].transpose(1, 2), v_cache[:, :S].transpose(1, 2)  # [B, Hkv, S, D]
    group = Hq // k.shape[1]
    if gqa == "interleave":
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    else:
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    scores = q.transpose(1, 2) @ k.transpose(-1, -2) * (1 / math.sqrt(D) if scale is None else scale)
    if causal:
        qpos = torch.arange(start, start + T)[:, None]
        scores = scores.masked_fill(torch.arange(S)[None, :] > qpos, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def _attention_slips(q, k_cache, v_cache, start: int):
    D, T, Hq, Hkv = q.shape[-1], q.shape[1], q.shape[2], k_cache.shape[2]
    S = start + T
    yield (_attention(q, k_cache, v_cache, start, scale=1 / D),
           "the scores are scaled by 1/D; the scale is 1/√D (D = head_dim).")
    yield (_attention(q, k_cache, v_cache, start, scale=1.0),
           "the scores are not scaled; multiply q·k by 1/√D (D = head_dim) before the softmax.")
    if S > 1:
        yield (_attention(q, k_cache, v_cache, start, keys=S - 1),
               f"you attend over positions 0..{S - 2}, one too few (off by one): the query at "
               "position start_pos+t must see keys 0..start_pos+t, itself included, so read "
               "cache slots [:start_pos + T].")
    if S < k_cache.shape[1]:
        yield (_attention(q, k_cache, v_cache, start, keys=S + 1, causal=False),
               f"you attend over positions 0..{S}, one too many (off by one): slot {S} holds no token yet. "
               "Read cache slots [:start_pos + T].")
        yield (_attention(q, k_cache, v_cache, start, keys=k_cache.shape[1], causal=False),
               "you attend over the whole cache buffer, including slots no token has been written to. "
               "Read only slots [:start_pos + T].")
    if T > 1:
        yield (_attention(q, k_cache, v_cache, start, causal=False),
               "the causal mask is missing: with T > 1 new tokens, the query at position start_pos+t "
               "must not see keys after start_pos+t.")
        yield (_masked_from_zero(q, k_cache, v_cache, start),
               "the causal mask is aligned to position 0 instead of start_pos: query t sits at absolute "
               "position start_pos+t, so it sees keys 0..start_pos+t.")
    if Hq != Hkv and Hkv > 1:
        yield (_attention(q, k_cache, v_cache, start, gqa="tile"),
               f"query heads are matched to the wrong KV heads: with {Hq} query heads and {Hkv} KV heads, "
               f"query head h uses KV head h // {Hq // Hkv} (repeat_interleave, not repeat).")


def _masked_from_zero(q, k_cache, v_cache, start: int):
    """Causal mask with query t seeing keys 0..t, forgetting start_pos (key 0 is always
    visible, so no row is empty)."""
    import torch

    B, T, Hq, D = q.shape
    S = start + T
    k, v = k_cache[:, :S].transpose(1, 2), v_cache[:, :S].transpose(1, 2)
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q.transpose(1, 2) @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.arange(S)[None, :] > torch.arange(T)[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def _explains(yours, variant, ref) -> bool:
    import torch

    if tuple(yours.shape) != tuple(variant.shape):
        return False
    a, b, r = yours.double(), variant.double(), ref.double()
    if torch.allclose(b, r, **_ATT_TOL):
        return False
    return bool(torch.allclose(a, b, **_ATT_TOL, equal_nan=True))


@register(
    cases=4,
    nudge="Check, in this order: how many cache slots are visible, which KV head each query head "
          "reads, the scale, which keys each new query may see, and the layout you return.",
    concept="Attention over a cache is ordinary causal attention whose keys are the cached positions "
            "0 .. start_pos+T−1: the new queries sit at the end of the sequence, so query t sees every "
            "earlier position and itself. Under GQA a group of consecutive query heads shares one KV head.")
def cached_attention(case: Case, fn) -> None:
    """Your cached_attention(q, k_cache, v_cache, start_pos): the T new queries ([B, T, Hq, D],
    positions start_pos..start_pos+T-1) attend over cache slots 0..start_pos+T-1 with a causal
    mask and scale 1/√D; each KV head serves Hq/Hkv consecutive query heads (GQA). Returns
    [B, T, Hq, D] in q's dtype."""
    import torch

    from minillm.kv_cache import cached_attention as reference

    b, hkv, group, d = case.size(1, 2), case.size(1, 3), case.choice([1, 2, 3]), case.choice([8, 16])
    if case.index == 0:  # always one GQA case where the head mapping matters
        hkv, group = max(hkv, 2), max(group, 2)
    hq = hkv * group
    max_seq = case.size(10, 24)
    t = 1 if case.index % 2 == 0 else case.size(2, 4)
    start = case.size(1, max_seq - t - 1)
    dtype = torch.float64 if case.index == case.total - 1 else torch.float32
    q = case.randn(b, t, hq, d, dtype=dtype)
    k_cache, v_cache = case.randn(b, max_seq, hkv, d, dtype=dtype), case.randn(b, max_seq, hkv, d, dtype=dtype)
    ref = reference(q, k_cache, v_cache, start)
    yours = case.call(fn, q, k_cache, v_cache, start)
    what = f"attention output (start_pos={start}, T={t}, {hq} query heads over {hkv} KV heads)"
    is_tensor = isinstance(yours, torch.Tensor)
    if is_tensor and tuple(yours.shape) == tuple(ref.shape) and yours.dtype == ref.dtype:
        if not torch.allclose(yours.double(), ref.double(), **_ATT_TOL):
            for variant, message in _attention_slips(q, k_cache, v_cache, start):
                if _explains(yours, variant.to(ref.dtype), ref):
                    try:
                        case.compare(yours, ref, what="output", **_ATT_TOL)
                    except _Difference as diff:  # the diagnosis first: graders show the first lines
                        raise _Difference(f"{what}: {message}\n  {diff}") from None
    elif is_tensor and tuple(yours.shape) == (b, hq, t, d) and (b, hq, t, d) != tuple(ref.shape):
        raise _Difference(f"{what} shape: expected {tuple(ref.shape)} = [B, T, Hq, D], got {tuple(yours.shape)} "
                          "= [B, Hq, T, D]. Transpose back before returning: out.transpose(1, 2).")
    case.compare(yours, ref, what=what, **_ATT_TOL)


# --------------------------------------------------------------------------- sizes


@register(
    cases=5,
    nudge="Look at the cache's tensors in section 1: how many are there per layer, what is each "
          "one's shape, and how many bytes is one element? Is anything shared between sequences?",
    concept="The cache is just tensors: its size is the number of elements they hold times the bytes "
            "per element. Every layer stores its own keys and its own values, for every KV head, "
            "position and sequence.")
def kv_cache_bytes(case: Case, fn) -> None:
    """Your kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, dtype_bytes, batch):
    the bytes of the KV cache of ``batch`` sequences of ``seq_len`` tokens."""
    from minillm import calc

    layers, hkv = case.size(1, 96), case.choice([1, 2, 3, 4, 8, 16, 32, 64])
    d, seq = case.choice([32, 64, 80, 96, 128, 256]), case.size(1, 131072)
    db, batch = case.choice([4, 2, 1, 0.5]), case.size(1, 64)
    if case.index == 0:  # nothing equal to 1 here, so every left-out factor shows
        db, batch, layers, hkv = case.choice([4, 2]), case.size(2, 64), max(layers, 2), max(hkv, 2)
    ref = calc.kv_cache_bytes(layers, hkv, d, seq, db, batch)
    yours = case.call(fn, layers, hkv, d, seq, db, batch)
    _judge(case, yours, ref, "KV-cache bytes", [
        (ref / 2, "Missing the factor 2: the cache holds a K and a V per KV head, per layer."),
        (ref / batch, "You left out batch: every sequence has its own cache."),
        (ref / db, "You left out dtype_bytes: bytes = elements · dtype_bytes."),
        (ref / layers, "You left out num_layers: every layer keeps its own K and V."),
        (ref / 1e9, "Off by 10⁹: return bytes, not GB."),
        (ref / 2**30, "That is GiB: return bytes."),
    ])


@register(
    cases=5,
    nudge="Two conditions: the cache must fit the budget, and the KV heads must split the query heads "
          "into equal groups. Which candidate counts pass both, and which of them is the largest?",
    concept="GQA lets g query heads share one KV head, so the number of KV heads must divide the number "
            "of query heads, and the cache grows in proportion to it. Choosing it is a trade: more KV "
            "heads keep more of MHA's quality, fewer fit longer contexts and bigger batches.")
def max_kv_heads(case: Case, fn) -> None:
    """Your max_kv_heads(num_heads, num_layers, head_dim, seq_len, budget_bytes, dtype_bytes):
    the largest number of KV heads that divides num_heads and whose cache of one seq_len-token
    sequence fits in budget_bytes; 0 when not even one KV head fits (one case)."""
    from minillm import calc

    h = case.choice([12, 16, 24, 32, 40, 64]) if case.index else 12
    layers, d = case.size(2, 80), case.choice([64, 128])
    seq, db = case.size(512, 65536), case.choice([2, 1, 4])
    per_head = calc.kv_cache_bytes(layers, 1, d, seq, db)
    if case.index == 0:    # the bytes allow 5 heads, but 5 does not divide 12: the answer is 4
        budget = 5.5 * per_head
    elif case.index == 1:  # not even MQA fits
        budget = 0.6 * per_head
    else:
        budget = per_head * case.rng.uniform(1.0, h + 0.99)
    ref = calc.max_kv_heads(h, layers, d, seq, budget, db)
    yours = case.call(fn, h, layers, d, seq, budget, db)
    by_bytes = int(budget // per_head)
    what = f"KV heads for {h} query heads within {budget:.4g} bytes ({per_head:.4g} bytes per KV head)"
    _judge(case, yours, ref, what, [
        (by_bytes, f"{by_bytes} KV heads fit by bytes, but {h} query heads cannot be split evenly over "
                   f"{by_bytes}: pick the largest count that divides {h}."),
        (h / max(ref, 1), "That is the reduction against MHA (query heads per KV head), not the number "
                          "of KV heads."),
        (1, "1 is MQA, which always fits when anything does; the question is the largest count that fits."),
        (min(h, by_bytes + 1), "One head too many: that count's cache does not fit the budget."),
    ])
