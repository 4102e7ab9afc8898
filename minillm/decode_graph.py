"""Batch-1 decode through a CUDA graph: `generate(..., cuda_graph=True)`.

A decode step of a small model on a GPU is launch-bound: SmolLM2 launched ~900 kernels per
token in plain PyTorch (30 layers x ~30; ~160 with the fused glue and the decode GEMV)
while reading its weights takes ~0.1 ms. `DecodeGraph` captures
one decode step once and replays it: one launch per token. With `compile=True` the step is
first compiled by torch.compile (default mode, dynamic=False: Inductor fuses the glue
between the weight products, so there are fewer, larger kernels to replay), then captured
by hand. Prefill stays eager.

What a graph needs is that every tensor it touches keeps its address and shape:
- a static KV cache of `capacity` tokens per row (a power of two >= what the request
  needs, at least 256), allocated once; prefill writes the prompt's K/V into it eagerly;
- this step's K/V written at each row's position on the device: by `index_put_`, or, where
  the Triton glue runs (CUDA, not compiled), by RoPE's pass (q|k|v's decode GEMV, or
  `rope_kv`) through slots b * capacity + position (the cache viewed as [B * capacity,
  Hkv, D]: `kv_write`);
- static input buffers `input_ids [B, 1]` and `positions [B, 1]`, set before each replay
  with `fill_` (a kernel argument, no host-to-device copy);
- attention over the fixed-size cache, the length taken from `positions` on the device:
  a backend with a graph-safe paged kernel (Triton) reads the cache as one block of
  `capacity` tokens per row with context_lens = position + 1; the torch backend runs SDPA
  over the whole capacity with the keys past the position masked out;
- the logits [B, 1, V] come out in a static buffer; the host samples them as in eager.

Graphs live on the model (`model._decode_graphs`), one per (batch size, compile). One is
reused while the attention backend's kind, the weights' addresses, the dtype, a large
enough capacity and `fused.FUSED_GEMV`, `fused.FUSED_ROPE` (the decode GEMV, its RoPE
epilogue, on or off) stay the same; otherwise it is rebuilt (and re-captured).

`cuda_graph=None` (generate's default) means True on CUDA and False elsewhere. On a CPU
there are no CUDA graphs: `cuda_graph=True` warns once and runs the same static step
without capture, which is how the CPU tests check that it gives eager's tokens.
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Iterator

import torch

from .attention import ContiguousCacheContext, decode_attention
from .graph_capture import capture_guard
from .kv_cache import KVCache
from .layers import fused

MIN_CAPACITY = 256
_WARNED: set[str] = set()


def plain_cache(use_cache: bool = True, append_fn=None, attend_fn=None) -> bool:
    """Whether generate runs the cache with its default functions (what a graph or a
    compiled step needs): a student's append_fn / attend_fn run eagerly."""
    return bool(use_cache) and append_fn is None and attend_fn is None


def use_cuda_graph(requested: bool | None, device: torch.device, plain: bool) -> bool:
    """Resolve generate's `cuda_graph` argument. plain: the cache and the default cache
    functions are in use (a student's append_fn / attend_fn run eagerly)."""
    if requested is None:
        return device.type == "cuda" and plain
    if requested and not plain:
        raise ValueError("cuda_graph=True needs use_cache=True and the default append_fn / "
                         "attend_fn (a student's functions run eagerly); pass "
                         "cuda_graph=False")
    if requested and device.type != "cuda" and "cpu" not in _WARNED:
        _WARNED.add("cpu")
        warnings.warn("cuda_graph=True on a device without CUDA graphs: the decode steps run "
                      "the graph's static step (fixed-size cache, static buffers) without "
                      "capturing it: the same tokens, no speed-up", stacklevel=4)
    return bool(requested)


def get(model, batch_size: int, num_tokens: int, compile: bool = False) -> "DecodeGraph":
    """A DecodeGraph for `model` that holds num_tokens tokens per row (reused if it can)."""
    graphs = model.__dict__.setdefault("_decode_graphs", {})
    g = graphs.get((batch_size, compile))
    if g is None or not g.serves(model, num_tokens):
        graphs.pop((batch_size, compile), None)  # free the old cache before the new one
        limit = model.config.max_position_embeddings
        capacity = min(limit, max(MIN_CAPACITY, 1 << (num_tokens - 1).bit_length()))
        g = graphs[(batch_size, compile)] = DecodeGraph(model, batch_size, capacity, compile)
    return g


