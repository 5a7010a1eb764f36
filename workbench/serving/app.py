"""The HTTP routes of a serving endpoint (FastAPI on uvicorn; why in docs/architecture.md).

``/v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent events, token
by token), ``/v1/models``, ``/health`` (503 with the reason when the ranks cannot serve) and
``/metrics`` (Prometheus text). Every route but ``/health`` needs the API key (``Authorization:
Bearer ...``) unless the endpoint was started without one. A response starts only once the
request's first token (or its error) is back, so a request the engine refuses is a 400 with
the engine's message even when streaming was asked for. A client that goes away mid-stream
aborts its request, which frees its KV blocks. A request's ``model`` names the base model or
one of the engine's LoRA adapters (as vLLM's ``--lora-modules``): requests naming different
adapters share the engine's batches; ``/v1/models`` lists each adapter with the base as its
``parent``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kernels_runtime.inference.commands import Command
from workbench.serving import openai_api as api
from workbench.serving.openai_api import ApiError


def create_app(server: Any) -> FastAPI:
    app = FastAPI(title="colossal-workbench", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        route = request.url.path
        server.metrics.requests.labels(route, str(err.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def authorize(request: Request) -> None:
        if server.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not token or not secrets.compare_digest(token, server.api_key):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body() or b"null")
        except ValueError as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}") from None

    def check_model(body: Any) -> str | None:
        """The LoRA adapter the body's ``model`` names (vLLM's ``--lora-modules`` way), None
        for the base model (named, or ``model`` left out)."""
        model = body.get("model") if isinstance(body, dict) else None
        if model is None or model == server.model_id:
            return None
        if model in server.adapters:
            return model
        served = ", ".join(repr(m) for m in [server.model_id, *server.adapters])
        raise ApiError(404, f"the model {model!r} does not exist; this endpoint serves "
                            f"{served}", "model", code="model_not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = server.unavailable()
        if reason:
            return JSONResponse(ApiError(503, reason, kind="unavailable").body(), 503)
        return JSONResponse({"status": "ok", "model": server.model_id,
                             "replicas": server.bridge.connected})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        authorize(request)
        return Response(server.metrics.text(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        server.metrics.requests.labels("/v1/models", "200").inc()
        base = {"id": server.model_id, "object": "model", "created": server.created,
                "owned_by": "colossal-workbench", "root": server.model_id, "parent": None}
        adapters = [{**base, "id": name, "root": name, "parent": server.model_id}
                    for name in server.adapters]  # as vLLM lists its LoRA modules
        return JSONResponse({"object": "list", "data": [base, *adapters]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = await body_of(request)
        prompt, params = api.completion_request(body)
        adapter = check_model(body)
        return await respond(request, "completion", prompt, params, body, adapter)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        body = await body_of(request)
        messages, params = api.chat_request(body)
        adapter = check_model(body)
        return await respond(request, "chat", messages, params, body, adapter)

    async def respond(request: Request, kind: str, prompt: Any, params: dict[str, Any],
                      body: dict[str, Any], adapter: str | None) -> Response:
        reason = server.unavailable()
        if reason:
            raise ApiError(503, reason, kind="unavailable")
        server.active += 1  # until its response ends: what --stop drains
        try:
            response = await answer(request, kind, prompt, params, body, adapter)
        except BaseException:
            server.active -= 1
            raise
        if not isinstance(response, StreamingResponse):
            server.active -= 1
        return response

    async def answer(request: Request, kind: str, prompt: Any, params: dict[str, Any],
                     body: dict[str, Any], adapter: str | None) -> Response:
        route = request.url.path
        rid = api.new_id(kind)
        model = adapter or server.model_id  # the answer names what answered
        queue = server.bridge.submit(Command(kind, rid, prompt, params, adapter))
        first = await queue.get()
        if first.get("error"):
            server.bridge.abort(rid)
            status = 503 if server.unavailable() else 400  # a rank died, or the request
            raise ApiError(status, first["error"], kind="invalid_request_error"
                           if status == 400 else "unavailable")
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            server.metrics.requests.labels(route, "200").inc()
            return StreamingResponse(
                stream(kind, rid, model, first, queue, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        delta, text = first, first.get("text") or ""
        while delta.get("finish_reason") is None:
            delta = await queue.get()
            text += delta.get("text") or ""
        if delta.get("error"):
            raise ApiError(503, delta["error"], kind="unavailable")
        server.metrics.requests.labels(route, "200").inc()
        counts = (delta["prompt_tokens"], delta["completion_tokens"])
        build = api.completion_body if kind == "completion" else api.chat_body
        return JSONResponse(build(rid, model, text, delta["finish_reason"], counts))

    async def stream(kind: str, rid: str, model: str, first: dict[str, Any],
                     queue: asyncio.Queue, include_usage: bool) -> AsyncIterator[bytes]:
        delta, done = first, False
        try:
            if kind == "chat":
                yield _event(api.chat_chunk(rid, model, {"role": "assistant"}, None))
            while True:
                reason = delta.get("finish_reason")
                text = delta.get("text") or ""
                if text or reason is not None:
                    chunk = api.completion_chunk(rid, model, text, reason) \
                        if kind == "completion" else \
                        api.chat_chunk(rid, model, {"content": text} if text else {},
                                       reason)
                    yield _event(chunk)
                if reason is not None:
                    done = True
                    break
                delta = await queue.get()
            if include_usage:
                yield _event({"id": rid, "object": "text_completion" if kind == "completion"
                              else "chat.completion.chunk", "model": model,
                              "choices": [], "usage": api.usage(delta["prompt_tokens"],
                                                                delta["completion_tokens"])})
            yield b"data: [DONE]\n\n"
        finally:
            server.active -= 1
            if not done:  # the client went away (or the server is shutting down)
                server.bridge.abort(rid)
                server.metrics.requests.labels(f"{request_route(kind)}", "499").inc()

    return app


def request_route(kind: str) -> str:
    return "/v1/completions" if kind == "completion" else "/v1/chat/completions"


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
