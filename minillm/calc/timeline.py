"""A per-rank timeline of one forward pass under tensor and pipeline parallelism.

``tp_pp_timeline`` lays out, for every rank, when it computes, when it waits inside an
all-reduce and when it idles in the pipeline bubble. It is the model behind Lab 08's
parallelism widget; its parts are the closed forms of ``calc.parallel``:

- **Tensor parallelism** (``tp_size`` ranks per stage): a rank does 1/tp of each layer's
  work, then joins ``calc.tp_allreduces_per_layer()`` = 2 all-reduces per layer (after
  o_proj and after down_proj), each priced by ``calc.allreduce_time_s`` (ring, per-direction
  link bandwidth, a latency per ring step).
- **Pipeline parallelism** (``pp_stages`` stages, GPipe forward): the layers are split into
  consecutive groups, one per stage; a batch is cut into ``num_microbatches`` microbatches;
  a stage starts microbatch m when it has finished m − 1 and stage s − 1's activations for
  m have arrived (a point-to-point send of ``message_bytes``).

Global rank = stage · tp_size + tp_rank; the tp ranks of one stage share one timeline.

Invariants (tested against ``calc``):
- with no send time and layers that split evenly, the bubble fraction is exactly
  ``calc.pp_bubble_fraction(pp_stages, num_microbatches)``;
- on every rank, compute + comm + bubble = ``total_s``; intervals never overlap;
- with ``pp_stages = 1`` nothing idles, and the communication fraction is
  2·t_allreduce ÷ (t_layer ÷ tp + 2·t_allreduce).

Plain Python on floats, like the rest of ``calc`` (a widget calls it on every slider move).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._common import _int, _probability, _real
from .parallel import allreduce_time_s, tp_allreduces_per_layer

__all__ = ["Interval", "Timeline", "tp_pp_timeline", "layer_time_s", "layer_split"]

KINDS = ("compute", "comm", "bubble")


@dataclass(frozen=True)
class Interval:
    """One stretch of one rank's time: ``kind`` is "compute", "comm" (inside an all-reduce)
    or "bubble" (idle, waiting for the pipeline). ``microbatch``/``layer`` are None for a
    bubble."""

    rank: int
    stage: int
    kind: str
    start_s: float
    end_s: float
    microbatch: int | None = None
    layer: int | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    tp_size: int
    pp_stages: int
    num_microbatches: int
    intervals: tuple            # every rank's Intervals, sorted by (rank, start)
    total_s: float              # when the last stage finishes the last microbatch
    layer_compute_s: float      # one layer, one microbatch, on one rank (already ÷ tp)
    allreduce_s: float          # one all-reduce (0 at tp = 1)
    send_s: float               # one stage-to-stage send (0 at pp = 1)
    layers_per_stage: tuple

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_stages

    def rank_intervals(self, rank: int) -> list:
        return [i for i in self.intervals if i.rank == rank]

    def seconds(self, kind: str, rank: int | None = None) -> float:
        """Time spent in ``kind`` on ``rank`` (or summed over every rank)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {kind!r}.")
        return sum(i.duration_s for i in self.intervals
                   if i.kind == kind and (rank is None or i.rank == rank))

    def fraction(self, kind: str) -> float:
        """Share of all ranks' time (world_size · total_s) spent in ``kind``."""
        return self.seconds(kind) / (self.world_size * self.total_s)

    @property
    def bubble_fraction(self) -> float:
        return self.fraction("bubble")

    @property
    def comm_fraction(self) -> float:
        return self.fraction("comm")

    @property
    def compute_fraction(self) -> float:
        return self.fraction("compute")


