"""The model runner: ONE forward pass per engine step, over every scheduled token.

The tokens of all scheduled sequences are flattened into input_ids [1, N] and positions
[1, N], decodes (query_len == 1) first, then prefill chunks. Eager steps pad nothing: a
step's cost is the number of tokens it computes. Attention reads and writes the paged KV
cache through the step's `PagedAttentionContext` (block tables, slot_mapping).

A decode-only step goes through `DecodeGraphs` instead, unless the config says
`enforce_eager`: its rows padded to a bucket size, replayed as a CUDA graph on a GPU
(`minillm.engine.cuda_graph`). Prefill and mixed steps go through `PiecewiseGraphs` where
the config says `piecewise_graphs` (the default on CUDA with graphs): the same flattened
tokens padded to a token bucket, every op but attention replayed from graphs
(`minillm.engine.piecewise`); otherwise they run eagerly, unpadded.

No host syncs in a step: its inputs are built on the host and reach the device in one
copy (`HostToDevice`, or the graph runner's own buffer), the model is called without its
argument checks (they would read positions back), sampling runs on the device, and the
sampled ids come back in one copy at the end (`sample_tokens`).

Only the sequences that sample this step (those whose last token is computed now) need
logits, so the runner asks the model for `hidden_states`, picks one row per sampling
sequence, and runs `compute_logits` on those rows alone: for a 512-token prefill chunk that
skips a [512, 576] x [576, 49152] product (the LM head is ~20% of SmolLM2's weights).

Sampling is per request, with its own seeded generator (seed + sample index) on the model's
device, so a request's tokens do not depend on what else is in the batch. Greedy rows are
one argmax. `sample_on_device` leaves the ids on the device; `sample_tokens` reads them back.

Async scheduling (`minillm.engine.overlap`): `execute(out, prev)` runs while the step
before (`prev`, its sampled ids still on the device) is unresolved. A decode row whose input
token is a placeholder (`PENDING`) takes it from `prev.ids` on the device: the host sends
its index in the step's one copy, and a gather writes it into the input ids before the
forward pass. Nothing on the host ever reads the placeholder as a token.
"""
from __future__ import annotations

import torch

from ..attention.paged import PagedAttentionContext, PagedAttentionMetadata
from ..paged.kv_cache import PagedKVCache
from ..sampling import sample_next_tensor
from .cuda_graph import DecodeGraphs
from .piecewise import PiecewiseGraphs
from .request import PENDING, Request
from .scheduler import SchedulerOutput
from .staging import HostToDevice


