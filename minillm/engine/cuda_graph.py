"""The serving engine's decode steps through CUDA graphs: padded static buffers, one graph
per batch-size bucket.

Why: on a GPU a small model's decode step is launch-bound, not memory-bound. SmolLM2 ran
~30 kernels per layer in plain PyTorch, ~900 per step (still ~160 with the fused glue and
the decode GEMV: `minillm.layers.fused`), each costing a few µs to launch from Python,
while the step's weights take ~0.1 ms to read at 3 TB/s. A CUDA graph records the kernels
once and replays them with one launch.

A decode-only step (every scheduled sequence computes one token) of n sequences runs as a
batch of `bucket(n)` rows, the smallest capture size >= n: 1, 2, 4, 8, then every 16, up to
min(max_num_seqs, max_cudagraph_capture_size) (that bound is a size too). Prefill and
mixed steps are not one graph: their attention's shapes change with every chunk (every op
but attention replays from graphs per token bucket: `minillm.engine.piecewise`). The LM
head and the sampler stay outside the graph too: they run on the rows that sample only.

Static buffers. One int32 row per sequence, in a pinned host matrix and its device twin:

    input_id | position | slot | context_len | sample_row | source | block_table[0 .. max_blocks-1]

The host fills the first n rows (once the previous copy out of them is done: a
`CopyFence`); ONE copy moves the first bucket(n) rows to the device, where the captured
graphs read them. A row's block table is written only when it changed (its
`block_table_version`: a block appended, a copy-on-write, another sequence in the row),
about once per block_size steps of a decoding sequence, not every step. Rows n .. bucket-1
are padding: token 0 at position 0, slot `kv_cache.trash_slot` (its K/V land in a row that
no block contains), context_len 1 over block 0 (a read that stays in bounds), and never
sampled. So the block pool and every block of the cache end exactly as after the eager
step.

Async scheduling (`minillm.engine.overlap`): a row whose input token the host does not know
yet (sampled by the step still in flight) has `source` = its index in that step's ids on
the device; after the copy, and before the replay, one gather fills those rows' input ids
from there (`_fill_pending`). Rows with source -1 keep the host's id.

Capture (CUDA, `enforce_eager=False`): per bucket, largest first, one eager run of the body
on a side stream (Triton autotuning, cuBLAS workspaces, lazy initialisation: nothing of
that may happen inside capture), then the capture into a `torch.cuda.CUDAGraph`. All graphs
share one memory pool (`torch.cuda.graph_pool_handle()`): only one runs at a time. The body
reads nothing back to the host: it calls the model's unchecked internals
(`hidden_states(check=False)`) and attention takes lengths and block tables as device
tensors (the Triton paged-decode kernel runs inside the graph).

On a CPU nothing is captured: `run` calls the same body eagerly, so the CPU tests cover
the padding and the bucketing (`enforce_eager=False` there is for testing, not speed).
"""
from __future__ import annotations

import torch

from ..attention.paged import PagedAttentionContext, PagedAttentionMetadata
from ..graph_capture import capture_guard
from ..paged.kv_cache import PagedKVCache
from .staging import CopyFence

COLUMNS = 6  # input_id, position, slot, context_len, sample_row, source; then the table


def capture_sizes(max_num_seqs: int, max_capture_size: int) -> list[int]:
    """The batch buckets: 1, 2, 4, 8, then every 16, below top = min(max_num_seqs,
    max_capture_size), and top itself."""
    top = min(max_num_seqs, max_capture_size)
    return [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16)) + [top]


