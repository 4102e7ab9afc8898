"""Measured quality of a (quantized) model: perplexity, KL to a reference, top-1 agreement.

- `ppl`: exp of the mean next-token negative log-likelihood over the evaluation text, cut
  into non-overlapping windows of `window` tokens (each window starts with no context, so
  its first tokens are harder; the same for every model compared).
- `kl`: the mean over predicted positions of KL(p_ref ‖ p_model), from the reference's
  next-token distribution to the model's. Perplexity averages over the one true token; KL
  compares whole distributions, so it sees damage perplexity hides (and is 0 only for an
  identical model).
- `top1`: the fraction of positions where the model's argmax equals the reference's, i.e.
  where greedy decoding would pick the same token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data import evaluation_text


def evaluation_windows(tokenizer, text: str | None = None, window: int = 512,
                       max_windows: int | None = None) -> torch.Tensor:
    """[num_windows, window] token ids: the text's tokens cut into whole windows."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    ids = torch.tensor(tokenizer.encode(evaluation_text() if text is None else text))
    n = len(ids) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return ids[:n * window].reshape(n, window)


@torch.no_grad()
def evaluate(model, tokenizer, ref_model=None, text: str | None = None, window: int = 512,
             max_windows: int | None = None, batch_size: int = 4) -> dict:
    """{'ppl', 'kl', 'top1', 'tokens'} of `model` on the evaluation text (or `text`).

    Without `ref_model`, `kl` and `top1` are None. `max_windows` evaluates a prefix only
    (labs use it to stay fast); the benchmark uses the whole held-out text."""
    return evaluate_many({"model": model}, tokenizer, ref_model, text, window, max_windows,
                         batch_size)["model"]


@torch.no_grad()
def evaluate_many(models: dict, tokenizer, ref_model=None, text: str | None = None,
                  window: int = 512, max_windows: int | None = None,
                  batch_size: int = 4) -> dict:
    """`evaluate` for several models at once, {name: result}: the reference runs once per
    window for all of them (it is the costliest model in the comparison)."""
    windows = evaluation_windows(tokenizer, text, window, max_windows)
    sums = {name: [0.0, 0.0, 0] for name in models}  # nll, kl, agree
    count = 0
    for i in range(0, len(windows), batch_size):
        ids = windows[i:i + batch_size]
        targets = ids[:, 1:]
        count += targets.numel()
        ref_logp = None
        if ref_model is not None:
            ref_logp = F.log_softmax(ref_model(ids.to(ref_model.device))[:, :-1].float(), -1).cpu()
            ref_p, ref_top = ref_logp.exp(), ref_logp.argmax(-1)
        for name, model in models.items():
            logp = F.log_softmax(model(ids.to(model.device))[:, :-1].float(), dim=-1).cpu()
            acc = sums[name]
            acc[0] += -logp.gather(-1, targets[..., None]).sum().item()
            if ref_logp is not None:
                acc[1] += (ref_p * (ref_logp - logp)).sum().item()
                acc[2] += (ref_top == logp.argmax(-1)).sum().item()
    has_ref = ref_model is not None
    return {name: {"ppl": math.exp(nll / count), "kl": kl / count if has_ref else None,
                   "top1": agree / count if has_ref else None, "tokens": count}
            for name, (nll, kl, agree) in sums.items()}
