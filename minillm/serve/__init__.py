"""minillm.serve: an OpenAI-compatible streaming HTTP server over `LLMEngine`.

    python -m minillm serve --port 8000            # then: curl / the openai client
    with serve.ServerProcess(max_queue_len=4) as s: ...   # from Python, on a free port

Modules, read in this order: `config` (ServeConfig), `protocol` (the request checks),
`detok` (incremental UTF-8 detokenization and stop strings), `async_engine` (the one task
that owns the engine), `app` (the routes), `server` (uvicorn and the SIGTERM drain),
`process` (ServerProcess), `metrics` (Prometheus), `sse` (the event-stream format) and
`loadgen` (Poisson load, latency percentiles).
"""
from . import loadgen, metrics, sse
from .app import create_app
from .config import MODEL_NAME, ServeConfig
from .errors import APIError
from .loadgen import LoadResult, measure_capacity, run_load, sweep
from .process import ServerProcess
from .server import ThreadedServer

__all__ = ["APIError", "LoadResult", "MODEL_NAME", "ServeConfig", "ServerProcess", "ThreadedServer",
           "create_app", "loadgen", "measure_capacity", "metrics", "run_load", "sse", "sweep"]
