"""The OpenAI request shapes, checked strictly: JSON body -> `GenerationRequest`.

Every parameter is checked for type and range, and anything else raises `APIError` (4xx)
naming the parameter and what is allowed. Unknown parameters are rejected, as are OpenAI
parameters this server does not implement when they ask for something other than their
no-op default (e.g. `logprobs`, `presence_penalty != 0`): silently ignoring them would hand
back an answer to a different question.

Defaults follow OpenAI: temperature 1, top_p 1, n 1; max_tokens 16 for completions and
`ServeConfig.default_max_tokens` (capped by the context) for chat. Extensions (vLLM's
names): `ignore_eos`, `top_k`, and `return_token_ids` (each choice then carries its
generated `token_ids`); and one stream option of this server's own,
`stream_options.tokens_per_event` (SSE buffering: after the first token, each event carries
up to this many tokens; default `ServeConfig.stream_tokens_per_event`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..engine.request import SamplingParams
from .errors import APIError, invalid

MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1
ROLES = ("system", "user", "assistant")

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
           "stream_options", "user", "presence_penalty", "frequency_penalty", "logit_bias",
           "logprobs", "ignore_eos", "top_k", "return_token_ids"}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
# Accepted only at their no-op value (None is always fine).
_NOOP = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "logprobs": False,
         "echo": False, "suffix": None, "top_logprobs": 0}


@dataclass(frozen=True)
class GenerationRequest:
    kind: str                       # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams          # n, seed, max_tokens, temperature, top_p, top_k, ignore_eos
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tokens_per_event: int | None = None  # SSE buffering; None: the server's default


def parse_json_body(body: bytes) -> dict:
    """Strict JSON: UTF-8 only, no NaN/Infinity, an object at the top."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8 ({exc.reason} at byte "
                      f"{exc.start}); send UTF-8 encoded JSON", code="invalid_json") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, got {type(data).__name__}",
                      code="invalid_json")
    return data


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def parse_request(kind: str, body: dict, tokenizer, model_name: str, max_model_len: int,
                  vocab_size: int, default_max_tokens: int, max_n: int) -> GenerationRequest:
    allowed = COMPLETION_PARAMS if kind == "completion" else CHAT_PARAMS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"unknown parameter {unknown[0]!r}; this endpoint accepts "
                      f"{sorted(allowed)}", unknown[0], "unknown_parameter")
    for name, noop in _NOOP.items():
        if body.get(name) is not None and body[name] != noop:
            raise invalid(f"{name}={body[name]!r} is not supported by this server; omit it "
                          f"or pass {noop!r}", name, "unsupported_parameter")
    model = _required(body, "model")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{model_name!r} (see GET /v1/models)", "invalid_request_error",
                       "model", "model_not_found")

    if kind == "completion":
        prompt_ids = _completion_prompt(_required(body, "prompt"), tokenizer, vocab_size)
        default_max = 16
    else:
        prompt_ids = tokenizer.apply_chat_template(_messages(_required(body, "messages")))
        default_max = default_max_tokens
        if body.get("max_completion_tokens") is not None:
            if body.get("max_tokens") is not None:
                raise invalid("pass max_tokens or max_completion_tokens, not both",
                              "max_completion_tokens")
            body = {**body, "max_tokens": body["max_completion_tokens"]}
    if not prompt_ids:
        raise invalid("the prompt is empty: give at least one token", _prompt_param(kind))
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise invalid(f"the prompt has {len(prompt_ids)} tokens but the context length is "
                      f"{max_model_len}: it leaves no room for a single new token; shorten "
                      f"it", _prompt_param(kind), "context_length_exceeded")
    max_tokens = _int(body, "max_tokens", None, 1, None)
    if max_tokens is None:
        max_tokens = min(default_max, room)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise invalid(f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} exceeds "
                      f"the context length of {max_model_len}; ask for at most {room} tokens",
                      "max_tokens", "context_length_exceeded")
    n = _int(body, "n", 1, 1, max_n)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise invalid(f"best_of must equal n ({n}) or be omitted", "best_of", "unsupported_parameter")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True)
    top_k = _int(body, "top_k", None, 1, vocab_size)
    if top_k == -1:
        top_k = None
    seed = _int(body, "seed", None, 0, MAX_SEED)
    stream = _bool(body, "stream", False)
    include_usage, tokens_per_event = _stream_options(body.get("stream_options"), stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _type_error("user", "a string", user)
    try:  # everything is checked above; SamplingParams checks again, as a 400 too
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=None if top_p == 1.0 else top_p, top_k=top_k, seed=seed,
                                ignore_eos=_bool(body, "ignore_eos", False), n=n)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    return GenerationRequest(kind, prompt_ids, params, _stop(body.get("stop")), stream,
                             include_usage, _bool(body, "return_token_ids", False),
                             tokens_per_event)


