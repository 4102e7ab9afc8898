"""Prefill and mixed steps through piecewise CUDA graphs: every op of the step but
attention, captured per token-count bucket.

Why: on a GPU an eager step is launch-bound whatever its size. On the H100 (2026-11-26 and
27) an eager step of the serving engine took 24-50 ms of host time, ~280 kernel launches
from Python (most of them Triton's, tens of µs each there), while the GPU was busy ~1 ms.
A decode-only step avoids that with one graph per batch bucket (`minillm.engine.cuda_graph`),
but a step that computes a prompt chunk cannot be one graph here: its attention's work and
grid follow every sequence's query and context lengths (`PagedAttentionMetadata`:
cu_seqlens, the gathered keys), which change from step to step. Everything else in the
step is row-wise: a token's embedding, norms, products, RoPE and MLP read that token only.
So, as vLLM's piecewise mode does, the step is cut at attention:

    piece 0        the embedding, layer 0 up to attention (norm, q|k|v, RoPE, K/V store)
    attention 0    eager, over the real tokens only
    piece i        layer i-1 from attention on (o_proj, norm, MLP), layer i up to attention
    ...
    piece L        layer L-1 from attention on, the final norm

L + 1 graphs per bucket and L eager attention calls: a SmolLM2 step is 31 replays and 30
attention calls (a few launches each) instead of ~280 launches.

Buckets. A step of n tokens runs as `bucket(n)` rows: 16, 32, 64, ... (powers of two)
below the step's token budget (max_num_batched_tokens), and the budget itself. Rows n ..
bucket-1 are padding: token 0 at position 0 into slot `kv_cache.trash_slot`. Row-wise ops
keep them to themselves, their K/V land in the row no block holds, attention never reads
them, and no sampled row is one of them. So the cache and every real row end as after the
unpadded eager step.

Static buffers, on the device, sized by the largest bucket:

    inputs [3, top] long    token ids, positions, slot_mapping (padded as above)
    q, k, v [1, top, H, D]  a piece's last kernels copy its attention's inputs here (k and
                            v only where attention stores K/V itself: no Triton glue)
    attn [1, top, Hq, D]    the eager attention writes its output here for the next piece
    hidden [top, hidden]    the last piece's output: what the LM head reads

The residual stream between pieces needs no buffer: the one forward pass that was captured
held it in its own tensors, in the graphs' shared pool.

Capture (CUDA): per bucket, largest first, one eager run of the padded forward on a side
stream with attention skipped (Triton compiling, cuBLAS workspaces, lazy initialisation:
nothing of that may happen inside a capture), then ONE run of the forward during which the
attention context ends the graph being captured and begins the next at every layer's
attention (`CUDAGraph.capture_begin` / `capture_end`). All graphs share one memory pool:
only one runs at a time, and a step replays a bucket's pieces in capture order. A capture
that fails turns piecewise graphs off with one warning, and those steps run eagerly.

On a CPU nothing is captured: `run` calls the same padded forward with attention inline
(the same copies into the same buffers), so the CPU tests cover the bucketing, the padding
and the buffers (`piecewise_graphs=True` there is for testing, not speed).
"""
from __future__ import annotations

import warnings

import torch

from ..graph_capture import capture_guard
from ..layers import fused
from ..paged.kv_cache import PagedKVCache

MIN_BUCKET = 16  # fewer tokens pad to 16: the products cost the same at 1 and at 16 rows


def token_buckets(max_tokens: int) -> list[int]:
    """The token-count buckets: powers of two from MIN_BUCKET below max_tokens, then
    max_tokens itself (a step never computes more: it is the scheduler's budget)."""
    sizes, b = [], MIN_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


