"""Lab 07 checks: the acceptance rule, the residual distribution, one greedy verify step.

    check.acceptance_probability(acceptance_probability)  # (p, q) tensors -> P(keep), elementwise
    check.residual_distribution(residual_distribution)    # (p, q) [..., V] -> the replacement's distribution
    check.verify_step(verify_step)  # (model, cache, num_cached, last_token, guesses)
                                    #   -> (emitted tokens, new num_cached)

Oracles: ``calc.spec_acceptance_probability`` elementwise; the residual that
``minillm.spec.rejection_sample`` draws from; and for ``verify_step`` a one-pass reference
(``reference_verify_step``, built on ``minillm.spec.drafts.cached_logits``, the pass
``speculative_generate`` makes) on a tiny random model (2 layers, vocab 128). Its guesses
are ``minillm.generate``'s greedy tokens with one of them changed, or none changed: then
every guess is accepted and the pass adds a bonus token.

Invariants: a slip is named only when it reproduces the student's output and the right
answer does not; no message, nudge or concept contains the formula or the code of a
solution (the lab has the student derive both rules). ``verify_step`` gets a model that
counts its forward passes (one is allowed) and a cache whose unused slots hold random
numbers, so K/V written at the wrong positions, or not at all, shows up.
"""
from __future__ import annotations

from .core import Case, _Difference, register

__all__ = ["acceptance_probability", "residual_distribution", "verify_step",
           "reference_verify_step"]


def _tensor(case: Case, yours, like, what: str):
    """The student's result as a float tensor shaped like `like`, or a clear message."""
    import torch

    if isinstance(yours, (int, float)) and like.numel() == 1:
        yours = torch.tensor(float(yours))
    if not isinstance(yours, torch.Tensor):
        raise _Difference(f"{what}: expected a tensor of shape {tuple(like.shape)} (one value per "
                          f"element of the inputs), got {type(yours).__name__}. Work elementwise "
                          f"on the tensors with torch operations, not Python's min().")
    if yours.shape != like.shape:
        raise _Difference(f"{what}: expected shape {tuple(like.shape)}, got {tuple(yours.shape)}. "
                          f"Keep the inputs' shape: one value per element.")
    return yours.double()


def _judge(yours, ref, slips, what: str, atol: float = 1e-6, otherwise: str | None = None) -> None:
    """Pass if yours is ref; else name the first slip that reproduces yours, else say
    ``otherwise`` (if given), else where the first large difference is."""
    import torch

    close = lambda a, b: bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=1e-5))  # noqa: E731
    if close(yours, ref):
        return
    for candidate, message in slips:
        if close(yours, candidate) and not close(candidate, ref):
            raise _Difference(f"{what}: {message}")
    if otherwise:
        raise _Difference(f"{what}: {otherwise}")
    i = int((yours - ref.double()).abs().flatten().argmax())
    raise _Difference(f"{what} differs from the reference: at flat index {i} yours is "
                      f"{float(yours.flatten()[i]):.6g}, the reference {float(ref.flatten()[i]):.6g}.")


# --------------------------------------------------------------------------- the acceptance rule


@register(cases=4,
          nudge="The probability of proposing AND keeping a token, q · a, may not exceed p; and "
                "a is a probability. Check both limits on a token the target likes more than the "
                "draft (p > q) and on one it likes less.",
          concept="Rejection sampling thins the draft's proposals towards the target: a proposal "
                  "is kept in proportion to how much more (or less) the target wants it than the "
                  "draft, but never with more than certainty. Thinning can only remove "
                  "probability, never add it.")
def acceptance_probability(case: Case, fn) -> None:
    """Your acceptance_probability(p, q): for each drafted token, p = the target's
    probability of it, q = the draft's; the probability of keeping it, elementwise, so that
    the kept tokens never come out more often than the target would write them."""
    import torch

    k = case.size(4, 9)
    p, q = case.rand(k) * 0.9 + 0.05, case.rand(k) * 0.9 + 0.05
    p[0], q[0] = (0.3, 0.6) if case.index == 0 else (float(q[0]) * 0.5, float(q[0]))
    p[1], q[1] = min(0.99, float(q[1]) * 1.5 + 0.05), float(q[1])  # one token the target prefers
    ref = torch.clamp(p / q, max=1.0)
    yours = _tensor(case, case.call(fn, p.clone(), q.clone()), ref, "acceptance probability")
    example = None
    if case.index == 0 and abs(float(yours[0]) - 0.5) > 1e-6:
        example = (f"for p = 0.3 and q = 0.6 (element 0) you give {float(yours[0]):.6g}, but the "
                   f"draft proposes this token twice as often as the target would write it, so "
                   f"only half of those proposals may be kept: 0.5.")
    _judge(yours, ref, [
        (p / q, "some values are above 1, and a probability cannot be: where the target likes "
                "a token more than the draft did (p > q), keeping it every time is the most "
                "you can do."),
        (torch.clamp(q / p, max=1.0), "the ratio is upside down: a token the draft proposes too "
                                      "often (q > p) must sometimes be turned down, and one the "
                                      "target likes more (p > q) always kept; yours does the "
                                      "opposite."),
        (torch.minimum(p, q), "that is the probability that the draft proposes the token AND it "
                              "is kept. The check asks for the probability of keeping it once it "
                              "has been proposed."),
        (p, "accepting with probability p ignores the draft: a token the draft proposes too "
            "often (q > p) would come out too often."),
        (torch.clamp(p / q, min=1.0), "small values were raised to 1: a token the draft proposes "
                                      "too often must sometimes be turned down. The limit is at "
                                      "the top, not the bottom."),
    ], "acceptance probability", otherwise=example)


