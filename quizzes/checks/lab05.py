"""Lab 05 checks: one iteration-level scheduler step, and static vs continuous step counts.

    check.schedule_step(schedule_step)   # (running, waiting, max_num_seqs, max_num_batched_tokens) -> dict
    check.batch_steps(batch_steps)       # (output_lengths, num_slots, policy) -> steps

A request is a dict ``{"id": str, "prefill_left": int, "decode_left": int}``: prompt
tokens not yet computed, and output tokens not yet produced. One step, in order:

  1. evict: running requests with decode_left == 0 leave (in order) -> "finished";
  2. decode: every running request whose prompt is done gets 1 token (decode_left − 1);
  3. prefill: running requests with prefill_left > 0 get the next chunk from what is left
     of the budget; the chunk that finishes a prompt also produces its first token;
  4. admit: while the budget lasts and fewer than max_num_seqs run, move waiting[0] to
     running and give it a first chunk the same way.

``reference_schedule_step`` is the oracle; tests/test_lab04_05.py checks it against the real
``minillm.engine.Scheduler`` on scripted workloads (same tokens per request per step). The
inputs must not be changed: the function returns new lists of new dicts.
"""
from __future__ import annotations

import copy

from .core import Case, _Difference, register

__all__ = ["schedule_step", "batch_steps", "reference_schedule_step", "reference_batch_steps"]


def reference_schedule_step(running, waiting, max_num_seqs, max_num_batched_tokens) -> dict:
    running = [dict(r) for r in running]
    waiting = [dict(r) for r in waiting]
    finished = [r["id"] for r in running if r["decode_left"] == 0]
    running = [r for r in running if r["decode_left"] > 0]
    budget, scheduled = max_num_batched_tokens, {}

    def chunk(r):
        nonlocal budget
        n = min(r["prefill_left"], budget)
        r["prefill_left"] -= n
        budget -= n
        scheduled[r["id"]] = n
        if r["prefill_left"] == 0:
            r["decode_left"] -= 1  # the last prompt position yields the first token

    for r in running:
        if budget and r["prefill_left"] == 0:
            r["decode_left"] -= 1
            budget -= 1
            scheduled[r["id"]] = 1
    for r in running:
        if budget and r["prefill_left"] > 0:
            chunk(r)
    while waiting and budget and len(running) < max_num_seqs:
        r = waiting.pop(0)
        running.append(r)
        chunk(r)
    return {"running": running, "waiting": waiting, "finished": finished, "scheduled": scheduled}


def reference_batch_steps(output_lengths, num_slots, policy) -> int:
    lengths = list(output_lengths)
    if policy == "static":
        return sum(max(lengths[i:i + num_slots]) for i in range(0, len(lengths), num_slots))
    slots, queue, steps = [], list(lengths), 0
    while slots or queue:
        while queue and len(slots) < num_slots:
            slots.append(queue.pop(0))
        slots = [n - 1 for n in slots if n > 1]
        steps += 1
    return steps


def _state(case: Case):
    def req(i, fresh):
        return {"id": f"r{i}", "prefill_left": case.size(1, 40) if fresh or case.rng.random() < 0.3 else 0,
                "decode_left": case.size(0, 6) if not fresh else case.size(1, 6)}
    n_run, n_wait = case.size(1, 5), case.size(0, 5)
    running = [req(i, False) for i in range(n_run)]
    running[0]["decode_left"] = 0  # always one finished request to evict
    if n_run > 1:
        running[1].update(prefill_left=0, decode_left=case.size(1, 5))  # and one decode
    waiting = [req(n_run + i, True) for i in range(n_wait)]
    return running, waiting


@register(cases=6, nudge=(
    "The message names the rule your step broke and the state it started from: replay the rules in "
    "their order (evict, decode, prefill, admit) on that state by hand."), concept=(
    "One step spends a token budget in priority order: requests already streaming come first (one "
    "decode token each, so no prompt can stall them), then the rest of the running prompts, then "
    "new requests while slots remain. Every request keeps one pair of counters, and the chunk that "
    "completes a prompt also yields its first output token."))
