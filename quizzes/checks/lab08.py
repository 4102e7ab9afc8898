"""Lab 08 checks: column- and row-parallel matmuls by hand, sharding a fused qkv weight with
GQA, and where a layer's two all-reduces go.

    check.column_parallel(column_parallel)   # (x [T, in], w [in, out], tp) -> (per_rank, y)
    check.row_parallel(row_parallel)         # (x [T, in], w [in, out], tp) -> (per_rank, y)
    check.shard_qkv(shard_qkv)    # (w_qkv, num_heads, num_kv_heads, head_dim, tp, rank) -> rows
    check.allreduces_per_layer(allreduces_per_layer)
        # (num_tokens, hidden_size, intermediate_size, tp_size, dtype_bytes) -> {op: bytes}

The matmuls use the textbook layout y = x @ w with w [in, out]; "columns" are output
features, "rows" input features; shards are contiguous blocks (``chunk``). ``shard_qkv`` works
on the engine's layout: ``qkv_proj.weight`` is [(H + 2·KV)·head_dim, hidden], the Q rows of
the H query heads, then K and V of the KV heads; a rank keeps [its Q rows; its K rows; its V
rows]. The oracles are written out below (``reference_*``).

Invariants: inputs are float64 random numbers (never zeros), so a slip can be told from the
right answer exactly; a slip is named only when it reproduces the student's output and the
right answer does not.
"""
from __future__ import annotations

from .core import Case, _Difference, register

__all__ = ["column_parallel", "row_parallel", "shard_qkv", "allreduces_per_layer",
           "reference_shard_qkv", "reference_allreduces", "LAYER_OPS"]

#: One decoder layer, in order. The all-reduces go after two of these.
LAYER_OPS = ("input_norm", "qkv_proj", "attention", "o_proj", "attn_residual",
             "post_attention_norm", "gate_up_proj", "silu_mul", "down_proj", "mlp_residual")


def _same(a, b) -> bool:
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and bool(torch.allclose(a.double(), b.double(), atol=1e-9, rtol=1e-9)))


def _name_slip(yours, ref, slips, what: str) -> None:
    """Pass if yours is ref; else name the first slip that reproduces yours; else say how
    yours differs (shape, or where)."""
    if _same(yours, ref):
        return
    for candidate, message in slips:
        if _same(yours, candidate) and not _same(candidate, ref):
            raise _Difference(f"{what}: {message}")
    if tuple(yours.shape) != tuple(ref.shape):
        raise _Difference(f"{what} has shape {tuple(yours.shape)}; expected {tuple(ref.shape)}.")
    i = int((yours.double() - ref.double()).abs().flatten().argmax())
    raise _Difference(f"{what} differs from the reference: at flat index {i} yours is "
                      f"{float(yours.flatten()[i]):.6g}, the reference {float(ref.flatten()[i]):.6g}.")


def _pair(case: Case, got, tp: int, what: str):
    """The student's (per_rank, y), checked for structure."""
    import torch

    case.expect(isinstance(got, tuple) and len(got) == 2,
                f"return a pair (per_rank, y): the list of what each of the {tp} ranks computes "
                f"locally, and the full output y; got {type(got).__name__}.")
    per_rank, y = got
    case.expect(isinstance(per_rank, (list, tuple)) and len(per_rank) == tp
                and all(isinstance(p, torch.Tensor) for p in per_rank),
                f"per_rank must be a list of {tp} tensors, one per rank ({what}).")
    case.expect(isinstance(y, torch.Tensor), f"y must be a tensor, got {type(y).__name__}.")
    return list(per_rank), y


def _matmul_case(case: Case):
    tp = case.choice([2, 3, 4])
    x = case.randn(case.size(1, 4), tp * case.size(1, 3)).double()
    w = case.randn(x.shape[1], tp * case.size(1, 3)).double()
    return x, w, tp


# --------------------------------------------------------------------------- column / row