class PiecewiseGraphs:
    """Padded prefill / mixed steps, captured per bucket on CUDA (run inline on a CPU)."""

    def __init__(self, model, kv_cache: PagedKVCache, max_num_batched_tokens: int):
        self.model, self.kv_cache = model, kv_cache
        self.sizes = token_buckets(max_num_batched_tokens)
        top, cfg, device, dtype = self.sizes[-1], model.config, model.device, model.dtype
        self.inputs = torch.zeros((3, top), dtype=torch.long, device=device)
        self.inputs[2] = kv_cache.trash_slot
        self.q = torch.zeros((1, top, cfg.num_heads, cfg.head_dim), dtype=dtype, device=device)
        self.k = torch.zeros((1, top, cfg.num_kv_heads, cfg.head_dim), dtype=dtype,
                             device=device)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros_like(self.q)
        self.hidden = torch.zeros((top, cfg.hidden_size), dtype=dtype, device=device)
        self.glue_stores_kv = fused.stores_kv(kv_cache.k_caches[0])
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[tuple[int, bool]]] = {}  # (layer, kv_stored) per piece
        self.pool = None
        self.num_steps = self.num_replays = 0
        self.failed = False  # the capture failed: the runner runs these steps unpadded
        if device.type == "cuda":
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001  (any failure: the steps stay eager)
                self.graphs.clear()
                self.calls.clear()
                self.failed = True
                warnings.warn(f"piecewise CUDA graphs are off: capturing them failed "
                              f"({type(e).__name__}: {e}); prefill and mixed steps run "
                              f"eagerly", stacklevel=2)

    def bucket(self, n: int) -> int | None:
        """The rows a step of n tokens runs at (None: more than the largest bucket)."""
        return next((b for b in self.sizes if b >= n), None)

    def run(self, inputs: torch.Tensor, ctx, n: int) -> torch.Tensor:
        """inputs [3, b] long on the device: ids, positions, slots of the step's n tokens,
        padded to b = bucket(n) (module doc); ctx: the step's `PagedAttentionContext` over
        the n real tokens. Returns the final hidden states [b, hidden] (rows >= n: padding)."""
        b = inputs.shape[1]
        self.inputs[:, :b].copy_(inputs)
        if b in self.graphs:
            pieces = self.graphs[b]
            for graph, (layer_idx, kv_stored) in zip(pieces, self.calls[b]):
                graph.replay()
                self.attention(layer_idx, ctx, n, kv_stored)
            pieces[-1].replay()
            self.num_replays += 1
        else:
            self._forward(_Boundary(self, b, "inline", ctx, n))
        self.num_steps += 1
        return self.hidden[:b]

    def attention(self, layer_idx: int, ctx, n: int, kv_stored: bool) -> None:
        """Layer's attention over the first n rows of the static inputs, into `attn`."""
        out = ctx.attend(layer_idx, self.q[:, :n], self.k[:, :n], self.v[:, :n], kv_stored)
        self.attn[:, :n].copy_(out)

    def _forward(self, boundary: "_Boundary") -> None:
        """The padded forward over the first b static rows, final hidden states into
        `hidden[:b]`: what the pieces of a bucket are, with attention between them."""
        b = boundary.b
        h = self.model.hidden_states(self.inputs[0, :b][None], self.inputs[1, :b][None],
                                     boundary, check=False)
        self.hidden[:b].copy_(h[0])

    @torch.inference_mode()
    def _capture(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with capture_guard():  # no garbage collection mid-capture: it may free a graph
            for b in reversed(self.sizes):  # largest first: its tensors size the pool
                with torch.cuda.stream(side):
                    self._forward(_Boundary(self, b, "warmup"))
                torch.cuda.synchronize()
                boundary = _Boundary(self, b, "capture")
                with torch.cuda.stream(side):
                    boundary.begin()
                    try:
                        self._forward(boundary)
                    except BaseException:
                        # End the capture in progress (the stream leaves capture mode
                        # even when that reports the failure) and raise the error that
                        # broke it, not capture_end's own "capture invalidated".
                        try:
                            boundary.end()
                        except Exception:  # noqa: BLE001
                            pass
                        raise
                    boundary.end()
                self.graphs[b], self.calls[b] = boundary.graphs, boundary.calls
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' cached blocks on the side stream


class _Boundary:
    """The attention context the padded forward sees. K/V are stored through the static
    slot_mapping; at each layer's attention, its inputs go into the static buffers, then
    (mode):

        "inline"   the real attention over the first n rows, into `attn` (a CPU; CUDA
                   without graphs)
        "warmup"   nothing more (the eager run before a capture)
        "capture"  the graph being captured ends (with those copies as its last kernels)
                   and the next one begins

    and the layer goes on with `attn[:, :b]`, the buffer the next piece reads."""

    def __init__(self, owner: PiecewiseGraphs, b: int, mode: str, ctx=None, n: int = 0):
        self.owner, self.b, self.mode, self.ctx, self.n = owner, b, mode, ctx, n
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[tuple[int, bool]] = []
        self.capturing = False  # a piece's capture has begun and not ended

    def kv_write(self, layer_idx: int) -> fused.KVWrite | None:
        o = self.owner
        if not o.glue_stores_kv:
            return None  # attend stores K/V (from the k, v buffers, real rows only)
        return fused.KVWrite(*o.kv_cache.flat(layer_idx), o.inputs[2, :self.b])

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_stored: bool = False) -> torch.Tensor:
        o, b = self.owner, self.b
        o.q[:, :b].copy_(q)
        if not kv_stored:
            o.k[:, :b].copy_(k)
            o.v[:, :b].copy_(v)
        if self.mode == "inline":
            o.attention(layer_idx, self.ctx, self.n, kv_stored)
        elif self.mode == "capture":
            self.calls.append((layer_idx, kv_stored))
            self.end()
            self.begin()
        return o.attn[:, :b]

    def begin(self) -> None:
        """Start capturing the next piece (on the current stream, into the shared pool)."""
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.owner.pool)
        self.graphs.append(graph)
        self.capturing = True

    def end(self) -> None:
        """End the piece being captured (once: a second call does nothing)."""
        if self.capturing:
            self.capturing = False
            self.graphs[-1].capture_end()