class DecodeGraphs:
    """Padded decode steps, captured per bucket on CUDA (run eagerly on a CPU)."""

    def __init__(self, model, kv_cache: PagedKVCache, block_manager, config, backend=None):
        self.model, self.kv_cache, self.path = model, kv_cache, config.decode_path
        self.backend = model.attn_backend if backend is None else backend  # the engine's
        self.block_manager = block_manager
        self.sizes = capture_sizes(config.max_num_seqs, config.max_cudagraph_capture_size)
        self.max_blocks = -(-config.max_model_len // kv_cache.block_size)
        rows, device = self.sizes[-1], model.device
        cuda = device.type == "cuda"
        self.host = torch.zeros((rows, COLUMNS + self.max_blocks), dtype=torch.int32,
                                pin_memory=cuda)
        self._rows = self.host.numpy()  # the same memory: numpy writes are cheap per element
        # The block table version (`BlockManager.block_table_version`) each row's table
        # columns hold, 0 for none: a row's table is rewritten only when it changed.
        self._row_versions = [0] * rows
        self.dev = self.host.to(device) if cuda else self.host
        self.hidden = torch.empty((rows, model.config.hidden_size), dtype=model.dtype,
                                  device=device)
        self._fence = CopyFence()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_padded_steps = self.num_replays = 0
        if cuda:
            self._capture()

    def bucket(self, n: int) -> int | None:
        """The batch size a step of n decode rows runs at (None: more than any bucket)."""
        return next((b for b in self.sizes if b >= n), None)

    def run(self, seqs: list[tuple[object, int, int]], sample_rows: list[int],
            pending: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """seqs: (seq_id, position, input_id) per decode row, n <= the largest bucket; the
        block manager has each sequence's table. Returns the final hidden states [S, hidden]
        of rows `sample_rows`, in that order. pending: (ids on the device, one source per
        row: the index in ids of its input token, or -1 to keep input_id)."""
        n, bs, rows, bm = len(seqs), self.kv_cache.block_size, self._rows, self.block_manager
        b = self.bucket(n)
        self._fence.wait()
        versions, head = self._row_versions, []
        for i, (seq_id, pos, token) in enumerate(seqs):
            v = bm.block_table_version(seq_id)
            if versions[i] != v:  # a new sequence in this row, or its table changed
                table = bm.get_block_table(seq_id)
                if len(table) > self.max_blocks:
                    raise ValueError(f"a block table of {len(table)} blocks exceeds the "
                                     f"{self.max_blocks} that max_model_len allows")
                rows[i, COLUMNS:COLUMNS + len(table)] = table
                versions[i] = v
            block = int(rows[i, COLUMNS + pos // bs])  # the table as written: current
            head.append((token, pos, block * bs + pos % bs, pos + 1))
        if n:
            rows[:n, :4] = head
        self._pad(n, b)
        rows[:len(sample_rows), 4] = sample_rows
        if pending is not None:
            rows[:n, 5] = pending[1]
        if self.dev is not self.host:
            self.dev[:b].copy_(self.host[:b], non_blocking=True)
            self._fence.copied()
        if pending is not None:
            self._fill_pending(n, *pending)
        if b in self.graphs:
            self.graphs[b].replay()
            self.num_replays += 1
        else:
            self._forward(b)
        self.num_padded_steps += 1
        if sample_rows == list(range(n)):
            return self.hidden[:n]
        return self.hidden.index_select(0, self.dev[:len(sample_rows), 4])

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end-1 become padding (see the module doc)."""
        self._rows[start:end, :4] = (0, 0, self.kv_cache.trash_slot, 1)
        self._rows[start:end, COLUMNS] = 0
        self._row_versions[start:end] = [0] * (end - start)  # their tables are gone

    def _fill_pending(self, n: int, ids: torch.Tensor, sources: list[int]) -> None:
        """On the device, after the copy: rows 0..n-1 with a source >= 0 take their input
        id from ids[source]. No read-back. The steady state, every row's token from the
        same row of the step before (the same requests decoding in the same order), is one
        copy; otherwise a fixed number of ops whatever the sources."""
        if sources == list(range(n)):
            self.dev[:n, 0].copy_(ids[:n])
            return
        source = self.dev[:n, 5]
        from_ids = ids.index_select(0, source.clamp(min=0)).to(self.dev.dtype)
        self.dev[:n, 0] = torch.where(source >= 0, from_ids, self.dev[:n, 0])

    def _forward(self, b: int) -> None:
        """The body a graph captures: the model over the first b rows of the device buffer,
        final hidden states into `self.hidden[:b]`."""
        cols = self.dev[:b, :4].t().contiguous()  # [4, b]: ids, positions, slots, lengths
        meta = PagedAttentionMetadata.decode_only(cols[2].long(), self.dev[:b, COLUMNS:],
                                                  cols[3])
        ctx = PagedAttentionContext(self.backend, self.kv_cache, meta, self.path)
        h = self.model.hidden_states(cols[0][None], cols[1][None], ctx, check=False)
        self.hidden[:b].copy_(h[0])

    @torch.inference_mode()
    def _capture(self) -> None:
        self._pad(0, self.sizes[-1])  # warm-up and capture write the trash slot only
        self.dev.copy_(self.host)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with capture_guard():  # no garbage collection mid-capture: it may free a graph
            for b in reversed(self.sizes):  # largest first: its buffers size the pool
                with torch.cuda.stream(side):
                    self._forward(b)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(b)
                self.graphs[b] = graph
        torch.cuda.synchronize()