@register(cases=3,
          nudge="Compare the shape of per_rank[r] with y's: which dimension did the ranks split, "
                "and does each rank's result cover different output features or all of them?",
          concept="Column-parallel: each rank owns some of the output features outright, so its "
                  "result is final for those features and needs no arithmetic with the others; "
                  "the full output is the owned pieces placed side by side.")
def column_parallel(case: Case, fn) -> None:
    """Your column_parallel(x, w, tp_size) -> (per_rank, y): rank r holds the r-th block of
    w's columns and the whole x, computes its block of y; y gathers the blocks side by side."""
    import torch

    x, w, tp = _matmul_case(case)
    cols = w.chunk(tp, dim=1)
    ref = [x @ c for c in cols]
    per_rank, y = _pair(case, case.call(fn, x.clone(), w.clone(), tp), tp, "x @ its columns of w")
    for r in range(tp):
        rows = w.chunk(tp, dim=0)[r]
        _name_slip(per_rank[r], ref[r], [
            (x @ w[:, r::tp], "you took every tp-th column. A rank holds one contiguous block "
                              "of columns, so that whole heads (and whole FFN columns) stay "
                              "together."),
            (x.chunk(tp, dim=1)[r] @ rows, "that is the ROW-parallel split (w's rows, x's features). "
                                           "Column-parallel gives every rank the whole x and "
                                           "splits w's output features."),
            (x @ w, "each rank computed the whole x @ w: nothing is split. Rank r holds only "
                    "its own block of w's columns."),
        ], f"per_rank[{r}] (rank {r} of {tp})")
    full = x @ w
    _name_slip(y, full, [
        (sum(ref), "you summed the column shards. Each rank's output holds DIFFERENT output "
                   "columns, not a partial sum of the same ones: they are gathered side by side "
                   "(an all-gather), not added."),
        (torch.cat(ref, dim=0), "you concatenated along dim 0, the tokens. The shards are blocks "
                                "of output columns."),
        (ref[0], "y is rank 0's block only: the other ranks' blocks are the rest of y's columns."),
    ], "y")


@register(cases=3,
          nudge="Compare the shape of per_rank[r] with y's: does each rank produce some of y's "
                "columns, or all of them from only some of the inputs? Then: what must the "
                "all-reduce do with those results?",
          concept="Row-parallel: each rank owns some of the INPUT features, so its result spans "
                  "every output feature but holds only those inputs' contribution. A matrix "
                  "product is a sum over input features, so the contributions combine by adding.")
def row_parallel(case: Case, fn) -> None:
    """Your row_parallel(x, w, tp_size) -> (per_rank, y): rank r holds the r-th block of w's
    rows and the matching block of x's features, and computes a partial sum of the FULL y;
    the all-reduce adds the partial sums."""
    import torch

    x, w, tp = _matmul_case(case)
    xs, ws = x.chunk(tp, dim=1), w.chunk(tp, dim=0)
    ref = [a @ b for a, b in zip(xs, ws)]
    per_rank, y = _pair(case, case.call(fn, x.clone(), w.clone(), tp), tp, "a partial sum of y")
    for r in range(tp):
        _name_slip(per_rank[r], ref[r], [
            (x @ w.chunk(tp, dim=1)[r], "that is the COLUMN-parallel split. Row-parallel splits "
                                        "w's rows (input features), and x's features the same way."),
            (x[:, r::tp] @ w[r::tp], "you took every tp-th row. Use contiguous blocks, of w's "
                                     "rows and of x's features alike."),
            (x @ w, "each rank computed the whole x @ w: nothing is split. Rank r multiplies "
                    "its slice of x's features by its block of w's rows."),
        ], f"per_rank[{r}] (rank {r} of {tp})")
    full = x @ w
    _name_slip(y, full, [
        (torch.cat(ref, dim=-1), "you concatenated the row shards. Each rank's result is already "
                                 "the full width of y, a partial sum over its slice of the inputs: "
                                 "the all-reduce combines them elementwise."),
        (torch.cat(ref, dim=0), "you stacked the partial sums along the tokens: the all-reduce "
                                "adds them elementwise."),
        (sum(ref) / tp, "you averaged: an all-reduce for a row-parallel layer sums (op=SUM); "
                        "each partial sum is a share of y, not an estimate of it."),
        (ref[0], "y is rank 0's partial sum only: without the all-reduce a rank misses the other "
                 "ranks' input features."),
    ], "y")