def schedule_step(case: Case, fn) -> None:
    """Your schedule_step(running, waiting, max_num_seqs, max_num_batched_tokens) against the
    reference step (evict, decode, chunked prefill, admit under the token budget)."""
    running, waiting = _state(case)
    max_seqs = case.size(len(running) - 1 if len(running) > 1 else 1, len(running) + 3)
    budget = case.choice([4, 16, 32, 64])
    want = reference_schedule_step(running, waiting, max_seqs, budget)
    before = copy.deepcopy((running, waiting))
    r_in, w_in = copy.deepcopy(running), copy.deepcopy(waiting)
    got = case.call(fn, r_in, w_in, max_seqs, budget, copy_args=False)
    case.expect((r_in, w_in) == before, "you changed the input lists or dicts: return new ones "
                "(copy each request with dict(r)), so the caller's state stays as it was.")
    case.expect(isinstance(got, dict) and set(got) >= {"running", "waiting", "finished", "scheduled"},
                "return a dict with keys 'running', 'waiting', 'finished' and 'scheduled'.")
    where = f"(max_num_seqs={max_seqs}, max_num_batched_tokens={budget})"
    ids = lambda rs: [r["id"] for r in rs]  # noqa: E731
    if list(got["finished"]) != want["finished"]:
        raise _Difference(f"finished is {list(got['finished'])}, expected {want['finished']}: evict running "
                          f"requests with decode_left == 0 first, before anything else.")
    sched = dict(got["scheduled"])
    total = sum(sched.values())
    if total > budget:
        raise _Difference(f"{total} tokens scheduled but the budget is {budget} {where}: every decode "
                          f"and every prefill chunk comes out of max_num_batched_tokens; cut the last "
                          f"chunk to what is left.")
    if len(got["running"]) > max_seqs:
        raise _Difference(f"{len(got['running'])} requests running, more than max_num_seqs={max_seqs}: "
                          f"admit only while len(running) < max_num_seqs.")
    if any(i in ids(got["running"]) for i in want["finished"]):
        raise _Difference("a finished request is still in running: evict it (it frees its slot and blocks).")
    decodes = [r["id"] for r in running if r["decode_left"] > 0 and r["prefill_left"] == 0]
    missed = [i for i in decodes if sched.get(i) != 1 and want["scheduled"].get(i) == 1]
    if missed:
        raise _Difference(f"running decodes {missed} got no token {where}: schedule decodes first "
                          f"(1 token each), then prefill chunks, then admissions; a long prompt must "
                          f"not stall the requests already generating.")
    if ids(got["running"]) != ids(want["running"]) or ids(got["waiting"]) != ids(want["waiting"]):
        raise _Difference(f"running {ids(got['running'])} and waiting {ids(got['waiting'])}, expected "
                          f"{ids(want['running'])} and {ids(want['waiting'])} {where}. Admit waiting[0] "
                          f"first (FIFO) while budget > 0 and len(running) < max_num_seqs.")
    case.compare(sched, want["scheduled"], what=f"scheduled tokens per request {where}")
    case.compare([dict(r) for r in got["running"]], want["running"], what="running after the step")


@register(cases=4, nudge=(
    "Work a tiny case by hand for the policy the message names, e.g. lengths [3, 1, 1] with 2 "
    "slots, and compare with what your function returns."), concept=(
    "Static batching holds every slot of a batch until the batch's longest member ends, then "
    "starts the next batch. Continuous batching frees a slot the step after its request's last "
    "token and refills it from the queue at once, so its count comes from following the queue "
    "step by step."))
def batch_steps(case: Case, fn) -> None:
    """Your batch_steps(output_lengths, num_slots, policy) -> decode steps to finish all
    requests, for policy "static" (batches of num_slots in order, each runs to its longest)
    and "continuous" (a finished slot is refilled from the queue at the next step)."""
    n, slots = case.size(5, 20), case.size(2, 6)
    lengths = [int(x) for x in case.randint(1, 60, (n,))]
    lengths[case.size(0, n - 1)] = case.size(150, 300)  # one long request
    for policy in ("static", "continuous"):
        want = reference_batch_steps(lengths, slots, policy)
        got = case.call(fn, lengths, slots, policy)
        if got == want:
            continue
        ideal = -(-sum(lengths) // slots)
        why = ""
        if policy == "static" and got == ideal:
            why = (" That is ceil(Σ lengths / slots), the ideal: in a static batch a finished slot "
                   "stays idle until the batch's longest member is done.")
        elif policy == "static" and got == max(lengths):
            why = " That is one batch: requests beyond num_slots wait for the next batch."
        elif policy == "continuous" and got == ideal:
            why = (" That is ceil(Σ lengths / slots): a request is not split across slots, so the "
                   "tail (the long request running alone) costs more.")
        elif policy == "continuous" and got == reference_batch_steps(lengths, slots, "static"):
            why = " That is the static count: in continuous batching a freed slot is refilled at once."
        raise _Difference(f"{policy}: {got} steps, expected {want} for lengths {lengths} on {slots} "
                          f"slots.{why}")
