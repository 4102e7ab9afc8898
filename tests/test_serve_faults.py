"""The server under faults: overload (load shedding), SIGTERM during load (drain), and a
short soak. Overload and soak use in-process servers over the session's model; the drain
test starts `python -m minillm serve` as a real child process and signals it."""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import minillm
from minillm.serve import ServerProcess, loadgen
from serve_utils import MODEL, assert_no_leaked_blocks, metrics, start_server, wait_idle

pytestmark = pytest.mark.slow

PROMPTS = ["The weather today is", "My favourite food is", "In the year 2050,",
           "The best way to learn is"]


def completion(url, prompt, max_tokens, **kw):
    return httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **kw})


def test_overload_sheds_the_excess_with_503_and_completes_the_rest(smollm):
    model, tok = smollm
    expected = {p: minillm.generate(model, tok.encode(p), 8, ignore_eos=True) for p in PROMPTS}
    srv, engine = start_server(smollm, max_num_seqs=2, max_queue_len=4, num_blocks=64)
    try:
        barrier = threading.Barrier(32)

        def one(i):
            barrier.wait()
            return PROMPTS[i % 4], completion(srv.url, PROMPTS[i % 4], 8)
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        shed = [r for _, r in results if r.status_code == 503]
        ok = [(p, r) for p, r in results if r.status_code == 200]
        assert len(shed) + len(ok) == 32, [r.status_code for _, r in results]
        assert shed and ok, f"{len(shed)} shed, {len(ok)} accepted"
        for r in shed:
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["code"] in ("queue_full", "kv_cache_full") and err["type"] and err["message"]
        for p, r in ok:
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == expected[p] and choice["finish_reason"] == "length"
            assert choice["text"] == tok.decode(expected[p], skip_special_tokens=True)
        m = wait_idle(srv.url)
        assert sum(v for k, v in m.items() if k.startswith("minillm:request_shed_total")) == len(shed)
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        assert_no_leaked_blocks(engine)
    finally:
        srv.stop()


def test_a_prompt_the_kv_pool_cannot_take_is_shed(smollm):
    srv, engine = start_server(smollm, max_num_seqs=4, max_queue_len=16, num_blocks=24,
                               block_size=16)
    try:  # a long request holds most of the pool; a second long prompt cannot be admitted
        long_prompt = list(range(100, 100 + 250))  # 16 blocks of prompt
        first = threading.Thread(target=completion, args=(srv.url, long_prompt, 100))
        first.start()
        deadline = time.monotonic() + 60
        while metrics(srv.url)["minillm:kv_cache_usage_perc"] < 0.5:
            assert time.monotonic() < deadline, "the first request never got its blocks"
            time.sleep(0.05)
        r = completion(srv.url, long_prompt[::-1], 4)
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_cache_full"
        assert "Retry-After" in r.headers
        first.join()
        assert completion(srv.url, long_prompt[::-1], 4).status_code == 200  # room again
        wait_idle(srv.url)
        assert_no_leaked_blocks(engine)
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_requests_and_exits_zero(smollm):
    model, tok = smollm
    expected = {p: minillm.generate(model, tok.encode(p), 24, ignore_eos=True) for p in PROMPTS}
    # The child loads the model as the fixture did (on a GPU machine its defaults would be
    # bf16 and Triton attention, whose greedy tokens may differ from this fp32 reference).
    server = ServerProcess(max_num_seqs=4, max_queue_len=16, drain_timeout_s=60,
                           device=str(model.device), dtype=minillm.devices.dtype_name(model.dtype),
                           attn_backend=model.attn_backend.name)
    try:
        started = threading.Barrier(len(PROMPTS) + 1)

        def streamed(prompt):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}
            ids, first = [], True
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as r:
                assert r.status_code == 200
                for event in minillm.serve.sse.iter_events(r.iter_lines()):
                    if event == "[DONE]":
                        return prompt, ids, reason
                    ids += event["choices"][0].get("token_ids", [])
                    reason = event["choices"][0]["finish_reason"]
                    if first:
                        first = False
                        started.wait()
            return prompt, ids, "no [DONE]"
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(streamed, p) for p in PROMPTS]
            started.wait(timeout=120)  # every stream has its first token
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            r = completion(server.url, "too late", 4)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            assert "Retry-After" in r.headers
            done = [f.result(timeout=120) for f in futures]
        for prompt, ids, reason in done:
            assert (ids, reason) == (expected[prompt], "length")
        assert server.proc.wait(timeout=60 + 15) == 0
        assert time.monotonic() - t0 < 60 + 10
    finally:
        server.stop(signal.SIGKILL, 5)


def test_a_drain_past_its_grace_period_aborts_the_rest(smollm):
    srv, engine = start_server(smollm, max_num_seqs=2)  # the SIGTERM path, in process
    got = {}

    def long_request():
        got["r"] = completion(srv.url, "Keep going:", 4000)
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 60
    while metrics(srv.url)["minillm:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert srv.drain(timeout_s=0.5) == 1
    t.join(30)
    assert got["r"].status_code == 503 and got["r"].json()["error"]["code"] == "aborted"
    assert_no_leaked_blocks(engine)


def test_short_soak_no_5xx_no_leaks(smollm):
    srv, engine = start_server(smollm, max_num_seqs=8, max_queue_len=256, num_blocks=256)
    try:
        result = loadgen.run_load(srv.url, rate=4.0, duration_s=8.0, max_tokens=6, seed=1,
                                  timeout_s=120)
        assert result.num_requests >= 10
        assert result.num_errors == 0 and result.num_5xx == 0, result.summary()
        assert len(result.ttft_s) == len(result.e2e_s) == result.num_requests
        assert result.num_output_tokens == 6 * result.num_requests
        assert len(result.itl_s) <= 5 * result.num_requests
        m = wait_idle(srv.url)
        assert m['minillm:request_success_total{finished_reason="length"}'] == result.num_requests
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        assert_no_leaked_blocks(engine)
    finally:
        srv.stop()


def test_internal_errors_are_500_without_a_traceback_and_the_server_recovers(smollm, monkeypatch):
    import minillm.serve.app as app_module
    srv, engine = start_server(smollm, max_num_seqs=2)
    try:
        real_step, failures = engine.step, [1]

        def failing_step():  # one engine step fails, as an engine bug would
            if failures:
                failures.pop()
                raise RuntimeError("secret engine internals")
            return real_step()
        engine.step = failing_step
        r = completion(srv.url, "Hello", 4)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert "secret" not in r.text and "Traceback" not in r.text
        ok = completion(srv.url, "Hello", 4)  # the engine goes on
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4

        def broken(*args, **kw):
            raise KeyError("secret route internals")
        monkeypatch.setattr(app_module, "parse_request", broken)
        r = completion(srv.url, "Hello", 4)
        assert r.status_code == 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "secret" not in r.text and "Traceback" not in r.text
        monkeypatch.undo()
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        wait_idle(srv.url)
        assert_no_leaked_blocks(engine)
    finally:
        srv.stop()
