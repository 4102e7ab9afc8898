"""minillm.serve without the model: the detokenizer on random byte splits, the SSE parser,
the Prometheus parser, the request checks, ServeConfig and the load generator's guards."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from minillm.serve import APIError, ServeConfig, loadgen, sse
from minillm.serve.detok import IncrementalDetokenizer
from minillm.serve.metrics import ServerMetrics, parse_prometheus
from minillm.serve.protocol import parse_json_body, parse_request

ALPHABET = "ab c,\n" + "éß€漢字🙂👍🏽" + "\u0301"


def random_token_table(rng: random.Random, text: str):
    """Split text's UTF-8 bytes at random points (often inside a character): the pieces
    are the 'tokens', ids 0..k-1 in order."""
    data = text.encode()
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 40))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    return pieces, list(range(len(pieces)))


@pytest.mark.parametrize("seed", range(30))
def test_detok_pieces_join_to_the_text_and_never_show_a_half_character(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))
    table, ids = random_token_table(rng, text)
    detok = IncrementalDetokenizer(table)
    pieces = []
    i = 0
    while i < len(ids):  # push 1-3 tokens at a time
        k = rng.randint(1, 3)
        pieces.append(detok.push(ids[i:i + k]))
        i += k
    pieces.append(detok.flush())
    assert "".join(pieces) == text == detok.text
    assert not any("\ufffd" in p for p in pieces)


def test_detok_invalid_bytes_match_the_full_decode():
    table = [b"a\xf0\x9f", b"\x99", b"b", b"\xff", b"\xe2\x82"]  # the last is cut off
    detok = IncrementalDetokenizer(table)
    streamed = "".join(detok.push([t]) for t in range(5)) + detok.flush()
    assert streamed == b"".join(table).decode("utf-8", "replace")


@pytest.mark.parametrize("seed", range(20))
def test_detok_stop_strings_cut_before_the_stop_and_hide_it(seed):
    rng = random.Random(100 + seed)
    text = "".join(rng.choice("abc d🙂") for _ in range(80))
    start = rng.randrange(len(text) - 4)
    stop = text[start:start + rng.randint(1, 4)]
    other = "zzz"  # never occurs
    table, ids = random_token_table(rng, text)
    detok = IncrementalDetokenizer(table, [other, stop])
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    expected = text[:text.find(stop)]
    assert "".join(pieces) == expected == detok.text
    assert detok.stopped
    assert detok.push([0]) == ""  # nothing after the stop


def test_sse_roundtrip_comments_multiline_and_bytes():
    events = [{"a": 1, "text": "x\ny"}, {"b": "é"}, "[DONE]"]
    wire = b"".join(sse.format_event(e) for e in events)
    wire = b": keep-alive\n\n" + wire
    assert list(sse.iter_events(wire.splitlines(keepends=True))) == events
    assert list(sse.iter_events(wire.decode().split("\n"))) == events
    multi = ["event: message", "data: {\"k\":", "data: 2}", "id: 7", "", "data: [DONE]"]
    assert list(sse.iter_events(multi)) == [{"k": 2}, "[DONE]"]


def test_parse_prometheus_reads_what_the_server_writes():
    m = ServerMetrics()
    for x in (0.012, 0.3, 3.0):
        m.ttft.observe(x)
    m.success.labels(finished_reason="length").inc(5)
    m.prompt_tokens.inc(42)
    parsed = parse_prometheus(m.render().decode())
    assert parsed["minillm:time_to_first_token_seconds_count"] == 3
    assert parsed["minillm:time_to_first_token_seconds_sum"] == pytest.approx(3.312)
    assert parsed['minillm:time_to_first_token_seconds_bucket{le="0.02"}'] == 1
    assert parsed['minillm:request_success_total{finished_reason="length"}'] == 5
    assert parsed['minillm:request_success_total{finished_reason="stop"}'] == 0
    assert parsed["minillm:prompt_tokens_total"] == 42
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        parse_prometheus("this is not { metrics")


class FakeTokenizer:
    """Characters as tokens: enough for the request checks."""
    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))


def parse(kind, body):
    return parse_request(kind, body, FakeTokenizer(), "m", 64, 100, 8, 4)


def test_parse_request_defaults_and_values():
    r = parse("completion", {"model": "m", "prompt": "hello"})
    assert r.prompt_ids == FakeTokenizer().encode("hello")
    assert (r.params.max_tokens, r.params.temperature, r.params.top_p, r.params.n) == (16, 1.0, None, 1)
    r = parse("completion", {"model": "m", "prompt": [5, 6], "max_tokens": 3, "temperature": 0,
                             "top_p": 0.5, "seed": 7, "n": 2, "stop": ["x", "y"],
                             "stream": True, "stream_options": {"include_usage": True}})
    assert (r.prompt_ids, r.params.max_tokens, r.params.top_p, r.params.seed) == ([5, 6], 3, 0.5, 7)
    assert r.stop == ("x", "y") and r.stream and r.include_usage and r.params.n == 2
    r = parse("chat", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]})
    assert r.params.max_tokens == 8 and r.prompt_ids == FakeTokenizer().encode("<user>hi")


@pytest.mark.parametrize("kind,body,status,param", [
    ("completion", {"prompt": "x"}, 400, "model"),
    ("completion", {"model": "other", "prompt": "x"}, 404, "model"),
    ("completion", {"model": "m"}, 400, "prompt"),
    ("completion", {"model": "m", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completion", {"model": "m", "prompt": "x", "max_tokens": 64}, 400, "max_tokens"),
    ("completion", {"model": "m", "prompt": "x" * 64}, 400, "prompt"),
    ("completion", {"model": "m", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completion", {"model": "m", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completion", {"model": "m", "prompt": "x", "n": 5}, 400, "n"),
    ("completion", {"model": "m", "prompt": "x", "seed": -1}, 400, "seed"),
    ("completion", {"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completion", {"model": "m", "prompt": "x", "stream_options": {}}, 400, "stream_options"),
    ("completion", {"model": "m", "prompt": "x", "bogus": 1}, 400, "bogus"),
    ("completion", {"model": "m", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("completion", {"model": "m", "prompt": [1, 200]}, 400, "prompt"),
    ("chat", {"model": "m", "messages": []}, 400, "messages"),
    ("chat", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
])
def test_parse_request_rejects_with_the_parameter_named(kind, body, status, param):
    with pytest.raises(APIError) as e:
        parse(kind, body)
    assert e.value.status == status and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", [b"{", b"[1]", b"\xff{}", b'{"a": NaN}', b'{"a": Infinity}', b""])
def test_parse_json_body_rejects(raw):
    with pytest.raises(APIError) as e:
        parse_json_body(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"


def test_serve_config_checks():
    assert ServeConfig().host == "127.0.0.1"
    # The token budget is the engine's by default (512 on a CPU, 8192 on CUDA).
    assert ServeConfig().engine_options()["max_num_batched_tokens"] is None
    assert "--max-num-batched-tokens" not in ServeConfig().cli_args()
    assert ServeConfig(max_num_batched_tokens=96).engine_options()["max_num_batched_tokens"] == 96
    for bad in ({"max_queue_len": 0}, {"port": 70000}, {"drain_timeout_s": math.nan},
                {"num_blocks": -1}, {"max_num_seqs": True}, {"max_num_batched_tokens": 0}):
        with pytest.raises(ValueError, match=f"ServeConfig.{next(iter(bad))}"):
            ServeConfig(**bad)


def test_loadgen_refuses_non_loopback_targets():
    for url in ("http://example.com:8000", "http://10.0.0.1", "http://8.8.8.8:80", "ftp://127.0.0.1"):
        with pytest.raises(ValueError):
            loadgen.run_load(url, 1.0, 1.0)
    for url in ("http://127.0.0.1:1/", "http://localhost:1", "http://[::1]:1"):
        assert loadgen.check_loopback(url) == url.rstrip("/")


def test_load_result_percentiles_are_nearest_rank():
    rng = np.random.default_rng(3)
    xs = rng.exponential(0.2, 501).tolist()
    r = loadgen.LoadResult(rate=1.0, duration_s=1.0, e2e_s=xs)
    for p in (50, 95, 99):
        assert r.percentile("e2e", p) == float(np.percentile(xs, p, method="inverted_cdf"))
    assert math.isnan(r.percentile("ttft", 50))
    json.dumps(r.to_dict())  # serialisable
    with pytest.raises(ValueError):
        r.percentile("latency", 50)


def test_loadgen_command_refuses_a_remote_url_and_needs_a_rate(capsys):
    from minillm.__main__ import main
    assert main(["loadgen", "--url", "http://example.com:8000", "--rate", "1",
                 "--duration", "1"]) == 2
    assert "only targets loopback" in capsys.readouterr().err
    assert main(["loadgen", "--url", "http://127.0.0.1:9", "--duration", "1"]) == 2