def layer_time_s(params_per_layer, num_tokens, dtype_bytes, peak_flops, bandwidth_bytes_per_s) -> float:
    """One layer's forward on one GPU, on the roofline: the longer of its matmul FLOPs
    (2 · tokens · params) at ``peak_flops`` and its weight reads (params · dtype_bytes) at
    ``bandwidth_bytes_per_s``. Attention over the KV cache is left out (short contexts)."""
    p = _real("params_per_layer", params_per_layer)
    t = _int("num_tokens", num_tokens)
    flops_s = 2 * t * p / _real("peak_flops", peak_flops)
    read_s = p * _real("dtype_bytes", dtype_bytes) / _real("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return max(flops_s, read_s)


def layer_split(num_layers, pp_stages) -> tuple:
    """Layers per stage, consecutive and as even as possible (the first stages take one more
    when they do not divide): 30 layers on 4 stages -> (8, 8, 7, 7)."""
    n, p = _int("num_layers", num_layers), _int("pp_stages", pp_stages)
    if p > n:
        raise ValueError(f"pp_stages ({p}) must be at most num_layers ({n}): every stage needs a layer.")
    base, extra = divmod(n, p)
    return tuple(base + (s < extra) for s in range(p))


def tp_pp_timeline(num_layers, layer_compute_s, message_bytes, tp_size=1, pp_stages=1,
                   num_microbatches=1, link_bandwidth_bytes_per_s=450e9, latency_s=0.0,
                   p2p_bandwidth_bytes_per_s=None, attention_share=0.5) -> Timeline:
    """The GPipe forward of ``num_microbatches`` microbatches over ``pp_stages`` stages of
    ``tp_size`` ranks each.

    ``layer_compute_s``: one layer's compute for one microbatch on ONE GPU holding the whole
    layer (tp = 1); a tp rank takes 1/tp of it. ``message_bytes``: one microbatch's hidden
    state (tokens · hidden · dtype_bytes), the all-reduce message and the stage-to-stage send.
    ``link_bandwidth_bytes_per_s``: per direction (NVLink 4: 450e9, PCIe Gen5 x16: 32e9);
    ``p2p_bandwidth_bytes_per_s`` defaults to it. ``attention_share``: the part of a layer's
    compute before the first all-reduce (attention), the rest being the MLP.
    """
    L = _int("num_layers", num_layers)
    tp, pp = _int("tp_size", tp_size), _int("pp_stages", pp_stages)
    m = _int("num_microbatches", num_microbatches)
    msg = _real("message_bytes", message_bytes, allow_zero=True)
    bw = _real("link_bandwidth_bytes_per_s", link_bandwidth_bytes_per_s)
    lat = _real("latency_s", latency_s, allow_zero=True)
    share = _probability("attention_share", attention_share)
    p2p = (bw if p2p_bandwidth_bytes_per_s is None
           else _real("p2p_bandwidth_bytes_per_s", p2p_bandwidth_bytes_per_s))
    split = layer_split(L, pp)
    compute = _real("layer_compute_s", layer_compute_s) / tp
    allreduce = allreduce_time_s(msg, tp, bw, lat) if tp > 1 else 0.0
    send = msg / p2p + lat if pp > 1 else 0.0
    per_layer = tp_allreduces_per_layer()
    assert per_layer == 2, "the layer below places exactly two all-reduces"

    first_layer = [sum(split[:s]) for s in range(pp)]
    busy = {s: [] for s in range(pp)}   # stage -> [(kind, start, end, microbatch, layer)]
    stage_free = [0.0] * pp
    arrival = [0.0] * m                 # when microbatch j's input reaches the current stage
    for s in range(pp):
        for j in range(m):
            t = max(stage_free[s], arrival[j])
            for layer in range(first_layer[s], first_layer[s] + split[s]):
                for part in (share, 1.0 - share):  # attention then MLP, each ending in an all-reduce
                    busy[s].append(("compute", t, t + compute * part, j, layer))
                    t += compute * part
                    if allreduce:
                        busy[s].append(("comm", t, t + allreduce, j, layer))
                        t += allreduce
            stage_free[s] = t
            arrival[j] = t + send
    total = stage_free[-1]

    intervals = []
    for s in range(pp):
        for r in range(s * tp, (s + 1) * tp):
            clock = 0.0
            for kind, a, b, j, layer in busy[s]:
                if a > clock:
                    intervals.append(Interval(r, s, "bubble", clock, a))
                if b > a:
                    intervals.append(Interval(r, s, kind, a, b, j, layer))
                clock = max(clock, b)
            if total > clock:
                intervals.append(Interval(r, s, "bubble", clock, total))
    return Timeline(tp, pp, m, tuple(intervals), total, compute, allreduce, send, split)
