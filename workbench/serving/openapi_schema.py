"""The OpenAPI 3 document of the endpoint's generation routes, served at ``/openapi.json``.

Written by hand rather than generated, because the routes read raw bodies (``openai_api.py``
checks them, so every refusal is OpenAI's error shape and names the parameter): FastAPI would
describe them as taking anything. The document states what ``openai_api.py`` accepts (the
limits included: at most 4 stop strings of at most 256 characters, a seed in a signed 64-bit
range), so a property-based fuzzer (schemathesis, ``tests/workbench/serving/test_schema_fuzz.py``)
can generate requests from it and check that none is answered with a 5xx.
"""

from __future__ import annotations

from typing import Any

from workbench.serving.openai_api import MAX_SPECULATE, MAX_STOP_CHARS, MAX_STOPS, SEED_MAX


def _common() -> dict[str, Any]:
    text = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                  "nullable": True},
        "top_k": {"type": "integer", "minimum": 0, "nullable": True},
        "seed": {"type": "integer", "minimum": 0, "maximum": SEED_MAX, "nullable": True},
        "stop": {"nullable": True, "oneOf": [text, {"type": "array", "items": text,
                                                    "maxItems": MAX_STOPS}]},
        "stream": {"type": "boolean"},
        "ignore_eos": {"type": "boolean"},  # as vLLM: generate max_tokens whatever comes
        # ours: draft tokens per step of prompt-lookup speculative decoding, 0 off
        "speculate": {"type": "integer", "minimum": 0, "maximum": MAX_SPECULATE,
                      "nullable": True},
        "stream_options": {"type": "object", "additionalProperties": False, "nullable": True,
                           "properties": {"include_usage": {"type": "boolean"}}},
        "n": {"type": "integer", "enum": [1], "nullable": True},
        "user": {"type": "string"},
        # ours (OpenAI has none): seconds before the request is aborted with a 504, at most
        # the endpoint's --request-timeout
        "timeout": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                    "nullable": True},
    }


def _message() -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ["text"]},
                           "text": {"type": "string"}}}
    return {"type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {
                "role": {"type": "string",
                         "enum": ["system", "developer", "user", "assistant"]},
                "content": {"oneOf": [{"type": "string"},
                                      {"type": "array", "items": part, "minItems": 1}]},
                "name": {"type": "string"}}}


def _operation(body: dict[str, Any], summary: str) -> dict[str, Any]:
    error = {"description": "an OpenAI-style error: {error: {message, type, param, code}}"}
    return {"summary": summary, "security": [{"bearer": []}],
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "the completion (server-sent events when "
                                                  "stream is true)"},
                          **{str(s): error for s in (400, 401, 404, 413, 429, 503, 504)}}}


def openapi() -> dict[str, Any]:
    """The document (a fresh dict: callers may narrow it, as the fuzz test does)."""
    completion = {"type": "object", "required": ["prompt"], "additionalProperties": False,
                  "properties": {**_common(), "echo": {"type": "boolean", "enum": [False]},
                                 "prompt": {"oneOf": [
                                     {"type": "string", "minLength": 1},
                                     {"type": "array", "minItems": 1,
                                      "items": {"type": "integer", "minimum": 0}}]}}}
    chat = {"type": "object", "required": ["messages"], "additionalProperties": False,
            "properties": {**_common(),
                           "max_completion_tokens": {"type": "integer", "minimum": 1,
                                                     "nullable": True},
                           "messages": {"type": "array", "minItems": 1,
                                        "items": _message()}}}
    return {"openapi": "3.0.3",
            "info": {"title": "colossal-workbench OpenAI-compatible endpoint", "version": "1"},
            "components": {"securitySchemes": {"bearer": {"type": "http",
                                                          "scheme": "bearer"}}},
            "paths": {"/v1/completions": {"post": _operation(completion, "a completion")},
                      "/v1/chat/completions": {"post": _operation(chat,
                                                                  "a chat completion")}}}