@register(cases=4,
          nudge="After the acceptance step, token t has come out with probability min(p(t), q(t)). "
                "The replacement must supply exactly what is still missing of p, and be a "
                "distribution: non-negative, summing to 1 over the last dimension.",
          concept="A rejection happens exactly as often as the draft over-proposed, and because "
                  "p and q both sum to 1 that equals the total shortfall of the accepted tokens. "
                  "So the replacement is the shortfall itself, rescaled into a distribution.")
def residual_distribution(case: Case, fn) -> None:
    """Your residual_distribution(p, q) for distributions over the last dimension: what a
    rejected token's replacement is drawn from, so that accepted and replaced tokens together
    follow p exactly."""
    v = case.size(5, 40)
    shape = (v,) if case.index % 2 == 0 else (case.size(2, 4), v)
    p = (case.randn(*shape) * 2).softmax(-1)
    q = (case.randn(*shape) * 2).softmax(-1)
    pos = (p - q).clamp(min=0)
    ref = pos / pos.sum(-1, keepdim=True)
    yours = _tensor(case, case.call(fn, p.clone(), q.clone()), ref, "residual")
    neg = (q - p).clamp(min=0)
    raw = p - q
    _judge(yours, ref, [
        (pos, "not normalized: yours sums to less than 1 over the last dimension. The "
              "replacement is drawn from it, so it must be a distribution."),
        (neg / neg.sum(-1, keepdim=True), "that is where the tokens the DRAFT over-proposed are: "
                                          "the mass that had to be rejected. The replacement "
                                          "must go where the target wants more than the "
                                          "accepted tokens gave it."),
        (raw / raw.sum(-1, keepdim=True), "negative entries: a probability cannot be negative. "
                                          "Tokens that acceptance already delivered in full get "
                                          "none of the replacement."),
        (pos / pos.sum(), "normalized over all elements at once: normalize each row on its own; "
                          "every row is a separate distribution."),
        (p, "resampling from p counts twice the tokens that the acceptance step already let "
            "through; only the mass the accepted tokens fell short of is left to give out."),
    ], "residual")
    if bool((yours < -1e-7).any()):
        raise _Difference("the residual has negative entries: a probability cannot be negative.")


# --------------------------------------------------------------------------- one verify step

_TINY = []


def _tiny_model():
    if not _TINY:
        from minillm import LlamaModel, ModelConfig

        _TINY.append(LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval())
    return _TINY[0]


