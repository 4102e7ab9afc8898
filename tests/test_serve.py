"""The server against the real model, one in-process server for the module: the openai
client unchanged, greedy chat against `minillm.generate`, streamed against non-streamed
text, the chunk rules, exact usage and finish reasons, the /metrics counts, a corpus of
malformed requests, and 50 streams cut off mid-way."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import minillm
from minillm.serve import sse
from serve_utils import MODEL, assert_no_leaked_blocks, metrics, start_server, wait_idle

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm):
    srv, engine = start_server(smollm, max_num_seqs=8, num_blocks=256, max_queue_len=64)
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def post(url, path, body, **kw):
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120, **kw)


def stream_events(url, path, body) -> list:
    with httpx.stream("POST", url + path, json={"model": MODEL, **body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(sse.iter_events(r.iter_lines()))


def test_openai_client_completions_and_chat_streamed_and_not(client):
    models = [m.id for m in client.models.list()]
    assert models == [MODEL]
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                  temperature=0)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 6 and c.choices[0].text
    pieces = [ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True)
        if ch.choices]
    assert "".join(pieces) == c.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                          temperature=0)
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and "Paris" in text
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_greedy_chat_equals_generate_token_for_token(server, smollm):
    model, tok = smollm
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids = tok.apply_chat_template(messages)
    expected = minillm.generate(model, ids, max_new_tokens=32)
    r = post(server[0].url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 32, "temperature": 0, "return_token_ids": True}).json()
    choice = r["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["message"]["content"] == tok.decode(expected, skip_special_tokens=True)
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected),
                          "total_tokens": len(ids) + len(expected)}
    reached_max = len(expected) == 32 and expected[-1] != tok.eos_token_id
    assert choice["finish_reason"] == ("length" if reached_max else "stop")


@pytest.mark.parametrize("prompt,seed", [("Write a short poem with emojis:", 1),
                                         ("Translate to Japanese: good morning, friend.", 2),
                                         ("Ünïcödé tëxt: ", 3)])
def test_streamed_chunks_join_to_the_non_streamed_text(server, smollm, prompt, seed):
    _, tok = smollm
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 1.0, "seed": seed, "n": 2,
            "return_token_ids": True}
    full = post(server[0].url, "/v1/completions", body).json()
    events = stream_events(server[0].url, "/v1/completions", body)
    for i, choice in enumerate(full["choices"]):
        pieces = [e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i]
        streamed_ids = sum((e["choices"][0].get("token_ids", []) for e in events[:-1]
                            if e["choices"][0]["index"] == i), [])
        assert streamed_ids == choice["token_ids"]
        assert "".join(pieces) == choice["text"] == tok.decode(choice["token_ids"],
                                                               skip_special_tokens=True)
        if "\ufffd" not in choice["text"]:
            assert not any("\ufffd" in p for p in pieces)
    assert full["choices"][0]["token_ids"] != full["choices"][1]["token_ids"]  # seed + index


def test_chunk_rules_and_exact_usage(server, smollm):
    _, tok = smollm
    body = {"messages": CHAT, "max_tokens": 12, "n": 2, "temperature": 0.8, "seed": 5,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    events = stream_events(server[0].url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    usage_chunk, chunks = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == []
    assert all("usage" in c and c["usage"] is None for c in chunks)
    num_tokens = 0
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in ch["delta"] for ch in mine[1:])
        finals = [ch for ch in mine if ch["finish_reason"] is not None]
        assert len(finals) == 1 and finals[0] is mine[-1]
        ids = sum((ch.get("token_ids", []) for ch in mine), [])
        assert len(ids) <= 12
        assert finals[0]["finish_reason"] == ("length" if len(ids) == 12 and
                                              ids[-1] != tok.eos_token_id else "stop")
        num_tokens += len(ids)
    prompt = len(tok.apply_chat_template(CHAT))
    assert usage_chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": num_tokens,
                                    "total_tokens": prompt + num_tokens}


def test_finish_reason_length_exactly_at_max_tokens_and_stop_strings(server):
    url = server[0].url
    for max_tokens in (1, 7):
        r = post(url, "/v1/completions", {"prompt": "The", "max_tokens": max_tokens,
                                          "ignore_eos": True, "temperature": 0}).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == max_tokens
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 64,
                                           "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] < 64
    full = r["choices"][0]["message"]["content"]
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 64, "temperature": 0,
                                           "stop": ["Paris"]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == full[:full.index("Paris")]
    events = stream_events(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 64,
                                                         "temperature": 0, "stop": "Paris"})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == full[:full.index("Paris")]


def test_metrics_count_ten_requests_of_ten_tokens(server, smollm):
    url, (_, tok) = server[0].url, smollm
    prompts = [f"Request number {i}: tell me about the number {i * 7}." for i in range(10)]
    before = wait_idle(url)

    def one(p):
        return post(url, "/v1/completions", {"prompt": p, "max_tokens": 10, "ignore_eos": True,
                                             "stream": p.endswith("7.") or None})
    with ThreadPoolExecutor(5) as pool:
        assert all(r.status_code == 200 for r in pool.map(one, prompts))
    after = wait_idle(url)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["minillm:time_to_first_token_seconds_count"] == 10
    assert d["minillm:inter_token_latency_seconds_count"] == 90
    assert d["minillm:e2e_request_latency_seconds_count"] == 10
    assert d["minillm:generation_tokens_total"] == 100
    assert d['minillm:request_success_total{finished_reason="length"}'] == 10
    assert d["minillm:prompt_tokens_total"] == sum(len(tok.encode(p)) for p in prompts)
    assert after["minillm:num_requests_running"] == 0 and after["minillm:kv_cache_usage_perc"] == 0


def malformed_corpus() -> list[tuple[str, dict]]:
    """(path, httpx request kwargs) for requests that must each get a 4xx."""
    C, H = "/v1/completions", "/v1/chat/completions"
    ok_c = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    ok_h = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad_values = [None, "x", "", -1, 0, 1.5, -1e308, 1e308, 10**30, True, [], {}, [1], {"a": 1}]
    cases = []
    for path, ok in ((C, ok_c), (H, ok_h)):
        for field in ("max_tokens", "temperature", "top_p", "seed", "n", "stop", "stream",
                      "stream_options", "top_k", "ignore_eos", "model"):
            for v in bad_values:
                body = {**ok, field: v}
                if _acceptable(field, v):
                    continue
                cases.append((path, {"content": json.dumps(body)}))
        for missing in ok:
            if missing != "max_tokens":
                cases.append((path, {"json": {k: v for k, v in ok.items() if k != missing}}))
        for raw in ("NaN", "Infinity", "-Infinity"):  # not JSON, though Python's json writes them
            cases.append((path, {"content": json.dumps(ok)[:-1] + f', "temperature": {raw}}}'}))
        full = json.dumps(ok).encode()
        for cut in (1, 5, len(full) // 2, len(full) - 1):
            cases.append((path, {"content": full[:cut]}))  # truncated JSON
        cases += [(path, {"content": b'{"model": "\xff\xfe"}'}),  # invalid UTF-8
                  (path, {"content": full.decode().encode("utf-16")}),
                  (path, {"content": b"[]"}), (path, {"content": b"null"}),
                  (path, {"content": b"42"}), (path, {"content": b""})]
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "", "multipart/form-data"):
            cases.append((path, {"content": full, "headers": {"content-type": ctype}}))
        big = {**ok, "user": "x" * (1 << 20)}
        cases.append((path, {"content": json.dumps(big)}))  # oversized body
        cases.append((path, {"content": json.dumps({**ok, "unknown_param": 1})}))
        cases.append((path, {"content": json.dumps({**ok, "max_tokens": 9000})}))  # past context
    long_prompt = {**ok_c, "prompt": "hello " * 9000}  # prompt alone past the 8192 context
    cases.append((C, {"content": json.dumps(long_prompt)}))
    for prompt in ([], [-1], [49152], [1.5], [[1, 2], [3]], ["a", "b"], 7, {"t": 1}, [True]):
        cases.append((C, {"content": json.dumps({**ok_c, "prompt": prompt})}))
    for messages in ([], "hi", [1], [{"role": "user"}], [{"content": "x"}],
                     [{"role": "user", "content": None}], [{"role": 3, "content": "x"}],
                     [{"role": "tool", "content": "x"}], [{"role": "user", "content": [1]}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
                     [{"role": "user", "content": "x", "extra": 1}],
                     [{"role": "user", "content": "x", "name": 5}], {"role": "user"}):
        cases.append((H, {"content": json.dumps({**ok_h, "messages": messages})}))
    cases.append((H, {"content": json.dumps({**ok_h, "max_completion_tokens": 2})}))  # both
    cases.append(("/v1/nothing", {"json": ok_c}))
    return cases


VALID = {"temperature": [0, 1.5], "seed": [0], "stop": ["x", []], "stream": [True],
         "top_k": [-1], "ignore_eos": [True]}


def _acceptable(field, v) -> bool:
    """Values of `bad_values` that are valid for this field (left out of the corpus)."""
    if v is None:
        return field != "model"
    return any(type(v) is type(w) and v == w for w in VALID.get(field, []))


def test_malformed_requests_get_4xx_with_the_error_body_and_health_stays_fine(server):
    url = server[0].url
    corpus = malformed_corpus()
    assert len(corpus) >= 200
    for path, kw in corpus:
        kw = dict(kw)
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        if "json" in kw:
            r = httpx.post(url + path, json=kw["json"], headers=headers, timeout=60)
        else:
            r = httpx.post(url + path, content=kw["content"], headers=headers, timeout=60)
        assert 400 <= r.status_code < 500, (path, kw, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert "Traceback" not in r.text
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    assert wait_idle(url)["minillm:num_requests_running"] == 0


def test_fifty_streams_cut_mid_way_free_everything(server):
    srv, engine = server
    url = srv.url
    before = metrics(url)["minillm:request_abort_total"]

    def cut(i):
        body = {"model": MODEL, "prompt": f"Count slowly from {i}:", "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen >= 2 + i % 3:
                    return True  # leaving the block closes the connection mid-stream
        return False
    with ThreadPoolExecutor(10) as pool:
        assert all(pool.map(cut, range(50)))
    m = wait_idle(url, timeout_s=2.0)
    assert m["minillm:num_requests_running"] == 0
    assert m["minillm:num_requests_waiting"] == 0
    assert m["minillm:kv_cache_usage_perc"] == 0
    assert m["minillm:request_abort_total"] - before == 50
    assert_no_leaked_blocks(engine)


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    srv, engine = server
    url = srv.url
    before = metrics(url)["minillm:request_abort_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Go on:",
                                                  "max_tokens": 2000, "ignore_eos": True},
                   timeout=httpx.Timeout(60, read=1.0))
    m = wait_idle(url, timeout_s=2.0)
    assert m["minillm:request_abort_total"] - before == 1
    assert m["minillm:num_requests_running"] == 0 and m["minillm:kv_cache_usage_perc"] == 0
    assert_no_leaked_blocks(engine)


def test_async_scheduling_serves_alike(smollm):
    """The worker drives an async-scheduling engine (the CUDA default; forced here) through
    the same `step()`: greedy chat equals generate, cut streams free everything."""
    srv, engine = start_server(smollm, {"async_scheduling": True}, max_num_seqs=8,
                               num_blocks=256, max_queue_len=64)
    try:
        assert engine.config.async_scheduling is True
        test_greedy_chat_equals_generate_token_for_token((srv, engine), smollm)
        test_fifty_streams_cut_mid_way_free_everything((srv, engine))
    finally:
        srv.stop()
