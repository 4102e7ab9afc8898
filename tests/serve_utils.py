"""Helpers shared by the server tests: an in-process server over the session's model."""
from __future__ import annotations

import time

import httpx

from minillm import LLMEngine
from minillm.serve import ServeConfig, ThreadedServer, create_app
from minillm.serve.metrics import parse_prometheus

MODEL = "smollm2-135m-instruct"


def start_server(smollm, engine_options=None, **options) -> tuple[ThreadedServer, LLMEngine]:
    """options: the ServeConfig's; engine_options: more EngineConfig options."""
    model, tok = smollm
    config = ServeConfig(**options)
    engine = LLMEngine(model, tok, **config.engine_options(), **(engine_options or {}))
    return ThreadedServer(create_app(engine, tok, config)), engine


def metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics").text)


def wait_idle(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is used; return the last
    sample (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        idle = (m["minillm:num_requests_running"] == 0 and m["minillm:num_requests_waiting"] == 0
                and m["minillm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_no_leaked_blocks(engine: LLMEngine) -> None:
    """Call only when the engine is idle (no step can run concurrently)."""
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks, \
        f"{bm.num_blocks - bm.num_free_blocks()} KV blocks still held with nothing running"
    assert not engine.requests and not engine.has_unfinished_requests()