class CountingModel:
    """The model, counting its forward passes (hidden_states, forward or a call)."""

    def __init__(self, model):
        self._model, self.passes = model, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def hidden_states(self, *args, **kwargs):
        self.passes += 1
        return self._model.hidden_states(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.passes += 1
        return self._model(*args, **kwargs)

    forward = __call__


def reference_verify_step(model, cache, num_cached, last_token, guesses):
    """One greedy verify pass: score last_token + guesses, keep guesses while they equal the
    target's argmax, add the target's own token; the cache keeps num_cached + 1 + accepted."""
    from minillm.spec.drafts import cached_logits

    logits = cached_logits(model, cache, [last_token] + list(guesses), num_cached)
    best = logits.argmax(-1).tolist()
    n = 0
    while n < len(guesses) and guesses[n] == best[n]:
        n += 1
    return list(guesses[:n]) + [best[n]], num_cached + n + 1


def _token_list(yours) -> list[int]:
    try:
        return [int(t) for t in yours]
    except (TypeError, ValueError):
        raise _Difference(f"emitted must be a list of token ids (ints), got {yours!r}.") from None


@register(cases=4,
          nudge="One pass over [last_token] + guesses gives one row of logits per token fed; "
                "row i is the target's prediction after the tokens before it. Keep guesses while "
                "they agree with it, add the target's own token, and count the cache positions "
                "that now hold the text.",
          concept="Greedy verification keeps the longest prefix of the guesses that the target "
                  "would have written itself, and the same pass gives the target's next token "
                  "after that prefix for free. The cache must end up holding the K/V of every "
                  "token of the text but the newest, which has not been through the model yet.")
def verify_step(case: Case, fn) -> None:
    """Your verify_step(model, cache, num_cached, last_token, guesses) -> (emitted,
    num_cached): one target pass over [last_token] + guesses at position num_cached, greedy
    acceptance, the target's own token added, and the cache rolled back to the accepted
    length. Run on a tiny random model against minillm.generate's greedy tokens."""
    import torch

    from minillm import KVCache, generate
    from minillm.spec.drafts import cached_logits

    model = _tiny_model()
    cfg = model.config
    n_prompt, k = case.size(2, 12), case.size(2, 5)
    prompt = [int(t) for t in case.randint(3, cfg.vocab_size, (n_prompt,))]
    greedy = generate(model, prompt, k + 1, ignore_eos=True)
    n_ok = {0: k, 1: 0}.get(case.index, case.size(1, k - 1))  # all accepted, none, some
    guesses = greedy[:k]
    if n_ok < k:
        guesses[n_ok] = (greedy[n_ok] + case.size(1, cfg.vocab_size - 1)) % cfg.vocab_size
        guesses[n_ok + 1:] = [int(t) for t in case.randint(3, cfg.vocab_size, (k - n_ok - 1,))]
    cache = KVCache(cfg, 1, n_prompt + k + 3, model.dtype, model.device)
    for layer in range(cfg.num_layers):  # stale slots hold noise, never zeros
        cache.k[layer].copy_(case.randn(*cache.k[layer].shape))
        cache.v[layer].copy_(case.randn(*cache.v[layer].shape))
    with torch.inference_mode():
        cached_logits(model, cache, prompt[:-1], 0, last_only=True)
        ref_cache = KVCache(cfg, 1, cache.max_seq_len, model.dtype, model.device)
        for layer in range(cfg.num_layers):
            ref_cache.k[layer].copy_(cache.k[layer])
            ref_cache.v[layer].copy_(cache.v[layer])
        want, want_n = reference_verify_step(model, ref_cache, n_prompt - 1, prompt[-1], guesses)
    start = n_prompt - 1
    counting = CountingModel(model)
    with torch.inference_mode():
        got = case.call(fn, counting, cache, start, prompt[-1], list(guesses), copy_args=False)
    case.expect(isinstance(got, tuple) and len(got) == 2,
                f"return a pair (emitted, num_cached), got {type(got).__name__}: the tokens this "
                f"pass adds to the text, and how many cache positions now hold valid K/V.")
    emitted, got_n = _token_list(got[0]), got[1]
    where = f"(num_cached={start}, {k} guesses {guesses}, the target's greedy tokens {greedy})"
    if counting.passes == 0:
        raise _Difference("the target model was never run: score [last_token] + guesses with "
                          "cached_logits(model, cache, ..., num_cached).")
    if counting.passes > 1:
        raise _Difference(f"you ran the target {counting.passes} times. The whole point is ONE "
                          f"pass: cached_logits over [last_token] + guesses returns {k + 1} rows "
                          f"of logits, row i being the target's prediction after guess i.")
    _check_cache(cache, ref_cache, start + 1, start)  # last_token's K/V at position num_cached
    if emitted != want:
        if n_ok < k and emitted[:k] == list(guesses):
            msg = ("you kept every guess. Keep guesses only while guesses[i] equals the argmax of "
                   "logits row i; stop at the first that differs.")
        elif emitted == want[:-1]:
            msg = ("the target's own token is missing. Every pass adds one more token after the "
                   "n accepted guesses: the argmax of row n (the correction, or the bonus token "
                   "when all k were accepted).")
        elif emitted[:-1] == want[:-1] and n_ok < k and emitted[-1] == guesses[n_ok]:
            msg = ("the last token is the draft's rejected guess; emit the target's argmax at "
                   "that row instead.")
        else:
            msg = ("compare guesses[i] with the argmax of logits row i (row 0 is the prediction "
                   "after last_token, so it judges guesses[0]).")
        raise _Difference(f"emitted {emitted}, expected {want} {where}: {msg}")
    if got_n != want_n:
        n = want_n - start - 1
        if got_n == start + k + 1:
            msg = (f"the cache was not rolled back. The pass wrote K/V for all {k} guesses, but "
                   f"only the {n} accepted ones are part of the text: num_cached becomes "
                   f"num_cached + 1 + {n} (last_token and the accepted guesses); the next pass "
                   f"overwrites the rest.")
        elif got_n == want_n - 1:
            msg = "one short: last_token's K/V was written by this pass too, so count it."
        elif got_n == want_n + 1:
            msg = ("one too many: the target's own new token has not been through the model yet; "
                   "its K/V is written by the next pass, where it is last_token.")
        else:
            msg = f"it must be num_cached + 1 + accepted = {start} + 1 + {n}."
        raise _Difference(f"num_cached returned {got_n}, expected {want_n} {where}: {msg}")
    _check_cache(cache, ref_cache, want_n, start)


def _check_cache(cache, ref_cache, upto: int, start: int) -> None:
    """Positions 0..upto-1 of every layer's K and V must be the reference's."""
    import torch

    for layer in range(len(cache.k)):
        for name, mine, ref in (("K", cache.k, ref_cache.k), ("V", cache.v, ref_cache.v)):
            if not torch.allclose(mine[layer][:, :upto], ref[layer][:, :upto], atol=1e-5):
                raise _Difference(
                    f"after your step the cache's {name} (layer {layer}) at positions "
                    f"0..{upto - 1} is not the K/V of the text: run the pass at start = "
                    f"num_cached ({start}) over [last_token] + guesses, so each token's K/V "
                    f"lands at its own position.")