def _prompt_param(kind: str) -> str:
    return "prompt" if kind == "completion" else "messages"


def _required(body: dict, name: str):
    if body.get(name) is None:
        raise invalid(f"the parameter {name!r} is required", name, "missing_required_parameter")
    return body[name]


def _type_error(name: str, expected: str, value) -> APIError:
    shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
    return invalid(f"{name} must be {expected}, got {type(value).__name__} {shown}", name,
                   "invalid_type")


def _int(body: dict, name: str, default, lo: int, hi: int | None):
    value = body.get(name)
    if value is None:
        return default
    if name == "top_k" and value == -1 and not isinstance(value, bool):
        return -1  # vLLM's "no top-k"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if value < lo or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise invalid(f"{name} must be an integer {rng}, got {value}", name, "out_of_range")
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, "a number", value)
    if not math.isfinite(value) or value > hi or value < lo or (open_low and value == lo):
        rng = f"({lo}, {hi}]" if open_low else f"[{lo}, {hi}]"
        raise invalid(f"{name} must be a number in {rng}, got {value}", name, "out_of_range")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "true or false", value)
    return value


MAX_TOKENS_PER_EVENT = 64


def _stream_options(options, stream: bool) -> tuple[bool, int | None]:
    """(include_usage, tokens_per_event or None)."""
    if options is None:
        return False, None
    if not stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise _type_error("stream_options", 'an object like {"include_usage": true}', options)
    extra = sorted(set(options) - {"include_usage", "tokens_per_event"})
    if extra:
        raise invalid(f"unknown stream option {extra[0]!r}; the options are 'include_usage' "
                      f"and 'tokens_per_event'", "stream_options", "unknown_parameter")
    return (_bool(options, "include_usage", False),
            _int(options, "tokens_per_event", None, 1, MAX_TOKENS_PER_EVENT))


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or a list of up to 4 strings", stop)
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise invalid(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings, got "
                      f"{len(stops)} (empty ones: {sum(not s for s in stops)})", "stop",
                      "out_of_range")
    return tuple(stops)


def _completion_prompt(prompt, tokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise invalid(f"prompt token ids must lie in [0, {vocab_size}), got {bad[:5]}",
                          "prompt", "out_of_range")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("batched prompts are not supported: send one prompt per request",
                      "prompt", "unsupported_parameter")
    raise _type_error("prompt", "a string or a non-empty list of token ids", prompt)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of {role, content} objects", messages)
    if not messages:
        raise invalid("messages is empty: give at least one message", "messages")
    out = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _type_error(param, "an object with 'role' and 'content'", msg)
        extra = sorted(set(msg) - {"role", "content", "name"})
        if extra:
            raise invalid(f"{param} has unknown field {extra[0]!r}; a message has role, "
                          f"content and optionally name", param, "unknown_parameter")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"{param}.role must be one of {list(ROLES)}, got {role!r}",
                          f"{param}.role", "invalid_value")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise _type_error(f"{param}.name", "a string", msg["name"])
        out.append({"role": role, "content": _content(content, f"{param}.content")})
    return out


def _content(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in content):
        return "".join(p["text"] for p in content)
    raise _type_error(param, 'a string or a list of {"type": "text", "text": ...} parts',
                      content)
