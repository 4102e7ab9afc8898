"""Kubernetes manifests for `minillm serve`: a Deployment whose probes are the server's own
routes, and a KEDA ScaledObject that scales it on queue depth (`minillm.serve.autoscale`).

    docs = [deployment(config), scaled_object(ScaleRule(target_per_replica=16))]
    print(to_yaml(docs))        # kubectl apply -f -

The probes, and why each is what it is:
- startupProbe -> GET /health/live: the server opens its port only once the model is loaded,
  so this waits out the load (failureThreshold × periodSeconds >= `startup_budget_s`) before
  liveness starts counting;
- livenessProbe -> GET /health/live: answered from the engine loop's state, never queued
  behind requests, so a busy replica is not restarted; it fails when the loop died or one
  step has run for `stall_timeout_s` (then a restart is the cure);
- readinessProbe -> GET /health/ready: 503 until the warm-up generation finished and while
  draining, so the Service sends traffic only to replicas that can serve it at full speed.
  (GET /health, the deep one-token check, is for a load balancer or a human, not a probe:
  under load it waits its turn in the queue.)
- terminationGracePeriodSeconds covers the SIGTERM drain (`drain_timeout_s`) plus its flush.

Invariants: every probe path is a route of `create_app`; the container's port is the probes'
port; the grace period exceeds the drain timeout; manifests are plain dicts (JSON-able).
"""
from __future__ import annotations

import json
import math

from .autoscale import QUEUE_DEPTH_QUERY, ScaleRule
from .config import ServeConfig

__all__ = ["deployment", "scaled_object", "to_yaml", "probe_paths", "LIVE_PATH", "READY_PATH"]

LIVE_PATH, READY_PATH = "/health/live", "/health/ready"


def deployment(config: ServeConfig | None = None, *, name: str = "minillm",
               image: str = "minillm:latest", replicas: int = 1, startup_budget_s: float = 600,
               gpu: bool = False) -> dict:
    """An apps/v1 Deployment running `python -m minillm serve` with `config`'s options."""
    c = config or ServeConfig()
    args = ["python", "-m", "minillm", "serve", "--host", "0.0.0.0", *c.cli_args()]

    def probe(path: str, period: int, failures: int) -> dict:
        return {"httpGet": {"path": path, "port": c.port}, "periodSeconds": period,
                "timeoutSeconds": 5, "failureThreshold": failures}

    container = {
        "name": name, "image": image, "args": args,
        "ports": [{"name": "http", "containerPort": c.port}],
        "startupProbe": probe(LIVE_PATH, 10, max(1, math.ceil(startup_budget_s / 10))),
        "livenessProbe": probe(LIVE_PATH, 10, 3),
        "readinessProbe": probe(READY_PATH, 5, 1),
    }
    if gpu:
        container["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": dict(labels)},
                 "template": {
                     "metadata": {"labels": dict(labels), "annotations": {
                         "prometheus.io/scrape": "true", "prometheus.io/port": str(c.port),
                         "prometheus.io/path": "/metrics"}},
                     "spec": {"terminationGracePeriodSeconds": math.ceil(c.drain_timeout_s) + 15,
                              "containers": [container]}}},
    }


def scaled_object(rule: ScaleRule, *, name: str = "minillm",
                  prometheus: str = "http://prometheus.monitoring:9090") -> dict:
    """A KEDA ScaledObject applying `rule` to the Deployment `name`: the fleet's requests in
    flight (QUEUE_DEPTH_QUERY) against `target_per_replica` each."""
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": rule.min_replicas, "maxReplicaCount": rule.max_replicas,
            "pollingInterval": max(1, round(rule.interval_s)),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleDown": {"stabilizationWindowSeconds": round(rule.scale_down_window_s)},
                "scaleUp": {"stabilizationWindowSeconds": 0}}}},
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": prometheus, "query": QUEUE_DEPTH_QUERY,
                "threshold": f"{rule.target_per_replica:g}"}}],
        },
    }


def probe_paths(manifest: dict) -> dict[str, tuple[str, int]]:
    """{probe kind: (path, port)} of every container of a Deployment manifest."""
    out = {}
    for c in manifest["spec"]["template"]["spec"]["containers"]:
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind in c:
                out[kind] = (c[kind]["httpGet"]["path"], c[kind]["httpGet"]["port"])
    return out


def to_yaml(docs: list[dict]) -> str:
    """The manifests as one multi-document YAML text (JSON documents where PyYAML is
    missing: YAML reads JSON too)."""
    try:
        import yaml
    except ImportError:
        return "\n---\n".join(json.dumps(d, indent=2) for d in docs)
    return "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)
