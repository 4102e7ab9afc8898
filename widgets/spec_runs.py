"""Runs of the real model for Lab 07: what a draft guessed and the target kept, what one
verify pass costs, how long speculative decoding takes against plain decoding, and how the
engine's decode step grows with the batch. The figures are in ``widgets.speculation``.

    trace = trace_speculation(model, NgramDraft(), prompt_ids, 32, k=4)  # every pass recorded
    trace_html(trace, tokenizer)              # the text, accepted guesses in green
    trace.position_stats()                    # acceptance at draft positions 1..k
    verify_costs(model, prompt_ids, ks)       # c(k) = a pass over k + 1 tokens ÷ over 1 token
    measure_speedup(model, NgramDraft, prompt_ids, ks, 32)  # plain against speculative
    prediction_report(run, trace, c, r)       # the measured speedup against the predictions
    engine_step_times(model, (1, 2, 4, 8))    # LLMEngine's decode step at each batch size
    run_with_verify_step(verify_step, model, draft, prompt_ids, 32, k)   # Lab 07's exercise

Timing: plain and speculative decoding are timed back to back in each of a few repeats,
each run from the end of its own prefill to its last token, so a speedup is that of the
decode phase; a speedup is the median of the repeats' ratios, so a
busy spell on a shared machine slows both sides of a ratio instead of one. A single pass (``verify_costs``) is short enough for one busy moment
to double it, so passes are warmed up, interleaved across sizes, and the median is kept;
the decode step that c divides by is a one-token pass timed the same way, so c(k) >= 1
whenever more rows cost anything.

Invariants: every speculative run is checked against plain greedy decoding, token for token
(a mismatch raises: speculation must be lossless); nothing here is random except seeded
prompt ids for the engine timing.
"""
from __future__ import annotations

import dataclasses
import html
import time

import numpy as np
import torch

from minillm import KVCache, LLMEngine, SamplingParams, calc, devices, generate
from minillm.generate import generate_stream
from minillm.spec import speculative_generate
from minillm.spec.drafts import cached_logits

__all__ = ["TracedDraft", "PassRecord", "PositionStats", "SpecTrace", "trace_speculation",
           "trace_html", "VerifyCost", "verify_costs", "SpeedupRow", "SpeedupRun",
           "measure_speedup", "prediction_report", "BatchCost", "engine_step_times",
           "run_with_verify_step"]


def _clock(model) -> float:
    """time.perf_counter(), after the model's device has finished its queued work."""
    devices.synchronize(model.device)
    return time.perf_counter()


class TracedDraft:
    """Wraps a draft: records each proposal and the seconds spent proposing."""

    def __init__(self, draft, clock=time.perf_counter):
        self.draft, self.proposals, self.seconds = draft, [], 0.0
        self.vocab_size = getattr(draft, "vocab_size", None)
        self.clock, self.started = clock, None  # started: the first proposal, after the prefill

    def reset(self, max_len, temperature, generator) -> None:
        self.proposals, self.seconds, self.started = [], 0.0, None
        self.draft.reset(max_len, temperature, generator)

    def propose(self, context_ids, k):
        if self.started is None:
            self.started = self.clock()
        t0 = time.perf_counter()
        tokens, probs = self.draft.propose(context_ids, k)
        self.seconds += time.perf_counter() - t0
        self.proposals.append([int(t) for t in tokens])
        return tokens, probs

    def rollback(self, num_tokens) -> None:
        self.draft.rollback(num_tokens)

    def observe(self, fed, best, accepted) -> None:
        """Passed on to a draft that learns from each pass (``LookaheadDraft``); timed as the
        draft's, like ``propose``."""
        if hasattr(self.draft, "observe"):
            t0 = time.perf_counter()
            self.draft.observe(fed, best, accepted)
            self.seconds += time.perf_counter() - t0


# --------------------------------------------------------------------------- traces


@dataclasses.dataclass
class PassRecord:
    guesses: list      # what the draft proposed
    accepted: int      # how many of them the target kept (a prefix)
    emitted: list      # the tokens this pass added: guesses[:accepted] + the target's own


