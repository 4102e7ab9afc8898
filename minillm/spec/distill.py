"""Train a tiny draft model for speculative decoding by distilling the target.

The draft is the target's architecture with a few layers: it shares the target's embedding
and tied LM head (the same tensors, frozen; nothing is copied), starts its layers as copies
of some of the target's layers, and learns to match the target's next-token distribution
on real text by minimizing KL(p_target ‖ p_draft) at every position.

Why this shape: a draft must have the target's vocabulary, and at SmolLM2's size the
embedding/LM head is a fifth of the weights, so even a 1-layer draft costs r ≈ 0.2 of a
target step on a CPU. The layers are cheap; the head is the price of admission.

    draft = make_draft(target, layers=(0, -1))
    losses = distill(draft, target, token_ids, seconds=600)
    spec.speculative_generate(target, spec.ModelDraft(draft), prompt, 64)

`benchmarks/train_draft.py` trains one within a time budget and measures its acceptance
rate and speedup.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..model import LlamaModel


def make_draft(target: LlamaModel, layers: Sequence[int] = (0, -1)) -> LlamaModel:
    """A draft whose layers start as copies of the target's `layers` (indices, negative
    from the end), sharing the target's embedding, final norm's shape and LM head."""
    n = target.config.num_layers
    picked = [i % n for i in layers]
    if not picked or any(not -n <= i < n for i in layers):
        raise ValueError(f"layers must be 1+ indices into the target's {n} layers, got {layers!r}")
    cfg = replace(target.config, num_layers=len(picked))
    draft = LlamaModel(cfg, attn_backend=target.attn_backend).to(target.device, target.dtype)
    draft.embed_tokens.weight = target.embed_tokens.weight  # shared, never trained
    draft.tie_weights()
    with torch.no_grad():
        for dst, i in zip(draft.layers, picked):
            dst.load_state_dict(target.layers[i].state_dict())  # copies into dst's own tensors
        draft.norm.load_state_dict(target.norm.state_dict())
    draft.rope_cos, draft.rope_sin = target.rope_cos, target.rope_sin
    return draft.eval()


def trainable_parameters(draft: LlamaModel) -> list[torch.nn.Parameter]:
    """The draft's own weights: its layers and final norm (not the shared embedding/head)."""
    return [p for m in (draft.layers, draft.norm) for p in m.parameters()]


def distill(draft: LlamaModel, target: LlamaModel, token_ids: Sequence[int], *,
            seq_len: int = 128, batch_size: int = 4, lr: float = 3e-4,
            seconds: float | None = None, steps: int | None = None, seed: int = 0,
            log: Callable[[str], None] | None = print, log_every: int = 20) -> list[float]:
    """Train the draft's layers and norm on random windows of `token_ids` until `seconds`
    or `steps` runs out (at least one must be given). Returns the loss of every step
    (KL in nats per token, mean over positions)."""
    if seconds is None and steps is None:
        raise ValueError("give a budget: seconds=..., steps=... or both")
    if len(token_ids) < seq_len + 1:
        raise ValueError(f"need more than seq_len={seq_len} tokens of text, got {len(token_ids)}")
    data = torch.tensor(list(token_ids), dtype=torch.long)
    params = trainable_parameters(draft)
    for p in draft.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    t0 = time.perf_counter()
    draft.train()
    while (steps is None or len(losses) < steps) and (
            seconds is None or time.perf_counter() - t0 < seconds):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=g)
        ids = torch.stack([data[s:s + seq_len] for s in starts.tolist()]).to(target.device)
        with torch.no_grad():
            teacher = F.log_softmax(target(ids).float(), dim=-1)
        student = F.log_softmax(draft(ids).float(), dim=-1)
        loss = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log and (len(losses) % log_every == 0 or len(losses) == 1):
            log(f"step {len(losses)}: KL {losses[-1]:.3f} nats/token "
                f"({time.perf_counter() - t0:.0f} s)")
    draft.eval()
    for p in params:
        p.requires_grad_(False)
    return losses
