"""A scale rule on queue depth: how many replicas a fleet of `minillm serve` should run.

The metric is the queue depth counted with the batch it waits for: the requests each replica
holds, waiting or running (`minillm:num_requests_waiting + minillm:num_requests_running` in
/metrics). By Little's law that is λ·W per replica, and a replica whose batch is full with
nobody waiting holds exactly `max_num_seqs`: that is the natural target. (Waiting alone reads
0 at every load below capacity, so it can say when to add replicas but never how many the
steady state needs, and a rule on it alone flaps.)

The rule is Kubernetes' HorizontalPodAutoscaler formula, as KEDA applies it to a Prometheus
query:

    recommendation = ceil(total in flight / target_per_replica), clamped to [min, max]
    no change while |in flight / (replicas · target) − 1| <= tolerance
    scale up at once; scale down only to the largest recommendation of the last
    `scale_down_window_s` (the HPA's stabilization window: a lull is not a trend)

Invariants: `desired` is within [min_replicas, max_replicas]; it never goes below the
largest recommendation inside the window; it depends only on the history it is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ScaleRule", "QUEUE_DEPTH_QUERY"]

# The Prometheus query of the metric, summed over the fleet's replicas.
QUEUE_DEPTH_QUERY = "sum(minillm:num_requests_waiting) + sum(minillm:num_requests_running)"


@dataclass(frozen=True)
class ScaleRule:
    target_per_replica: float          # requests in flight (waiting + running) per replica
    min_replicas: int = 1
    max_replicas: int = 8
    scale_down_window_s: float = 30.0  # a scale-down waits for the recommendation to hold this long
    tolerance: float = 0.1             # HPA's default: no change within ±10% of the target
    interval_s: float = 1.0            # how often the rule is evaluated (KEDA: pollingInterval)

    def __post_init__(self):
        if not self.target_per_replica > 0:
            raise ValueError(f"target_per_replica must be > 0 requests, got "
                             f"{self.target_per_replica!r}; use the replica's max_num_seqs")
        if not (isinstance(self.min_replicas, int) and isinstance(self.max_replicas, int)
                and 1 <= self.min_replicas <= self.max_replicas):
            raise ValueError(f"need ints 1 <= min_replicas <= max_replicas, got "
                             f"{self.min_replicas!r} and {self.max_replicas!r}")
        for name in ("scale_down_window_s", "tolerance", "interval_s"):
            if not getattr(self, name) >= 0 or (name == "interval_s" and self.interval_s <= 0):
                raise ValueError(f"{name} must be a number >= 0 (interval_s > 0), got "
                                 f"{getattr(self, name)!r}")

    def recommend(self, replicas: int, in_flight: float) -> int:
        """The replicas the current reading asks for (before the scale-down window)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        ratio = in_flight / (replicas * self.target_per_replica)
        if abs(ratio - 1) <= self.tolerance:
            return self._clamp(replicas)
        return self._clamp(math.ceil(in_flight / self.target_per_replica - 1e-9))

    def desired(self, replicas: int, in_flight: float, history: list[tuple[float, int]],
                now: float) -> int:
        """The replicas to run now. `history` holds (time, recommendation) of earlier
        evaluations; this call appends its own."""
        rec = self.recommend(replicas, in_flight)
        history.append((now, rec))
        if rec >= replicas:
            return rec
        recent = [r for t, r in history if t >= now - self.scale_down_window_s]
        return min(max(recent), replicas)

    def _clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))
