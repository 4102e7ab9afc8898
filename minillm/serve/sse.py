"""Server-sent events, both ways: `format_event` writes one, `iter_events` reads a stream.

The wire format (the WHATWG EventSource spec, as OpenAI streams use it): an event is one or
more `data: ...` lines ended by a blank line; lines starting with `:` are comments (keep-
alives); the payload of a multi-line event is its data lines joined with "\\n". OpenAI
payloads are JSON objects, and the stream ends with the literal `data: [DONE]`.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

DONE = "[DONE]"


def format_event(payload: dict | str) -> bytes:
    """One SSE event: a dict is sent as compact JSON, a str (e.g. "[DONE]") as is."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"),
                                                               ensure_ascii=False)
    return b"".join(b"data: " + line.encode() + b"\n" for line in data.split("\n")) + b"\n"


def iter_events(lines: Iterable[str | bytes]) -> Iterator[dict | str]:
    """Parse SSE lines (with or without their line endings; str or bytes) into payloads:
    each event's data parsed as JSON, and "[DONE]" as the string "[DONE]". Comments,
    blank keep-alives and non-data fields (event:, id:, retry:) are skipped. A final event
    without its blank line is still yielded."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        for part in line.splitlines() or [""]:
            if part == "":
                if data:
                    yield _payload(data)
                    data = []
            elif part.startswith(":"):
                continue
            else:
                field, _, value = part.partition(":")
                if field == "data":
                    data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield _payload(data)


def _payload(data: list[str]) -> dict | str:
    text = "\n".join(data)
    return DONE if text == DONE else json.loads(text)