def _weights_key(model) -> tuple:
    return tuple(t.data_ptr() for t in [*model.parameters(), *model.buffers()])


class StaticCacheContext:
    """Attention of one new token per row over a fixed-size contiguous cache: the write and
    the lengths come from `positions` [B] on the device, so no shape ever changes."""

    def __init__(self, backend, cache: KVCache, rows: torch.Tensor, positions: torch.Tensor):
        """rows: arange(B) (static); positions [B]: where each row's new token goes."""
        self.backend, self.cache, self.rows, self.positions = backend, cache, rows, positions
        self.paged = getattr(backend, "graph_safe", False)
        self.slot_mapping = None  # row b's new token: slot b * capacity + position b
        if fused.stores_kv(cache.k[0]):  # the Triton glue stores K/V in RoPE's pass
            self.slot_mapping = torch.add(positions, rows, alpha=cache.max_seq_len)
        if self.paged:  # the cache as a paged one: row b is block b, of capacity tokens
            self.block_tables, self.context_lens = rows[:, None].int(), (positions + 1).int()
        else:
            keys = torch.arange(cache.max_seq_len, device=positions.device)
            self.key_mask = keys[None, :] <= positions[:, None]

    def kv_write(self, layer_idx):
        """The cache viewed as rows [B * capacity, Hkv, D], for RoPE's pass (or None)."""
        if self.slot_mapping is None:
            return None
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        return fused.KVWrite(k_cache.flatten(0, 1), v_cache.flatten(0, 1), self.slot_mapping)

    def attend(self, layer_idx, q, k, v, kv_stored=False):  # q [B, 1, Hq, D], k/v [B, 1, Hkv, D]
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        if not kv_stored:
            k_cache.index_put_((self.rows, self.positions), k[:, 0])
            v_cache.index_put_((self.rows, self.positions), v[:, 0])
        if self.paged:
            out = self.backend.paged_decode(q[:, 0], k_cache, v_cache, self.block_tables,
                                            self.context_lens)
        else:
            out = decode_attention(q[:, 0], k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                   self.key_mask)
        return out[:, None]


