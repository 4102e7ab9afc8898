"""Lab 04 checks: a block allocator, block table -> slot mapping, chained prefix hashes.

    check.block_allocator(BlockAllocator)   # a class: allocate / append / fork / free
    check.slot_mapping(slot_mapping)        # (block_table, start, end, block_size) -> [slots]
    check.block_hashes(block_hashes)        # (token_ids, block_size) -> [chained hash per full block]

Oracle: ``minillm.paged.BlockManager`` (prefix caching off), driven by the same scripted
random operations; after every operation the student's block tables, ref counts and free
queue must equal the reference's exactly (block ids included: a fresh pool hands out 0, 1,
2, ... from the head of the free queue; freed blocks go to its tail, last block first).
``slot_mapping`` and ``block_hashes`` are compared with the formula and with
``minillm.paged.hash_block_tokens`` chained over full blocks. Known mistakes (a leaked block,
a missed ref count, no copy-on-write, a block-id off by one, a non-chained hash ...) are named.
"""
from __future__ import annotations

from .core import Case, _Difference, register

__all__ = ["block_allocator", "slot_mapping", "block_hashes"]


# --------------------------------------------------------------------------- 1. the allocator


def _ref_state(bm, seqs):
    pool = bm.pool
    return ({s: bm.get_block_table(s) for s in seqs}, [b.ref_cnt for b in pool.blocks],
            pool.free_block_ids())


def _student_state(alloc, seqs, what):
    try:
        tables = {s: list(alloc.block_tables[s]) for s in seqs}
        refs = [int(x) for x in alloc.ref_cnt]
        free = [int(x) for x in alloc.free_blocks]
    except (AttributeError, KeyError, TypeError) as exc:
        raise _Difference(f"after {what}: could not read your allocator's state ({type(exc).__name__}: "
                          f"{exc}). Keep block_tables (dict seq_id -> list of block ids), ref_cnt (a "
                          f"list, one count per block) and free_blocks (a list, head first).") from None
    extra = set(alloc.block_tables) - set(seqs)
    if extra:
        raise _Difference(f"after {what}: block_tables still holds {sorted(extra)}: free() must "
                          f"delete the sequence's entry.")
    return tables, refs, free


def _diagnose(what, mine, ref):
    (t1, r1, f1), (t2, r2, f2) = mine, ref
    for s in t2:
        if t1[s] != t2[s]:
            hint = ""
            if len(t1[s]) > len(t2[s]):
                hint = (" You hold one block too many: a new block is needed only when the last one "
                        "is full before the append.")
            elif len(t1[s]) < len(t2[s]):
                hint = (" You hold too few blocks: the token that comes after a full block (block_size "
                        "tokens) starts a new one, and a partly filled block still counts.")
            elif what.startswith("append") and t1[s][:-1] == t2[s][:-1]:
                hint = (" The last block differs: it was shared and not full, so this append had to "
                        "copy it first (copy-on-write) and report the copy.")
            else:
                hint = " New blocks come from the head of free_blocks."
            return f"after {what}: block table of {s!r} is {t1[s]}, reference {t2[s]}.{hint}"
    if r1 != r2:
        b = next(i for i, (a, c) in enumerate(zip(r1, r2)) if a != c)
        hint = (" fork() must add one reference to each of the parent's blocks." if what.startswith("fork")
                else " free() must drop one reference per block; a block is free only at 0."
                if what.startswith("free") else "")
        return f"after {what}: ref_cnt[{b}] is {r1[b]}, reference {r2[b]}.{hint}"
    if len(f1) < len(f2):
        lost = sorted(set(f2) - set(f1))
        return (f"after {what}: {len(f1)} free blocks, reference {len(f2)}: block(s) {lost} leaked: "
                f"their ref count is 0 but they never went back to free_blocks.")
    if len(f1) > len(f2):
        return (f"after {what}: {len(f1)} free blocks, reference {len(f2)}: a block still in use "
                f"(ref_cnt > 0) was put back into free_blocks.")
    if sorted(f1) == sorted(f2):
        return (f"after {what}: free_blocks is {f1}, reference {f2}: the same blocks in another order. "
                f"Freed blocks go to the tail, the sequence's last block first, and new ones come "
                f"from the head.")
    return f"after {what}: free_blocks is {f1}, reference {f2}."


