"""The server's SSE buffering, its Kubernetes probes, and the manifests that use them.

- buffering: whatever `tokens_per_event`, the streamed text joins to the non-streamed text,
  the first token still comes alone, and k tokens per event sends at most 1 + ⌈(n − 1)/k⌉
  text events for n tokens;
- probes: /health/ready answers 503 until the warm-up generation has finished (the engine
  step is held back to make that window as long as the test needs), /health/live answers
  200 meanwhile and 503 once the step in flight outlives `stall_timeout_s`; a draining server
  is live but not ready;
- manifests: every probe path of `k8s.deployment` is a route of the app, on its port; the
  grace period covers the drain; the KEDA trigger carries the rule's target.
"""
from __future__ import annotations

import math
import threading
import time

import httpx
import pytest
import torch

from minillm import LLMEngine
from minillm.serve import ServeConfig, ThreadedServer, create_app, k8s, sse
from minillm.serve.autoscale import QUEUE_DEPTH_QUERY, ScaleRule
from serve_utils import MODEL, start_server, wait_idle

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3456, 314, 2683, 28, 253, 1345, 282]


@pytest.fixture(scope="module")
def server(smollm):
    srv, engine = start_server(smollm, max_num_seqs=8, num_blocks=128)
    yield srv
    srv.stop()


def stream(url: str, k: int | None, max_tokens: int = 23) -> tuple[list[str], int]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if k is not None:
        body["stream_options"]["tokens_per_event"] = k
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = list(sse.iter_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    texts = [c["text"] for e in events[:-1] for c in e["choices"] if c["text"]]
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    return texts, usage[-1]["completion_tokens"]


def test_buffered_streams_carry_the_same_text_in_fewer_events(server):
    url = server.url
    full = httpx.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 23, "temperature": 0.0,
        "ignore_eos": True}, timeout=120).json()["choices"][0]["text"]
    counts = {}
    for k in (None, 1, 2, 5, 10):
        pieces, n = stream(url, k)
        assert n == 23
        assert "".join(pieces) == full, f"tokens_per_event={k} changed the text"
        counts[k] = len(pieces)
        if k is not None:
            assert len(pieces) <= 1 + math.ceil((n - 1) / k), (k, len(pieces))
    assert counts[None] == counts[1]  # the server's default is one token per event
    assert counts[1] > counts[2] > counts[5] >= counts[10] >= 2  # the first token comes alone
    wait_idle(url)


def test_tokens_per_event_is_checked(server):
    for bad in (0, 65, "5", 2.5):
        r = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True,
            "stream_options": {"tokens_per_event": bad}}, timeout=60)
        assert r.status_code == 400, (bad, r.text)
        assert "tokens_per_event" in r.json()["error"]["message"]


def test_the_server_default_buffering_applies(smollm):
    srv, _ = start_server(smollm, max_num_seqs=2, num_blocks=32, stream_tokens_per_event=4)
    try:
        pieces, n = stream(srv.url, None, max_tokens=13)
        assert n == 13 and len(pieces) <= 1 + math.ceil(12 / 4)
        pieces_k1, _ = stream(srv.url, 1, max_tokens=13)  # a request may ask for less buffering
        assert "".join(pieces_k1) == "".join(pieces) and len(pieces_k1) > len(pieces)
    finally:
        srv.stop()


def _get(url: str, path: str) -> tuple[int, dict]:
    r = httpx.get(url + path, timeout=10)
    return r.status_code, r.json()