class DecodeGraph:
    """One decode step for `batch_size` rows over a static cache, captured on CUDA."""

    def __init__(self, model, batch_size: int, capacity: int, compile: bool = False):
        device = model.device
        self.model, self.batch_size, self.capacity = model, batch_size, capacity
        self.backend, self.dtype, self.weights = model.attn_backend, model.dtype, _weights_key(model)
        # captured with (or without) the decode GEMV, and with (or without) RoPE in q|k|v's
        self.fused_gemv = (fused.FUSED_GEMV, fused.FUSED_ROPE)
        self.cache = KVCache(model.config, batch_size, capacity, model.dtype, device)
        for t in self.cache.k + self.cache.v:  # masked keys must hold numbers (0 * NaN = NaN)
            t.zero_()
        self.rows = torch.arange(batch_size, device=device)
        self.input_ids = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        self.step = self._step
        if compile:
            from .layers import cpu_linear
            model.check_compilable()
            cpu_linear.prepare()  # measure and build now: inside the trace it would break it
            self.step = torch.compile(self._step, dynamic=False)
        self.next_ids = torch.zeros(batch_size, dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        # Two pinned host slots for the greedy tokens: step t copies into slot t % 2 while
        # the host still reads slot (t - 1) % 2 (see `greedy`).
        self.host_ids = torch.zeros((2, batch_size), dtype=torch.long, pin_memory=cuda)
        self.graph, self.logits, self.num_replays = None, None, 0
        if cuda:
            self._capture(warmups=3 if compile else 1)
            # as captured: a GEMV that failed in the warm-up switched itself off first
            self.fused_gemv = (fused.FUSED_GEMV, fused.FUSED_ROPE)

    def serves(self, model, num_tokens: int) -> bool:
        return (type(self.backend) is type(model.attn_backend) and self.dtype == model.dtype
                and num_tokens <= self.capacity and self.weights == _weights_key(model)
                and self.fused_gemv == (fused.FUSED_GEMV, fused.FUSED_ROPE))

    def _step(self) -> torch.Tensor:
        ctx = StaticCacheContext(self.backend, self.cache, self.rows, self.positions[:, 0])
        return self.model.run(self.input_ids, self.positions, ctx)  # no checks, no syncs

    def _step_and_feed(self) -> torch.Tensor:
        """The step, then its greedy token fed back on the device: the next step's input is
        this step's argmax at the next position (what `greedy` replays back to back)."""
        logits = self.step()
        self.next_ids.copy_(logits[:, -1].argmax(-1))
        self.input_ids.copy_(self.next_ids[:, None])
        self.positions.add_(1)
        return logits

    @torch.inference_mode()
    def _capture(self, warmups: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compilation, autotuning, lazy init: not in capture
            for _ in range(warmups):
                self._step_and_feed()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with capture_guard(), torch.cuda.graph(self.graph):
            self.logits = self._step_and_feed()
        torch.cuda.synchronize()

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Eager prefill of input_ids [B, T] into the static cache; logits [B, 1, V] of the
        last position."""
        T = input_ids.shape[1]
        if input_ids.shape[0] != self.batch_size or T > self.capacity:
            raise ValueError(f"this graph serves {self.batch_size} rows of up to "
                             f"{self.capacity} tokens; got {tuple(input_ids.shape)}")
        positions = torch.arange(T, device=input_ids.device).expand(self.batch_size, T)
        ctx = ContiguousCacheContext(self.backend, self.cache, 0)
        return self.model(input_ids, positions, ctx, last_only=True)

    def decode(self, token_ids: int | list[int], position: int) -> torch.Tensor:
        """Feed one token per row (an int: the same for every row) at `position`; logits
        [B, 1, V] (a static buffer on CUDA: read it before the next call)."""
        if not 0 <= position < self.capacity:
            raise ValueError(f"position {position} is outside this graph's cache "
                             f"[0, {self.capacity})")
        if isinstance(token_ids, int):
            self.input_ids.fill_(token_ids)
        else:
            self.input_ids.copy_(torch.tensor(token_ids)[:, None])
        self.positions.fill_(position)
        return self._replay()

    def _replay(self) -> torch.Tensor:
        if self.graph is None:
            return self._step_and_feed()
        self.graph.replay()
        self.num_replays += 1
        return self.logits

    def greedy(self, token_id: int, position: int, count: int) -> Iterator[int]:
        """Greedy decoding of row 0 from `token_id` at `position`: yields `count` tokens,
        each the argmax of the step before, computed and fed back on the device.

        Pipelined one step ahead: step t+1 is queued before the host reads step t's token
        (copied into a pinned slot and waited for through an event, which does not wait
        for step t+1), so the GPU never idles while Python handles a token. A consumer
        that stops early (a stop token) leaves at most one extra step computed, at a
        position the cache holds (never past `count` steps)."""
        if not 0 <= position or position + count > self.capacity:
            raise ValueError(f"{count} steps from position {position} do not fit this graph's "
                             f"cache of {self.capacity} positions")
        self.input_ids.fill_(token_id)
        self.positions.fill_(position)
        pending: deque = deque()  # (slot, event) of the queued steps, oldest first
        queued = 0
        while queued < min(2, count):
            pending.append(self._queue(queued))
            queued += 1
        for _ in range(count):
            slot, done = pending.popleft()
            if done is not None:
                done.synchronize()  # this step's copy only: the next step runs on
            token = int(self.host_ids[slot, 0])
            if queued < count:  # the slot is read: a later step may write it again
                pending.append(self._queue(queued))
                queued += 1
            yield token

    def _queue(self, t: int):
        """Replay one step and queue the copy of its greedy tokens into host slot t % 2."""
        self._replay()
        slot = t % 2
        self.host_ids[slot].copy_(self.next_ids, non_blocking=self.graph is not None)
        if self.graph is None:
            return slot, None
        done = torch.cuda.Event()
        done.record()
        return slot, done