@dataclasses.dataclass
class PositionStats:
    """Per draft position j = 1..k (index j − 1)."""
    proposed: np.ndarray     # passes whose draft offered a j-th guess
    judged: np.ndarray       # ... and had guesses 1..j−1 accepted, so guess j counted
    accepted: np.ndarray     # passes that kept guess j
    conditional: np.ndarray  # accepted / judged: α at position j, given the earlier ones kept
    reach: np.ndarray        # accepted / proposed: compare α^j (independent acceptances)


@dataclasses.dataclass
class SpecTrace:
    prompt_len: int
    k: int
    passes: list
    tokens: list
    draft_seconds: float

    @property
    def num_guesses(self) -> int:
        return sum(len(p.guesses) for p in self.passes)

    @property
    def acceptance_rate(self) -> float:
        """α: accepted guesses ÷ guesses the target judged (0 if there were none)."""
        n = self.num_guesses
        return sum(p.accepted for p in self.passes) / n if n else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return len(self.tokens) / len(self.passes)

    def expected_tokens_by_position(self) -> float:
        """``calc.spec_expected_tokens_by_position`` of the acceptance measured at each draft
        position given the earlier guesses kept (a position no pass reached counts as 0)."""
        alphas = np.nan_to_num(self.position_stats().conditional, nan=0.0)
        return calc.spec_expected_tokens_by_position([float(a) for a in alphas])

    def cost_ratio(self, step_s: float) -> float:
        """r: the draft's seconds per guess ÷ ``step_s`` (a plain decode step)."""
        return self.draft_seconds / self.num_guesses / step_s if self.num_guesses else 0.0

    def position_stats(self) -> PositionStats:
        j = np.arange(1, self.k + 1)[:, None]
        m = np.array([len(p.guesses) for p in self.passes])[None]
        a = np.array([p.accepted for p in self.passes])[None]
        proposed = (m >= j).sum(1)
        judged = ((m >= j) & (a >= j - 1)).sum(1)
        accepted = (a >= j).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return PositionStats(proposed, judged, accepted, accepted / judged, accepted / proposed)


def trace_speculation(model, draft, prompt_ids, max_new_tokens: int, k: int,
                      reference=None) -> SpecTrace:
    """Greedy ``speculative_generate`` with ``draft``, every pass recorded. The tokens are
    checked against ``reference`` (plain greedy decoding's; computed if not given)."""
    traced = TracedDraft(draft)
    out = speculative_generate(model, traced, prompt_ids, max_new_tokens, k=k)
    ref = (generate(model, prompt_ids, max_new_tokens, cuda_graph=False) if reference is None
           else list(reference))
    if out.tokens != ref:
        raise AssertionError("speculative decoding changed the text: it must give plain greedy "
                             "decoding's tokens exactly")
    passes, pos = [], 0
    for i, accepted in enumerate(out.accepted_per_pass):
        guesses = traced.proposals[i] if i < len(traced.proposals) else []  # last pass: no room
        emitted = out.tokens[pos:pos + accepted + 1]
        passes.append(PassRecord(guesses, accepted, emitted))
        pos += len(emitted)
    return SpecTrace(len(prompt_ids), k, passes, list(out.tokens), traced.seconds)


def trace_html(trace: SpecTrace, tokenizer) -> str:
    """The generated text, pass by pass: accepted guesses on green, the target's own token
    (correction or bonus) in bold, a rejected guess struck through in red before it."""
    piece = lambda t: html.escape(tokenizer.decode([t]))  # noqa: E731
    out = ['<div style="font-family:monospace;font-size:12.5px;line-height:1.9;'
           'white-space:pre-wrap">']
    for p in trace.passes:
        out += [f'<span style="background:#c8e6c9">{piece(t)}</span>' for t in p.guesses[:p.accepted]]
        if p.accepted < len(p.guesses) and len(p.emitted) > p.accepted:
            out.append(f'<span style="color:#b3261e;text-decoration:line-through;font-size:10px">'
                       f'{piece(p.guesses[p.accepted])}</span>')
        out += [f'<b style="background:#e8eaf6">{piece(t)}</b>' for t in p.emitted[p.accepted:]]
        out.append('<span style="color:#bbb">|</span>')
    legend = ('<div style="font-size:11px;color:#555">green: guess accepted · '
              '<b style="background:#e8eaf6">bold</b>: the target\'s own token (one per pass) · '
              '<span style="color:#b3261e;text-decoration:line-through">red</span>: the guess it '
              'rejected · <span style="color:#bbb">|</span>: end of a target pass</div>')
    return legend + "".join(out) + "</div>"