def test_ready_only_after_warm_up_live_until_a_step_stalls(smollm):
    model, tok = smollm
    config = ServeConfig(max_num_seqs=2, num_blocks=32, stall_timeout_s=3.0)
    engine = LLMEngine(model, tok, **config.engine_options())
    gate = threading.Event()
    step = engine.step

    def held_step():  # the warm-up's first step waits until the test lets it run
        gate.wait(30)
        return step()

    engine.step = held_step
    srv = ThreadedServer(create_app(engine, tok, config), wait_ready=False)
    try:
        status, body = _get(srv.url, "/health/ready")
        assert status == 503 and "warming up" in body["error"]["message"]
        assert _get(srv.url, "/health/live")[0] == 200  # a step in flight, not yet stalled
        time.sleep(3.5)
        status, body = _get(srv.url, "/health/live")
        assert status == 503 and "stall_timeout_s" in body["error"]["message"]
        assert _get(srv.url, "/health/ready")[0] == 503
        gate.set()
        deadline = time.monotonic() + 30
        while _get(srv.url, "/health/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _get(srv.url, "/health/ready")[0] == 200
        assert _get(srv.url, "/health/live")[0] == 200
        assert _get(srv.url, "/health")[0] == 200  # the deep check agrees
        aborted = srv.drain(5.0)  # draining: live, not ready (the app is gone after it)
        assert aborted == 0
    finally:
        gate.set()
        srv.stop()


def test_a_cuda_error_in_a_step_ends_liveness_a_python_error_does_not(smollm):
    # A CUDA error is sticky (every later step fails too): the replica must be restarted.
    from minillm.serve.async_engine import is_device_error

    assert is_device_error(torch.AcceleratorError("CUDA error: an illegal memory access"))
    assert is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_error(RuntimeError("shape mismatch")) and not is_device_error(KeyError())
    model, tok = smollm
    config = ServeConfig(max_num_seqs=2, num_blocks=32)
    engine = LLMEngine(model, tok, **config.engine_options())
    step, failure = engine.step, {"exc": None}

    def failing_step():
        if failure["exc"] is not None:
            raise failure["exc"]
        return step()

    engine.step = failing_step
    srv = ThreadedServer(create_app(engine, tok, config))
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        failure["exc"] = RuntimeError("an engine bug")
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 500
        assert _get(srv.url, "/health/live")[0] == 200  # not sticky: the next step may pass
        failure["exc"] = RuntimeError("CUDA error: an illegal memory access was encountered")
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 500
        status, body = _get(srv.url, "/health/live")
        assert status == 503 and "restart the process" in body["error"]["message"]
        assert "illegal memory access" in body["error"]["message"]
        assert _get(srv.url, "/health/ready")[0] == 503
    finally:
        srv.stop()


def test_a_draining_server_is_not_ready(smollm):
    srv, engine = start_server(smollm, max_num_seqs=2, num_blocks=32)
    try:
        deadline = time.monotonic() + 30
        while _get(srv.url, "/health/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.app.state.engine.draining = True
        status, body = _get(srv.url, "/health/ready")
        assert status == 503 and "draining" in body["error"]["message"]
        assert _get(srv.url, "/health/live")[0] == 200
    finally:
        srv.stop()


def test_the_manifest_probes_the_servers_own_routes():
    config = ServeConfig(port=8123, drain_timeout_s=45, max_num_seqs=16)
    dep = k8s.deployment(config, startup_budget_s=300)
    paths = k8s.probe_paths(dep)
    assert paths == {"startupProbe": ("/health/live", 8123), "livenessProbe": ("/health/live", 8123),
                     "readinessProbe": ("/health/ready", 8123)}
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == 8123
    assert "--port" in container["args"] and "8123" in container["args"]
    tuned = k8s.deployment(ServeConfig(block_size=32, stream_tokens_per_event=5))
    tuned_args = tuned["spec"]["template"]["spec"]["containers"][0]["args"]
    assert tuned_args[4:6] == ["--host", "0.0.0.0"]
    assert tuned_args[6:] == ServeConfig(block_size=32, stream_tokens_per_event=5).cli_args()  # every option
    flags = dict(zip(tuned_args[6::2], tuned_args[7::2]))
    assert flags["--block-size"] == "32" and flags["--stream-tokens-per-event"] == "5"
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 300
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.drain_timeout_s
    rule = ScaleRule(target_per_replica=16, min_replicas=2, max_replicas=6, scale_down_window_s=120)
    so = k8s.scaled_object(rule)
    trigger = so["spec"]["triggers"][0]["metadata"]
    assert trigger["query"] == QUEUE_DEPTH_QUERY and float(trigger["threshold"]) == 16
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)
    import yaml
    assert list(yaml.safe_load_all(k8s.to_yaml([dep, so]))) == [dep, so]


def test_every_probe_path_is_a_route_of_the_app(smollm):
    model, tok = smollm
    config = ServeConfig(max_num_seqs=2, num_blocks=16)
    app = create_app(LLMEngine(model, tok, **config.engine_options()), tok, config)
    routes = {getattr(r, "path", None) for r in app.routes}
    for path, _ in k8s.probe_paths(k8s.deployment(config)).values():
        assert path in routes, f"{path} is probed but not served"
    for metric in ("minillm:num_requests_waiting", "minillm:num_requests_running"):
        assert metric in QUEUE_DEPTH_QUERY