@register(cases=3, nudge=(
    "The message names the operation after which your state first differs, and what differs: a "
    "block table, a ref count, or the order of free_blocks. Replay that operation by hand on the "
    "state before it."), concept=(
    "Blocks are shared by counting, not by copying: a ref count says how many block tables hold a "
    "block, and only a count of 0 returns it to the free queue. A token needs a new block only when "
    "the last one is full, and a shared last block that is not full must be made private before it "
    "is written (copy-on-write). The free queue's order is part of the contract: new blocks from the "
    "head, freed ones to the tail with a sequence's prefix last, so cached prefixes live longest."))
def block_allocator(case: Case, cls) -> None:
    """Your BlockAllocator(num_blocks, block_size) against minillm's BlockManager over ~30
    random allocate / append / fork / free operations: exact block tables, ref counts, free
    queue and copy-on-write pairs after every one."""
    from minillm.paged.block_manager import BlockManager

    bs, nb = case.choice([2, 4, 16]), case.size(24, 40)
    bm = BlockManager(nb, bs, enable_prefix_caching=False)
    alloc = case.call(cls, nb, bs)
    tokens: dict = {}
    live: list = []
    n_seq = 0
    ops = ["alloc", "alloc", "append", "append", "append", "fork", "free"]
    for _ in range(30):
        op = case.choice(ops) if live else "alloc"
        if op == "alloc":
            n = case.size(1, 3 * bs)
            if -(-n // bs) > bm.num_free_blocks() - 2:
                op = "free"
            else:
                sid = f"s{n_seq}"
                n_seq += 1
                what = f"allocate({sid!r}, {n})"
                got = case.call(alloc.allocate, sid, n, copy_args=False)
                bm.allocate(sid, list(range(1, n + 1)))
                tokens[sid] = n
                live.append(sid)
                case.expect(list(got or []) == bm.get_block_table(sid),
                            f"after {what}: returned {got}, expected the new block table "
                            f"{bm.get_block_table(sid)}.")
        if op == "append":
            sid = case.choice(live)
            if not bm.can_append(sid, 1):
                continue
            what = f"append({sid!r}) at num_tokens={tokens[sid]}"
            got = case.call(alloc.append, sid, copy_args=False)
            want = bm.append_slots(sid, list(range(1, tokens[sid] + 2)), 1)
            tokens[sid] += 1
            if list(got or []) != want:
                hint = (" The last block is shared (after a fork) and not full: copy-on-write."
                        if want else " No copy was needed here: copy only a shared (ref_cnt > 1), "
                        "partly filled last block.")
                raise _Difference(f"after {what}: returned {got}, expected copy-on-write pairs {want}.{hint}")
        elif op == "fork":
            parent = case.choice(live)
            if bm.num_free_blocks() < 3:
                continue
            child = f"s{n_seq}"
            n_seq += 1
            what = f"fork({parent!r}, {child!r})"
            case.call(alloc.fork, parent, child, copy_args=False)
            bm.fork(parent, child)
            tokens[child] = tokens[parent]
            live.append(child)
        elif op == "free":
            sid = case.choice(live)
            what = f"free({sid!r})"
            case.call(alloc.free, sid, copy_args=False)
            bm.free(sid)
            live.remove(sid)
        mine, ref = _student_state(alloc, live, what), _ref_state(bm, live)
        if mine != ref:
            raise _Difference(_diagnose(what, mine, ref))


# --------------------------------------------------------------------------- 2. slot mapping


@register(cases=3, nudge=(
    "Work one position by hand: which entry of the block table holds it, and where does that "
    "physical block's first slot sit in the pool?"), concept=(
    "The block table maps a sequence's logical blocks, in order, to physical block ids anywhere in "
    "the pool. A slot number counts from the pool's first slot, so a physical block's slots start "
    "after all the blocks with smaller ids; the offset inside the block is the same as in the "
    "sequence."))
def slot_mapping(case: Case, fn) -> None:
    """Your slot_mapping(block_table, start, end, block_size) -> the cache slot of each position
    start .. end-1, as a list of ints: through the block table, into the pool's flat slots."""
    bs = case.choice([4, 8, 16])
    n_blocks = case.size(3, 8)
    table = [int(x) for x in case.rng.permutation(64)[:n_blocks]]
    end = case.size((n_blocks - 1) * bs + 1, n_blocks * bs)
    start = case.size(1, end - 2)
    want = [table[p // bs] * bs + p % bs for p in range(start, end)]
    got = case.call(fn, table, start, end, bs)
    try:
        got_l = [int(x) for x in got]
    except TypeError:
        raise _Difference(f"return a list of {end - start} ints (one slot per position), got "
                          f"{type(got).__name__}.") from None
    if got_l == want:
        return
    mistakes = [
        ([table[p // bs] + p % bs for p in range(start, end)],
         "yours adds the block id and the offset: a block id counts blocks, a slot counts tokens, "
         "so convert the block id to the slot where that block starts."),
        ([table[min(p // bs + 1, n_blocks - 1)] * bs + p % bs for p in range(start, end)],
         "off by one block: positions 0 … block_size − 1 live in the table's first entry (0-based)."),
        (list(range(start, end)), "yours is the position itself: that is contiguous storage. Look the "
         "block up in block_table."),
        ([(p // bs) * bs + p % bs for p in range(start, end)],
         "you used the index into block_table instead of the block id stored there."),
        ([table[p // bs] * bs + p % bs for p in range(0, end - start)],
         "yours starts at position 0: map positions start .. end-1."),
    ]
    for variant, msg in mistakes:
        if got_l == variant:
            raise _Difference(f"{msg}\n  block_table={table}, block_size={bs}, positions {start}..{end - 1}: "
                              f"yours {got_l[:6]}..., reference {want[:6]}...")
    case.compare(got_l, want, what="slots")


# --------------------------------------------------------------------------- 3. prefix hashes


def _ref_hashes(tokens, bs):
    from minillm.paged.block_pool import hash_block_tokens

    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block_tokens(parent, tuple(tokens[i * bs:(i + 1) * bs]))
        out.append(parent)
    return out


@register(cases=3, nudge=(
    "Check which blocks get a hash (count them for a prompt that ends mid-block) and what each "
    "hash is computed from."), concept=(
    "A block's K and V depend on every token before it, so its cache key must name the whole "
    "prefix, not only its own tokens: each key is built from the previous block's key and this "
    "block's tokens. A partial block is still being written and is never cached."))
def block_hashes(case: Case, fn) -> None:
    """Your block_hashes(token_ids, block_size) -> one hash per FULL block, each chained to the
    one before it (hash_block_tokens, the first with no parent). Also fed two prompts that
    differ only in their first block: no later hash may be shared."""
    from minillm.paged.block_pool import hash_block_tokens

    bs = case.choice([4, 8, 16])
    n = case.size(2 * bs + 1, 5 * bs - 1)
    tokens = [int(x) for x in case.randint(3, 50000, (n,))]
    want = _ref_hashes(tokens, bs)
    got = case.call(fn, tokens, bs)
    got_l = list(got) if isinstance(got, (list, tuple)) else got
    case.expect(isinstance(got_l, list), f"return a list of ints, got {type(got).__name__}.")
    if len(got_l) == len(want) + 1:
        raise _Difference(f"{len(got_l)} hashes for {n} tokens in blocks of {bs}: only FULL blocks get "
                          f"a hash ({n} // {bs} = {len(want)}). A partial block is still being written; "
                          f"caching it would let another request read KV that is not there yet.")
    unchained = [hash_block_tokens(None, tuple(tokens[i * bs:(i + 1) * bs])) for i in range(n // bs)]
    if got_l == unchained and got_l != want:
        other = [t + 1 for t in tokens[:bs]] + tokens[bs:]
        clash = [i for i, (a, b) in enumerate(zip(fn(tokens, bs), fn(other, bs))) if a == b]
        raise _Difference(
            "your hashes are not chained: each hashes its own block's tokens only (parent None). Two "
            "prompts that differ only in their first block then get the same hash for block(s) "
            f"{clash}: a false prefix-cache hit, which hands out KV computed after a different prefix "
            "(a token's K and V depend on everything before it). Pass the previous block's hash as parent.")
    case.compare(got_l, want, what="hashes")
    other = [t + 1 for t in tokens[:bs]] + tokens[bs:]
    got2 = case.call(fn, other, bs)
    case.expect(not set(got2[1:]) & set(got_l[1:]),
                "two prompts that differ only in the first block share a later block hash: chain the hashes.")
