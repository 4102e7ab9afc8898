"""Turning logits into the next token: greedy, temperature, top-k and top-p (nucleus).

Sampling is reproducible: each request draws from its own `torch.Generator` seeded with
its `seed`, so the same seed gives the same tokens whatever else runs in the batch.
"""
from __future__ import annotations

import torch


def validate_sampling(temperature, top_k, top_p) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def make_generator(seed: int | None, device=None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device or "cpu")
    g.manual_seed(int(seed))
    return g


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf. logits: [V] or [B, V]."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most
        # likely token is always kept.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The distribution `sample_next` draws from (temperature > 0): logits [..., V] ->
    fp32 probabilities [..., V], zero outside the top-k / top-p nucleus."""
    return filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id drawn from probs [V] (with `generator`, reproducibly)."""
    return int(draw_tensor(probs, generator))


def draw_tensor(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`draw` without reading the id back: a [1] long tensor on the generator's device (the
    draw runs where the generator lives), so a device generator costs no host sync."""
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> int:
    """Pick one token id from logits [V]."""
    if temperature == 0:
        return int(logits.argmax())
    return draw(sampling_probs(logits, temperature, top_k, top_p), generator)


def sample_next_tensor(logits: torch.Tensor, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """`sample_next` as a [1] long tensor, computed where logits (and generator) live."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return draw_tensor(sampling_probs(logits, temperature, top_k, top_p), generator)