class ModelRunner:
    """Runs steps as `config` (the engine's resolved config) says: its decode_path,
    enforce_eager and piecewise_graphs are read here, never changed."""

    def __init__(self, model, kv_cache: PagedKVCache, block_manager, config, backend=None,
                 pieces: PiecewiseGraphs | None = None):
        """backend: the attention backend of the paged context (None: the model's; the
        engine passes its own, `EngineConfig.attn_backend`). pieces: a runner's
        PiecewiseGraphs to keep (captured for this model, cache and token budget: they do
        not depend on the decode path), instead of capturing anew."""
        self.model, self.kv_cache, self.block_manager = model, kv_cache, block_manager
        self.config = config
        self.backend = model.attn_backend if backend is None else backend
        self.staging = HostToDevice(model.device)
        self.graphs = None if config.enforce_eager else DecodeGraphs(model, kv_cache,
                                                                     block_manager, config,
                                                                     self.backend)
        self.pieces = None
        if config.piecewise_graphs:
            self.pieces = pieces or PiecewiseGraphs(model, kv_cache,
                                                    config.max_num_batched_tokens)
            if self.pieces.failed:  # it warned; the steps run as without it
                self.pieces = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prev=None) -> torch.Tensor:
        """Run the step; return logits [S, V] (fp32) for the S sequences of `out.seqs` that
        sample, in their order in `out.seqs`. prev: the step in flight's `SampledIds`
        (async scheduling), where placeholder input tokens are found."""
        if not out.seqs:
            raise ValueError("nothing scheduled: the scheduler returned an empty step")
        if out.copy_on_write:  # before this step writes into the copies
            self.kv_cache.copy_blocks(out.copy_on_write)
        seqs = out.seqs
        if (self.graphs is not None and all(s.num_new_tokens == 1 for s in seqs)
                and self.graphs.bucket(len(seqs)) is not None):
            sampling = [i for i, s in enumerate(seqs) if s.samples]
            rows = [(s.request.seq_id, s.start, s.request.token_ids(s.start, s.start + 1)[0])
                    for s in seqs]
            pending = None
            # Placeholders: id 0 on the host, the value from prev.ids. Only when a row has
            # one: the step in flight may have sampled nothing (prompt chunks only), and
            # a gather from its empty ids would index out of range (on CUDA: a device assert).
            if prev is not None and any(t == PENDING for _, _, t in rows):
                sources = [prev.source(seq_id) if t == PENDING else -1
                           for seq_id, _, t in rows]
                rows = [(seq_id, pos, max(t, 0)) for seq_id, pos, t in rows]
                pending = (prev.ids, sources)
            h = self.graphs.run(rows, sampling, pending)
        else:
            h = self._eager(out, prev)
        return self.model.compute_logits(h).float()

    def _eager(self, out: SchedulerOutput, prev=None) -> torch.Tensor:
        """The step as one flattened pass (unpadded, or padded to a token bucket through
        `PiecewiseGraphs`); hidden states of the sampling rows."""
        # Decodes first, by context length (the gather path groups similar lengths); then
        # prefill chunks in scheduler order.
        order = sorted(range(len(out.seqs)), key=lambda i: (
            out.seqs[i].num_new_tokens != 1,
            out.seqs[i].start if out.seqs[i].num_new_tokens == 1 else 0))
        ids, positions, meta_seqs, last_row = [], [], [], {}
        dst, src = [], []  # placeholder inputs: ids[dst[j]] = prev.ids[src[j]]
        for i in order:
            s = out.seqs[i]
            tokens = s.request.token_ids(s.start, s.start + s.num_new_tokens)
            if prev is not None and tokens[-1] == PENDING:  # only ever a decode's input
                dst.append(len(ids) + len(tokens) - 1)
                src.append(prev.source(s.request.seq_id))
                tokens[-1] = 0
            ids += tokens
            positions += range(s.start, s.start + s.num_new_tokens)
            last_row[i] = len(ids) - 1
            meta_seqs.append((self.block_manager.get_block_table(s.request.seq_id), s.start,
                              s.num_new_tokens))
        path = self.config.decode_path
        meta = PagedAttentionMetadata.build(meta_seqs, self.kv_cache.block_size,
                                            decode_groups=path == "gather")
        rows = [last_row[i] for i, s in enumerate(out.seqs) if s.samples]
        gather = [torch.tensor(dst), torch.tensor(src)] if dst else []
        # One matrix of ids and positions (and, padded to a token bucket for the pieces,
        # slots: padding is token 0 at position 0 into the trash slot).
        n = len(ids)
        b = self.pieces.bucket(n) if self.pieces is not None else None
        inputs = torch.zeros((2, n) if b is None else (3, b), dtype=torch.long)
        inputs[0, :n], inputs[1, :n] = torch.tensor(ids), torch.tensor(positions)
        if b is not None:
            inputs[2] = self.kv_cache.trash_slot
            inputs[2, :n] = meta.slot_mapping
        rows_t, inputs_t, *tensors = self.staging.send(
            [torch.tensor(rows, dtype=torch.long), inputs, *gather, *meta.tensors()])
        if dst:
            dst_t, src_t, *tensors = tensors
            inputs_t[0].index_copy_(0, dst_t, prev.ids.index_select(0, src_t).long())
        ctx = PagedAttentionContext(self.backend, self.kv_cache, meta.with_tensors(tensors),
                                    path)
        if b is None:
            h = self.model.hidden_states(inputs_t[0][None], inputs_t[1][None], ctx,
                                         check=False)[0]
        else:
            h = self.pieces.run(inputs_t, ctx, n)
        return h.index_select(0, rows_t)


def sample_tokens(logits: torch.Tensor, requests: list[tuple[Request, int]]) -> list[int]:
    """One token per (request, logits row), chosen on the logits' device; the ids come back
    to the host in one copy."""
    if not requests:
        return []
    return sample_on_device(logits, requests).tolist()


def sample_on_device(logits: torch.Tensor, requests: list[tuple[Request, int]]) -> torch.Tensor:
    """One token id per (request, logits row), as a tensor on the logits' device: nothing
    is read back. Greedy rows share one argmax; a sampled row draws with its request's
    generator (on the model's device), in the order of `requests`."""
    greedy = logits.argmax(-1)
    if all(req.params.temperature == 0 for req, _ in requests) and \
            [row for _, row in requests] == list(range(len(greedy))):
        return greedy
    # Rows by slicing, never by a host list of indices (that copy would wait for the GPU).
    picks = [greedy[row:row + 1] if req.params.temperature == 0 else
             sample_next_tensor(logits[row], req.params.temperature, req.params.top_k,
                                req.params.top_p, req.generator).to(logits.device)
             for req, row in requests]
    return torch.cat(picks)
