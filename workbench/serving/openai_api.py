"""The OpenAI HTTP API's request bodies, checked, and its response bodies, built.

Every body field is either implemented or refused: a parameter we do not implement (``n`` > 1,
``logprobs``, ``tools``, ...) is a 400 naming it, never silently ignored, because a client that
asked for it would otherwise trust an answer computed without it. Errors are OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

COMMON = {"model", "max_tokens", "temperature", "top_p", "stream", "stop", "seed", "n", "user",
          "stream_options", "top_k", "ignore_eos", "speculate"}
# top_k, ignore_eos: vLLM's extras; speculate (ours): draft tokens per step of prompt-lookup
# speculative decoding (kernels_runtime/inference/speculation.py), 0 off
COMPLETION = COMMON | {"prompt", "echo"}
CHAT = COMMON | {"messages", "max_completion_tokens"}
# accepted only at the value that means "off": anything else changes the answer
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": (None, False),
           "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
           "logit_bias": (None, {}), "suffix": (None,), "tools": (None, []),
           "tool_choice": (None, "none"), "functions": (None,), "parallel_tool_calls": (None,),
           "response_format": (None, {"type": "text"}), "n": (None, 1)}
DEFAULT_MAX_TOKENS = 16
# OpenAI's own limits: up to 4 stop sequences; a length cap keeps the per-token check cheap
MAX_STOPS, MAX_STOP_CHARS = 4, 256
SEED_MAX = 2**63 - 1  # a signed 64-bit integer, as OpenAI's schema and vLLM take it
MAX_SPECULATE = 16  # draft tokens per step: past a few, rejected drafts only cost compute


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _neutral(name: str, value: Any) -> bool:
    allowed = NEUTRAL[name]
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    return any(value == a for a in allowed)


def _number(body: dict, name: str, low: float, high: float, default: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ApiError(400, f"{name} must be a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        side = "(" if low_open else "["
        raise ApiError(400, f"{name} must be in {side}{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, default: int | None,
             high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        within = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"{name} must be an integer {within}, got {_short(value)}", name)
    return value


def _short(value: Any, limit: int = 80) -> str:
    """A value for an error message, cut: a hostile body can make ``repr`` huge."""
    text = repr(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _stop(body: dict) -> list[str] | str:
    """The checked ``stop``: every stop string is searched for at every generated token, so
    their number and length are bounded (OpenAI takes up to 4)."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a string or a list of non-empty strings, got "
                            f"{_short(stop)}", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    long = [len(s) for s in stops if len(s) > MAX_STOP_CHARS]
    if long:
        raise ApiError(400, f"each stop string must be at most {MAX_STOP_CHARS} characters, "
                            f"got one of {long[0]}", "stop")
    return stop


def sampling(body: dict, kind: str, allowed: set[str]) -> dict[str, Any]:
    """The engine's ``SamplingParams`` fields for a completion or chat body (checked)."""
    unknown = sorted(k for k in body if k not in allowed and k not in NEUTRAL)
    if unknown:
        raise ApiError(400, f"unknown parameter(s): {', '.join(unknown)}", unknown[0])
    refused = sorted(k for k in body if k in NEUTRAL and not _neutral(k, body[k]))
    if refused:
        raise ApiError(400, f"not supported by this server: {', '.join(refused)} (only the "
                            "default value is accepted)", refused[0])
    tokens_key = "max_completion_tokens" if kind == "chat" and \
        body.get("max_completion_tokens") is not None else "max_tokens"
    # Too many for the context is the engine's 400 (it knows the prompt's tokens), as vLLM's.
    max_tokens = _integer(body, tokens_key, 1, DEFAULT_MAX_TOKENS)
    stop = _stop(body)
    stream_options = body.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict) or any(
            k != "include_usage" for k in stream_options)):
        raise ApiError(400, "stream_options supports include_usage only", "stream_options")
    for flag in ("stream", "ignore_eos"):
        if not isinstance(body.get(flag, False), bool):
            raise ApiError(400, f"{flag} must be true or false", flag)
    return {"max_new_tokens": max_tokens,
            "temperature": _number(body, "temperature", 0.0, 2.0, 1.0),
            "top_p": _number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
            "top_k": _integer(body, "top_k", 0, 0),
            "seed": _integer(body, "seed", 0, None, SEED_MAX),
            "stop": stop, "ignore_eos": bool(body.get("ignore_eos", False)),
            "speculate": _integer(body, "speculate", 0, 0, MAX_SPECULATE)}


def completion_request(body: Any) -> tuple[Any, dict[str, Any]]:
    """(prompt, sampling fields) of a ``/v1/completions`` body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    params = sampling(body, "completion", COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt, params
    if isinstance(prompt, list) and prompt and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return prompt, params
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "a batch of several prompts is not supported: send one request per "
                            "prompt", "prompt")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")


def chat_request(body: Any) -> tuple[list[dict[str, str]], dict[str, Any]]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    params = sampling(body, "chat", CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                             "developer"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or "
                                "developer", "messages")
        content = m.get("content")
        if isinstance(content, list):  # text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, f"messages[{i}]: only text content is supported",
                               "messages")
            if not all(isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}]: each content part needs a string "
                                    '"text"', "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be text", "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise ApiError(400, f"messages[{i}]: not supported: {', '.join(extra)}", "messages")
        out.append({"role": m["role"], "content": content})
    return out, params


def new_id(kind: str) -> str:
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's names: ``stop`` (a stop string or token), ``length``; an abort is ``stop``."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_body(rid: str, model: str, text: str, reason: str | None,
                    counts: tuple[int, int]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish_reason(reason)}],
            "usage": usage(*counts)}


def chat_body(rid: str, model: str, text: str, reason: str | None,
              counts: tuple[int, int]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": finish_reason(reason),
                                         "message": {"role": "assistant", "content": text},
                                         "logprobs": None}],
            "usage": usage(*counts)}


def completion_chunk(rid: str, model: str, text: str, reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish_reason(reason)}]}


def chat_chunk(rid: str, model: str, delta: dict[str, str],
               reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason(reason)}]}
