"""The model runner: ONE forward pass per engine step, over every scheduled token.

The tokens of all scheduled sequences are flattened into input_ids [1, N] and positions
[1, N], decodes (query_len == 1) first, then prefill chunks. Nothing is padded: a step's
cost is the number of tokens it computes. Attention reads and writes the paged KV cache
through the context `PagedAttentionBuilder` makes for the step (block tables,
slot_mapping).

Only the sequences that sample this step (those whose last token is computed now) need
logits, so the runner asks the model for `hidden_states`, picks one row per sampling
sequence, and runs `compute_logits` on those rows alone: for a 512-token prefill chunk that
skips a [512, 576] x [576, 49152] product (the LM head is ~20% of SmolLM2's weights).

Sampling is per request, with its own seeded generator (seed + sample index), so a
request's tokens do not depend on what else is in the batch. Greedy rows are one argmax.
"""
from __future__ import annotations

import torch

from ..attention.paged import PagedAttentionBuilder, decode_path
from ..paged.kv_cache import PagedKVCache
from ..sampling import sample_next
from .request import Request
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, block_manager, path: str | None = None):
        self.model, self.kv_cache, self.block_manager = model, kv_cache, block_manager
        self.attention = PagedAttentionBuilder(model.attn_backend, kv_cache, path)

    @property
    def decode_path(self) -> str:
        """How decode rows attend (see minillm.attention.paged)."""
        return self.attention.decode_path

    @decode_path.setter
    def decode_path(self, path: str) -> None:
        # The serving benchmark alternates the path between steps (an in-run A/B).
        self.attention.decode_path = decode_path(self.model.attn_backend, self.kv_cache, path)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step; return logits [S, V] (fp32) for the S sequences of `out.seqs` that
        sample, in their order in `out.seqs`."""
        if not out.seqs:
            raise ValueError("nothing scheduled: the scheduler returned an empty step")
        device = self.model.device
        # Decodes first, by context length (the attention context groups similar lengths);
        # then prefill chunks in scheduler order.
        order = sorted(range(len(out.seqs)), key=lambda i: (
            out.seqs[i].num_new_tokens != 1,
            out.seqs[i].start if out.seqs[i].num_new_tokens == 1 else 0))
        ids, positions, meta_seqs, last_row = [], [], [], {}
        for i in order:
            s = out.seqs[i]
            tokens = s.request.all_token_ids[s.start:s.start + s.num_new_tokens]
            ids += tokens
            positions += range(s.start, s.start + s.num_new_tokens)
            last_row[i] = len(ids) - 1
            meta_seqs.append((self.block_manager.get_block_table(s.request.seq_id), s.start,
                              s.num_new_tokens))
        if out.copy_on_write:  # before this step writes into the copies
            self.kv_cache.copy_blocks(out.copy_on_write)
        ctx = self.attention.build(meta_seqs, device)
        h = self.model.hidden_states(torch.tensor([ids], device=device),
                                     torch.tensor([positions], device=device), ctx)
        rows = [last_row[i] for i, s in enumerate(out.seqs) if s.samples]
        return self.model.compute_logits(h[0, torch.tensor(rows, dtype=torch.long,
                                                           device=device)]).float()


def sample_tokens(logits: torch.Tensor, requests: list[tuple[Request, int]]) -> list[int]:
    """One token per (request, logits row). Greedy requests share one argmax."""
    greedy = logits.argmax(-1).tolist() if len(logits) else []
    out = []
    for req, row in requests:
        p = req.params
        if p.temperature == 0:
            out.append(greedy[row])
        else:
            out.append(sample_next(logits[row], p.temperature, p.top_k, p.top_p,
                                   req.generator))
    return out