# --------------------------------------------------------------------------- costs and timings


@dataclasses.dataclass
class VerifyCost:
    step_s: float      # one decode step: a pass over ONE token after the context (median)
    pass_s: dict       # k -> one target pass over k + 1 tokens, timed the same way (median)
    verify_cost: dict  # k -> pass_s[k] / step_s: calc.spec_speedup's verify_cost
    repeats: int = 0   # timed passes per size, interleaved, after one warm-up pass each


def _plain_decode_s(model, ids, max_new_tokens):
    """(prefill seconds, decode seconds, tokens) of one plain greedy run: the decode is timed
    from the first token (the prefill's) to the last, in the same run as its prefill. Eager,
    as the speculative loop's passes and `verify_costs` are: on CUDA a graph-replayed plain
    decode (generate's default there) against eager verify passes would compare launch
    overheads, not the method (a speedup of ~0.1x on an H100, where eager is launch-bound)."""
    t0 = _clock(model)
    stream = generate_stream(model, ids, max_new_tokens, cuda_graph=False)
    out = [next(stream)]
    t1 = _clock(model)
    out += list(stream)
    return t1 - t0, _clock(model) - t1, out


@torch.inference_mode()
def verify_costs(model, context_ids, ks=(1, 2, 4, 8), repeats: int = 7) -> VerifyCost:
    """c(k): one target pass over k + 1 tokens after ``context_ids`` (their K/V cached; the
    logits of every row, as a verify pass needs them) ÷ one decode step, where the decode
    step is the same pass over ONE token (what ``minillm.generate`` runs per token). Both are
    timed the same way: the same function, the same cache and position, one warm-up pass
    per size, then ``repeats`` rounds that time every size in turn; each size's median is
    kept (a busy machine slows a few passes, not the middle one)."""
    ctx = list(context_ids)
    sizes = [0] + sorted(set(int(k) for k in ks) - {0})
    cache = KVCache(model.config, 1, len(ctx) + max(sizes) + 1, model.dtype, model.device)
    cached_logits(model, cache, ctx[:-1], 0, last_only=True)
    times = {k: [] for k in sizes}
    for rnd in range(repeats + 1):  # round 0 warms up every size
        for k in sizes:
            ids = ctx[-1:] + ctx[:k]  # which tokens does not change the cost
            t0 = _clock(model)
            cached_logits(model, cache, ids, len(ctx) - 1)
            if rnd:
                times[k].append(_clock(model) - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    step = med.pop(0)
    return VerifyCost(step, med, {k: s / step for k, s in med.items()}, repeats)


@dataclasses.dataclass
class SpeedupRow:
    k: int
    decode_s: float        # speculative decode seconds (prefill subtracted; median)
    speedup: float         # plain ÷ speculative decode seconds, median over paired repeats
    alpha: float
    tokens_per_pass: float
    guesses_per_pass: float
    r: float               # draft seconds per guess ÷ plain seconds per token
    c: float               # seconds per target pass ÷ plain seconds per token
    predicted: float       # calc.spec_speedup(alpha, k, r, verify_cost=c)


@dataclasses.dataclass
class SpeedupRun:
    num_tokens: int
    plain_decode_s: float
    prefill_s: float
    rows: list

    @property
    def step_s(self) -> float:
        return self.plain_decode_s / self.num_tokens

    def row(self, k: int) -> SpeedupRow:
        return next(r for r in self.rows if r.k == k)


@torch.inference_mode()
def measure_speedup(model, make_draft, prompt_ids, ks, max_new_tokens: int = 32,
                    repeats: int = 5) -> SpeedupRun:
    """Plain greedy decoding against ``speculative_generate`` with ``make_draft()`` at each k.

    Each repeat times plain decoding and every k back to back, each run from the end of its
    own prefill (plain: its first token; speculative: the draft's first proposal) to its last
    token, so no prefill timed elsewhere is subtracted. A speedup is the median over the
    repeats of plain ÷ speculative within the same repeat: runs a few seconds apart share the
    machine's load, so a busy spell slows both sides of a ratio instead of one. Times are the
    medians."""
    ids = list(prompt_ids)
    ref = generate(model, ids, max_new_tokens, cuda_graph=False)  # eager, as timed below
    prefills, plains = [], []
    spec_s = {k: [] for k in ks}
    kept = {}  # k -> (output, draft seconds) of the last repeat: the same tokens every time
    for _ in range(repeats):
        pre, seconds, _ = _plain_decode_s(model, ids, max_new_tokens)
        prefills.append(pre)
        plains.append(max(seconds, 1e-9))
        for k in ks:
            draft = TracedDraft(make_draft(), clock=lambda: _clock(model))
            out = speculative_generate(model, draft, ids, max_new_tokens, k=k)
            end = _clock(model)
            if out.tokens != ref:
                raise AssertionError(f"k={k}: speculative decoding changed the text")
            spec_s[k].append(max(end - draft.started, 1e-9))
            kept[k] = (out, draft.seconds)
    plain_decode = float(np.median(plains))
    step = plain_decode / len(ref)
    rows = []
    for k in ks:
        out, draft_s = kept[k]
        decode = float(np.median(spec_s[k]))
        speedup = float(np.median([p / d for p, d in zip(plains, spec_s[k])]))
        passes, guesses = out.num_target_passes, out.num_draft_tokens
        r = draft_s / guesses / step if guesses else 0.0
        c = (decode - draft_s) / passes / step
        rows.append(SpeedupRow(k, decode, speedup, out.acceptance_rate,
                               len(out.tokens) / passes, guesses / passes, r, c,
                               calc.spec_speedup(out.acceptance_rate, k, r, verify_cost=c)))
    return SpeedupRun(len(ref), plain_decode, float(np.median(prefills)), rows)


def prediction_report(run: SpeedupRun, trace: SpecTrace, c: float, r: float,
                      tolerance: float = 0.2) -> list[str]:
    """Sentences, from the numbers, comparing the speedup ``run`` measured at ``trace.k``
    with two predictions, E ÷ (c + k·r): E from the acceptance at each draft position
    (``trace.expected_tokens_by_position``) and E from the single α; then the two halves of
    any gap, tokens per pass and cost per pass (the timed loop's against ``c`` and ``r``)."""
    k, row = trace.k, run.row(trace.k)
    e_pos = trace.expected_tokens_by_position()
    e_single = calc.spec_expected_tokens(trace.acceptance_rate, k)
    lines = []
    for name, e in (("from α at each position", e_pos), ("from the single α", e_single)):
        pred = calc.spec_speedup_from_tokens(e, k, r, verify_cost=c)
        off = row.speedup / pred - 1
        lines.append(f"k = {k}: the measured speedup, {row.speedup:.2f}×, is {abs(off):.0%} "
                     f"{'above' if off > 0 else 'below'} the prediction {name}, {pred:.2f}×: "
                     f"{'within' if abs(off) <= tolerance else 'outside'} {tolerance:.0%}.")
    runs = ("; the acceptances came in runs, which one α cannot describe"
            if e_single < row.tokens_per_pass - 0.05 else "")
    lines.append(f"Tokens per pass: the run got {row.tokens_per_pass:.2f}; α at each position gives "
                 f"{e_pos:.2f}, the single-α formula {e_single:.2f}{runs}.")
    lines.append(f"Cost per pass: in the timed loop a pass cost {row.c:.2f} decode steps and a guess "
                 f"{row.r:.4f}; section 1 measured c = {c:.2f} and r = {r:.4f}"
                 f"{' (the loop paid more per pass: noise from other programs, or the loop itself)' if row.c > 1.1 * c else ''}.")
    return lines


@dataclasses.dataclass
class BatchCost:
    batch_sizes: np.ndarray
    step_s: np.ndarray      # the engine's decode step (all rows decoding) at each batch size

    def step_at(self, rows: float) -> float:
        """Step time for ``rows`` token rows, interpolated on log2(rows) between measurements."""
        x = np.log2(self.batch_sizes)
        if not x[0] <= np.log2(rows) <= x[-1]:
            raise ValueError(f"{rows} rows is outside the measured batch sizes "
                             f"{self.batch_sizes.tolist()}")
        return float(np.interp(np.log2(rows), x, self.step_s))

    def verify_cost(self, batch: int, k: int) -> float:
        """A verify pass for ``batch`` sequences runs batch · (k + 1) rows through every weight:
        its cost in plain decode steps of that batch."""
        return self.step_at(batch * (k + 1)) / self.step_at(batch)


@torch.inference_mode()
def engine_step_times(model, batch_sizes=(1, 2, 4, 8, 16, 32), prompt_len: int = 16,
                      steps: int = 5, seed: int = 0) -> BatchCost:
    """Time ``LLMEngine.step`` when every one of ``batch`` requests is decoding: one engine
    per batch size, prompts of ``prompt_len`` random ids prefilled first, then ``steps``
    decode steps per engine, taken in turns across the engines; the fastest is kept."""
    sizes = sorted(set(int(b) for b in batch_sizes))
    g = torch.Generator().manual_seed(seed)
    engines, warm = {}, 4  # a few steps to prefill everything and warm up
    for b in sizes:
        total = prompt_len + warm + steps + 1
        eng = LLMEngine(model, max_num_seqs=b, max_num_batched_tokens=max(512, b * prompt_len),
                        enable_prefix_caching=False, max_model_len=total,
                        num_blocks=int(1.25 * b * -(-total // 16)) + 2)  # room above the watermark
        for i in range(b):
            prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=g).tolist()
            eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=total - prompt_len,
                                                            ignore_eos=True))
        for _ in range(warm):
            eng.step()
        engines[b] = eng
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(steps):
        for b, eng in engines.items():
            before = eng.num_batched_tokens
            t0 = _clock(model)
            eng.step()
            dt = _clock(model) - t0
            if eng.num_batched_tokens - before != b:
                raise RuntimeError(f"batch {b}: the timed step was not {b} decodes (a prompt was "
                                   f"still being prefilled); raise max_num_batched_tokens")
            best[b] = min(best[b], dt)
    return BatchCost(np.array(sizes), np.array([best[b] for b in sizes]))


# --------------------------------------------------------------------------- the exercise's loop


@torch.inference_mode()
def run_with_verify_step(verify_step, model, draft, prompt_ids, max_new_tokens: int, k: int):
    """Greedy speculative decoding with the student's ``verify_step(model, cache, num_cached,
    last_token, guesses) -> (emitted, num_cached)`` doing each target pass. Returns (tokens,
    number of target passes). Stops after EOS, like ``minillm.generate``."""
    prompt = list(prompt_ids)
    eos = model.config.eos_token_id
    cache = KVCache(model.config, 1, len(prompt) + max_new_tokens + k + 1, model.dtype,
                    model.device)
    draft.reset(len(prompt) + max_new_tokens, 0.0, None)
    if len(prompt) > 1:
        cached_logits(model, cache, prompt[:-1], 0, last_only=True)
    context, out, passes, num_cached = list(prompt), [], 0, len(prompt) - 1
    while len(out) < max_new_tokens:
        room = max_new_tokens - len(out) - 1
        guesses = [int(t) for t in draft.propose(context, min(k, room))[0]] if room > 0 else []
        emitted, num_cached = verify_step(model, cache, num_cached, context[-1], guesses)
        emitted, passes = [int(t) for t in emitted], passes + 1
        if eos in emitted:  # the text ends here: nothing after it is emitted or cached
            out += emitted[:emitted.index(eos) + 1]
            break
        out += emitted
        context += emitted
        if num_cached != len(context) - 1:
            raise ValueError(f"after pass {passes} the text has {len(context)} tokens, so the cache "
                             f"must hold {len(context) - 1} (all but the newest), but verify_step "
                             f"returned num_cached={num_cached}")
        draft.rollback(len(context) - 1)
    return out, passes