# --------------------------------------------------------------------------- qkv with GQA


def _tp_error(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` cannot shard this attention (the head rule), or None."""
    from minillm import calc

    return calc.tp_size_problem(num_heads, num_kv_heads, tp)


def _kv_heads_of(num_heads, num_kv_heads, tp, rank) -> list[int]:
    if tp >= num_kv_heads:
        return [rank // (tp // num_kv_heads)]  # one head per rank, replicated tp / KV times
    per = num_kv_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def _rows(part, heads, head_dim):
    import torch

    return torch.cat([part[h * head_dim:(h + 1) * head_dim] for h in heads])


def reference_shard_qkv(w_qkv, num_heads, num_kv_heads, head_dim, tp_size, rank):
    """Rank ``rank``'s rows of the fused qkv weight: its H/tp query heads, then the KV heads
    they read (K rows, then V rows). Raises ValueError when tp_size cannot shard the heads."""
    import torch

    why = _tp_error(num_heads, num_kv_heads, tp_size)
    if why:
        raise ValueError(why)
    q, k, v = w_qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    qh = num_heads // tp_size
    kv = _kv_heads_of(num_heads, num_kv_heads, tp_size, rank)
    return torch.cat([q[rank * qh * head_dim:(rank + 1) * qh * head_dim],
                      _rows(k, kv, head_dim), _rows(v, kv, head_dim)])


_HEADS = [(8, 4), (9, 3), (8, 2), (12, 4), (6, 6), (4, 1), (16, 8)]


def _qkv_case(case: Case):
    """(H, KV, tp): case 0 replicates two or more KV heads (tp > KV), case 1 splits them
    (tp < KV), the others are any valid size."""
    configs = [(h, kv, tp) for h, kv in _HEADS for tp in range(2, h + 1) if not _tp_error(h, kv, tp)]
    if case.index == 0:
        configs = [c for c in configs if c[2] > c[1] > 1]
    elif case.index == 1:
        configs = [c for c in configs if c[2] < c[1]]
    return case.choice(configs)


@register(cases=4,
          nudge="Check which rows each rank got: whole heads only (head_dim rows each), its "
                "query heads first, then the K and then the V rows of the KV heads those query "
                "heads read; and a ValueError for a tp_size the head rule forbids.",
          concept="Attention splits by heads because a head's scores need all of its features. "
                  "Under GQA a group of query heads shares one KV head, so a rank must hold the "
                  "KV heads of its own query heads; when there are more ranks than KV heads, "
                  "neighbouring ranks each keep a copy of the same KV head.")
def shard_qkv(case: Case, fn) -> None:
    """Your shard_qkv(w_qkv, num_heads, num_kv_heads, head_dim, tp_size, rank): the rows of
    the fused qkv weight that rank keeps (whole query heads, then the KV heads they read), or
    ValueError when tp_size cannot shard these heads."""
    import torch

    H, KV, tp = _qkv_case(case)
    hd, d = case.choice([2, 4]), case.size(3, 6)
    w = case.randn((H + 2 * KV) * hd, d).double()
    group = H // KV
    for rank in range(tp):
        ref = reference_shard_qkv(w, H, KV, hd, tp, rank)
        got = case.call(fn, w.clone(), H, KV, hd, tp, rank)
        case.expect(isinstance(got, torch.Tensor),
                    f"return one tensor (the rank's Q rows, then K rows, then V rows); "
                    f"got {type(got).__name__}.")
        q, k, v = w.split([H * hd, KV * hd, KV * hd])
        qh = H // tp
        q_rows = q[rank * qh * hd:(rank + 1) * qh * hd]
        first, last = rank * qh, (rank + 1) * qh - 1
        needs = sorted({h // group for h in range(first, last + 1)})
        slips = [(w.chunk(tp, dim=0)[rank] if w.shape[0] % tp == 0 else ref,
                  "you cut the fused matrix into tp equal row blocks, as if it were one projection. "
                  "It is three stacked ones (Q, then K, then V), each to be sharded by heads."),
                 (q_rows, "only the Q rows: the rank also needs the K and V rows of the KV heads "
                          "its query heads read, stacked after them.")]
        if tp > KV:
            wrong = [rank % KV]
            slips.append((torch.cat([q_rows, _rows(k, wrong, hd), _rows(v, wrong, hd)]),
                          f"rank {rank} holds query heads {first}..{last}, which read KV head "
                          f"{needs[0]} (query head h reads KV head h // (H/KV) = h // {group}); "
                          f"you gave it KV head {wrong[0]}. With tp > KV each KV head is "
                          f"replicated tp/KV = {tp // KV} times, to consecutive ranks."))
            if (KV * hd) % tp == 0:
                slips.append((torch.cat([q_rows, k.chunk(tp)[rank], v.chunk(tp)[rank]]),
                              f"you split the K and V rows {tp} ways, but there are only {KV} KV "
                              f"heads: that cuts through a head. When tp > KV, each rank keeps one "
                              f"whole KV head (head_dim rows), replicated tp/KV = {tp // KV} times."))
        _name_slip(got, ref, slips, f"shard of rank {rank} (H={H}, KV={KV}, tp={tp})")
    _expect_refusal(case, fn, H, KV, hd, d)


def _expect_refusal(case: Case, fn, H: int, KV: int, hd: int, d: int) -> None:
    """A tp_size that cannot shard the heads must raise ValueError."""
    bad = next(t for t in range(2, 4 * H) if _tp_error(H, KV, t))
    w = case.randn((H + 2 * KV) * hd, d).double()
    try:
        fn(w, H, KV, hd, bad, 0)
    except ValueError:
        return
    except NotImplementedError:
        raise  # the framework reports the stub
    except Exception as exc:
        raise _Difference(f"H={H}, KV={KV}: {_tp_error(H, KV, bad)}, so raise ValueError, not "
                          f"{type(exc).__name__}: {exc}") from None
    raise _Difference(f"H={H} query heads, KV={KV} KV heads: {_tp_error(H, KV, bad)}, yet your "
                      f"function returned a shard for it. Check the head rule first and raise "
                      f"ValueError naming the head counts.")


# --------------------------------------------------------------------------- the all-reduces


def reference_allreduces(num_tokens, hidden_size, intermediate_size, tp_size, dtype_bytes) -> dict:
    """After o_proj and after down_proj (both row-parallel), one all-reduce each of the full
    hidden state: tokens · hidden · dtype_bytes, whatever tp_size and the FFN width."""
    message = num_tokens * hidden_size * dtype_bytes
    return {"o_proj": message, "down_proj": message}


_NOT_HERE = {
    "input_norm": "RMSNorm needs the whole hidden vector, and every rank already has it (the "
                  "previous layer's last all-reduce gave it to all ranks).",
    "qkv_proj": "qkv_proj is column-parallel: each rank ends with whole heads of its own and runs "
                "attention on them locally. Nothing needs combining yet.",
    "attention": "attention runs head by head, and each rank holds whole query heads and the KV "
                 "heads they read: nothing to combine.",
    "attn_residual": "the residual add works on the all-reduced o_proj output, the same on every "
                     "rank: no communication there.",
    "post_attention_norm": "RMSNorm needs the whole hidden vector, which every rank holds after "
                           "the all-reduce before it.",
    "gate_up_proj": "gate_up_proj is column-parallel: each rank holds its own FFN columns of gate "
                    "and up, and SiLU(gate)·up is elementwise, so it runs on the shard.",
    "silu_mul": "SiLU(gate)·up is elementwise: it runs on each rank's FFN columns as they are.",
    "mlp_residual": "the residual add works on the all-reduced down_proj output: no communication.",
}
_MISSING = {
    "o_proj": "o_proj is row-parallel: each rank multiplies its heads' slice of the attention "
              "output by its rows of W_o and gets a PARTIAL SUM of the full hidden state. The "
              "partial sums must be added (all-reduce) before the residual add.",
    "down_proj": "down_proj is row-parallel: each rank's FFN columns give a PARTIAL SUM of the "
                 "full hidden state; they must be added (all-reduce) before the residual add.",
}


@register(cases=4,
          nudge="Check which ops leave the ranks with partial sums rather than whole results, "
                "and what shape the tensor handed to each all-reduce has.",
          concept="An all-reduce is needed exactly where a row-parallel layer leaves every rank "
                  "holding a share of the same tensor. Its message is that whole tensor, however "
                  "many ranks share the work.")
def allreduces_per_layer(case: Case, fn) -> None:
    """Your allreduces_per_layer(num_tokens, hidden_size, intermediate_size, tp_size,
    dtype_bytes) -> {op: bytes}: the ops of LAYER_OPS after which a Megatron layer all-reduces,
    each with the bytes of that all-reduce's message."""
    T, d = case.size(1, 300), case.choice([64, 576, 4096, 8192])
    f = case.choice([2, 3, 4]) * d + 96  # never tp · d, so each slip has its own number
    tp, b = case.choice([3, 4, 8]), case.choice([2, 4])
    got = case.call(fn, T, d, f, tp, b)
    case.expect(isinstance(got, dict),
                f"return a dict {{op: bytes}}, e.g. {{'some_op': 1234}}; got {type(got).__name__}.")
    unknown = [k for k in got if k not in LAYER_OPS]
    case.expect(not unknown, f"{unknown} are not ops of the layer; use names from LAYER_OPS: {LAYER_OPS}.")
    for op in LAYER_OPS:
        if op in got and op not in _MISSING:
            raise _Difference(f"no all-reduce after {op}: {_NOT_HERE[op]}")
    for op in _MISSING:
        if op not in got:
            raise _Difference(f"an all-reduce is missing after {op}: {_MISSING[op]}")
    ref = reference_allreduces(T, d, f, tp, b)
    where = f"(num_tokens={T}, hidden_size={d}, intermediate_size={f}, tp_size={tp}, dtype_bytes={b})"
    for op, want in ref.items():
        yours = got[op]
        if isinstance(yours, bool) or not isinstance(yours, (int, float)):
            raise _Difference(f"{op}: bytes must be a number, got {type(yours).__name__}.")
        if abs(yours - want) <= 1e-9 * want:
            continue
        slips = [(T * f * b, f"that uses intermediate_size. down_proj's INPUT is FFN-wide, but "
                             f"what is summed is its output, hidden_size wide."),
                 (want / tp, "divided by tp_size. Every rank all-reduces the whole [tokens, hidden] "
                             "tensor: tp splits the weights, not the message."),
                 (want * tp, "multiplied by tp_size. The message is one [tokens, hidden] tensor, "
                             "whatever the number of ranks."),
                 (2 * (tp - 1) / tp * want, "that is the ring's traffic per GPU, 2(N−1)/N × the "
                                            "message (calc.ring_allreduce_bytes). Give the message "
                                            "itself, what the ledger records."),
                 (T * d, "that counts elements; multiply by dtype_bytes for bytes."),
                 (2 * want, "that counts both all-reduces of the layer; give each its own message.")]
        msg = next((m for v, m in slips if abs(yours - v) <= 1e-9 * v and abs(v - want) > 1e-9 * want),
                   "each all-reduce carries the layer's whole output for every token, in bytes.")
        raise _Difference(f"{op}: {yours} bytes, expected {want} {where}: {msg}")
