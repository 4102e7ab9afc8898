"""The HTTP layer: OpenAI-compatible routes over an `AsyncEngine`, built by `create_app`.

    POST /v1/completions, /v1/chat/completions   OpenAI shapes; `stream: true` -> SSE
    GET  /v1/models                               the one model served
    GET  /health                                  a one-token generation, with a timeout
    GET  /health/live                             liveness: the engine loop runs, no step stalled
    GET  /health/ready                            readiness: warmed up, live, not draining
    GET  /metrics                                 Prometheus text (`minillm.serve.metrics`)

The two probes answer at once from the engine's state (200, or 503 with the reason): a
Kubernetes liveness probe must not queue behind the load, or a busy replica gets restarted
(`minillm.serve.k8s` writes the probe config).

The routes check the request (`protocol`), submit it, and turn the stream of `Delta`s into
a JSON body or SSE chunks. A client that goes away (streamed or not) has its request
aborted. Every error is the OpenAI error body (`errors`); an unexpected exception is
logged here and answered 500 without a traceback.

Chunk rules (streaming): every chunk carries the response's `id`; for chat the first
chunk of each choice carries `delta.role = "assistant"`; each choice has exactly one
chunk with a `finish_reason`; with `stream_options.include_usage` every chunk carries
`"usage": null` and one last chunk has empty `choices` and the usage; then `data: [DONE]`.

SSE buffering: a choice's first token goes out in its own event (TTFT is not delayed); after
it, its text is held until `tokens_per_event` tokens (the request's
`stream_options.tokens_per_event`, else `ServeConfig.stream_tokens_per_event`) have
accumulated, and whatever is held goes out with the choice's end. Fewer events cost the
server less per token; the text, joined, is the same whatever the buffering.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.request import SamplingParams
from .async_engine import AsyncEngine, RequestStream
from .config import MAX_BODY_BYTES, ServeConfig
from .errors import APIError, internal_error
from .metrics import ServerMetrics
from .protocol import GenerationRequest, parse_json_body, parse_request
from .sse import DONE, format_event

log = logging.getLogger("minillm.serve")


def create_app(engine, tokenizer, config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig()
    metrics = ServerMetrics()
    aengine = AsyncEngine(engine, tokenizer, config, metrics)
    health_prompt = tokenizer.encode("Hello")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        aengine.warm_up(health_prompt)
        yield
        await aengine.stop()

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.config, app.state.metrics = aengine, config, metrics

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return await api_error(request, APIError(exc.status_code, f"{request.method} "
                                                 f"{request.url.path}: {exc.detail}",
                                                 code=code))

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return await api_error(request, internal_error())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": 0, "owned_by": "minillm",
            "max_model_len": engine.config.max_model_len}]}

    @app.get("/health")
    async def health():
        stream = aengine.submit(health_prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                count_metrics=False, shed=False)
        async def probe():
            async for delta in stream.deltas():
                if delta.error is not None:
                    raise delta.error
                if delta.finish_reason == "abort":
                    raise APIError(503, "the health probe was aborted (draining)",
                                   "service_unavailable_error", None, "draining")
        try:
            await asyncio.wait_for(probe(), config.health_timeout_s)
        except asyncio.TimeoutError:
            aengine.abort(stream.request_id)
            raise APIError(503, f"the one-token health probe did not finish within "
                           f"{config.health_timeout_s} s", "service_unavailable_error",
                           None, "health_timeout") from None
        return {"status": "ok", "num_requests_running": aengine.snapshot["num_running"],
                "num_requests_waiting": aengine.snapshot["num_waiting"]}

    @app.get("/health/live")
    async def live():
        problem = aengine.liveness_problem()
        if problem is not None:
            raise APIError(503, problem, "service_unavailable_error", None, "not_live")
        return {"status": "live"}

    @app.get("/health/ready")
    async def ready():
        problem = aengine.readiness_problem()
        if problem is not None:
            raise APIError(503, problem, "service_unavailable_error", None, "not_ready")
        return {"status": "ready", "num_requests_running": aengine.snapshot["num_running"],
                "num_requests_waiting": aengine.snapshot["num_waiting"]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, "chat")

    async def _generate(request: Request, kind: str):
        arrival = time.perf_counter()
        body = parse_json_body(await read_body(request))
        req = parse_request(kind, body, tokenizer, config.model_name,
                            engine.config.max_model_len, engine.model.config.vocab_size,
                            config.default_max_tokens, config.max_n)
        stream = aengine.submit(req.prompt_ids, req.params, req.stop, arrival_time=arrival)
        shape = _Shape(kind, req, config.model_name)
        if req.stream:
            return StreamingResponse(_sse(stream, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect_or_abort(request, stream, shape)

    async def _collect_or_abort(request: Request, stream: RequestStream, shape: "_Shape"):
        collect = asyncio.ensure_future(_collect(stream, shape))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or we were cancelled)
                collect.cancel()
                aengine.abort(stream.request_id)
        if not collect.done():
            return Response(status_code=499)  # nobody is listening
        return collect.result()

    async def _sse(stream: RequestStream, shape: "_Shape"):
        per_event = shape.req.tokens_per_event or config.stream_tokens_per_event
        held = [_Held() for _ in range(stream.params.n)]
        try:
            if shape.kind == "chat":
                for i in range(stream.params.n):
                    yield format_event(shape.chunk(i, {"role": "assistant", "content": ""}))
            async for d in stream.deltas():
                if d.error is not None or d.finish_reason == "abort":
                    error = d.error or _aborted()
                    yield format_event(error.body())
                    break
                h = held[d.index]
                h.add(d.text, d.token_ids)
                due = len(h.token_ids) >= (per_event if h.sent_any else 1)
                if (due or d.finish_reason is not None) and h.has_content(shape.req.return_token_ids):
                    yield format_event(shape.chunk(d.index, h.text, h.token_ids))
                    h.sent()
                if d.finish_reason is not None:
                    yield format_event(shape.chunk(d.index, None, None, d.finish_reason))
            else:
                if shape.req.include_usage:
                    yield format_event(shape.usage_chunk(stream))
            yield format_event(DONE)
        finally:  # client gone (cancelled) or done: an unfinished request is aborted
            if not stream.finished:
                aengine.abort(stream.request_id)

    return app


class _Held:
    """The text and tokens of one choice not yet sent (SSE buffering)."""

    def __init__(self):
        self.text, self.token_ids, self.sent_any = "", [], False

    def add(self, text: str, token_ids: list[int]) -> None:
        self.text += text
        self.token_ids += token_ids

    def has_content(self, with_ids: bool) -> bool:
        return bool(self.text or (with_ids and self.token_ids))

    def sent(self) -> None:
        self.text, self.token_ids, self.sent_any = "", [], True


class _Shape:
    """Builds the response objects of one request (the same id and created throughout)."""

    def __init__(self, kind: str, req: GenerationRequest, model: str):
        self.kind, self.req, self.model = kind, req, model
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, usage) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None or self.req.include_usage or not self.req.stream:
            out["usage"] = usage
        return out

    def chunk(self, index: int, content, token_ids=None, finish_reason=None) -> dict:
        if self.kind == "chat":
            delta = content if isinstance(content, dict) else (
                {} if content is None else {"content": content})
            choice = {"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": content or "", "logprobs": None,
                      "finish_reason": finish_reason}
            obj = "text_completion"
        if self.req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return self._envelope(obj, [choice], None)

    def usage_chunk(self, stream: RequestStream) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], _usage(stream))

    def full(self, stream: RequestStream, texts: list[str], ids: list[list[int]]) -> dict:
        choices = []
        for i, s in enumerate(stream.samples):
            if self.kind == "chat":
                choice = {"index": i, "message": {"role": "assistant", "content": texts[i]},
                          "logprobs": None, "finish_reason": s.finish_reason}
            else:
                choice = {"index": i, "text": texts[i], "logprobs": None,
                          "finish_reason": s.finish_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = ids[i]
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices, _usage(stream))


async def _collect(stream: RequestStream, shape: _Shape) -> dict:
    n = stream.params.n
    texts, ids = [""] * n, [[] for _ in range(n)]
    async for d in stream.deltas():
        if d.error is not None:
            raise d.error
        if d.finish_reason == "abort":
            raise _aborted()
        texts[d.index] += d.text
        ids[d.index] += d.token_ids
    for i, s in enumerate(stream.samples):  # tokens past a stop string are not returned
        del ids[i][s.num_tokens:]
    return shape.full(stream, texts, ids)


def _usage(stream: RequestStream) -> dict:
    prompt, completion = len(stream.prompt_ids), stream.num_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _aborted() -> APIError:
    return APIError(503, "the request was aborted: the server is shutting down",
                    "service_unavailable_error", None, "aborted")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request) -> bytes:
    """The raw body, after checking the content type and the 1 MiB limit (413 as soon as
    the limit is passed, without reading the rest)."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"the content type must be application/json, got "
                       f"{ctype or 'none'}", param=None, code="unsupported_media_type")
    too_big = APIError(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes "
                       f"(1 MiB)", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)
