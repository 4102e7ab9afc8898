"""minillm.serve: an OpenAI-compatible streaming HTTP server over `LLMEngine`.

    python -m minillm serve --port 8000            # then: curl / the openai client
    with serve.ServerProcess(max_queue_len=4) as s: ...   # from Python, on a free port

Modules, read in this order: `config` (ServeConfig), `protocol` (the request checks),
`detok` (incremental UTF-8 detokenization and stop strings), `async_engine` (the one task
that owns the engine), `app` (the routes), `server` (uvicorn and the SIGTERM drain),
`process` (ServerProcess), `metrics` (Prometheus), `sse` (the event-stream format),
`loadgen` (Poisson load, latency percentiles), `workload` (the benchmark's requests),
`autoscale` (a scale rule on queue depth) and `k8s` (Kubernetes manifests: probes, KEDA).

The names below are imported on first use (PEP 562), not with the package: importing
`minillm.serve.workload` (the benchmarks and `benchmarks/gpu_check.py` do) must not need
FastAPI, uvicorn or prometheus_client, which a GPU image may lack.
"""
from __future__ import annotations

import importlib

# name -> the submodule that defines it
_EXPORTS = {"APIError": "errors", "LoadResult": "loadgen", "MODEL_NAME": "config",
            "ServeConfig": "config", "ServerProcess": "process", "ThreadedServer": "server",
            "create_app": "app", "measure_capacity": "loadgen", "run_load": "loadgen",
            "sweep": "loadgen"}
_SUBMODULES = ("autoscale", "k8s", "loadgen", "metrics", "sse")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
