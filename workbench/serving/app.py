"""The HTTP routes of a serving endpoint (FastAPI on uvicorn; why in docs/inference.md).

``/v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent events, one
per engine step, or one carrying several steps' tokens for a stream that fell behind: ``stream``),
``/v1/models``, ``/health`` (503 with the reason when the ranks cannot serve),
``/metrics`` (Prometheus text) and ``/openapi.json`` (``openapi_schema.py``). Every route but
``/health`` and ``/openapi.json`` needs the API key (``Authorization: Bearer ...``) unless
the endpoint was started without one. A response starts only once the request's first token
(or its error) is back, so a request the engine refuses is a 400 with the engine's message
even when streaming was asked for. A client that goes away mid-stream
aborts its request, which frees its KV blocks. A request's ``model`` names the base model or
one of the engine's LoRA adapters (as vLLM's ``--lora-modules``): requests naming different
adapters share the engine's batches; ``/v1/models`` lists each adapter with the base as its
``parent``.

Hostile clients get a clear 4xx, never a 500 or a stall of the others: a body over
``MAX_BODY`` is a 413 answered from its ``Content-Length`` (or as soon as the bytes read pass
the limit, for a chunked one), never read whole; JSON nested deeper than the parser's
recursion is a 400; more than ``max_inflight`` requests being answered is a 429 with
``Retry-After``; a key that is not even ASCII is a 401 like a wrong one. A non-streaming client
that goes away while its answer is generated aborts its request, as a streaming one does.

Every request has a deadline: the endpoint's ``request_timeout_s`` (``workbench serve
--request-timeout``), or a shorter ``timeout`` (seconds) in its body, a field of ours since
OpenAI's API has none (its clients' ``timeout`` is their own). Past it the request is aborted
on its replica (its KV blocks freed) and answered 504, or, once streaming, its stream ends with
an error event. A request the ranks could not take (the bridge's queue full, a replica's
leader busy or gone) is a 503, with ``Retry-After`` where retrying soon can work; one whose
replica's engine step failed is a 500 naming the cause.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kernels_runtime.inference.commands import Command
from workbench.serving import openai_api as api
from workbench.serving import openapi_schema
from workbench.serving.bridge import Unavailable
from workbench.serving.openai_api import ApiError
from workbench.serving.sse import EventStream, event_template

MAX_BODY = 8 * 2**20  # bytes; a longer prompt than any context holds, with room for JSON
DEFAULT_MAX_INFLIGHT = 256  # requests being answered at once (workbench serve --max-inflight)
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is there


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer was ready."""


class _DeadlinePassed(Exception):
    """The request's deadline passed before its answer was ready."""


def request_timeout(body: Any, limit_s: float) -> float:
    """Seconds the request may take: its body's ``timeout`` (taken out of the body, which
    the OpenAI checks then see without it), at most the endpoint's ``limit_s``."""
    value = body.pop("timeout", None) if isinstance(body, dict) else None
    if value is None:
        return limit_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ApiError(400, f"timeout must be a number of seconds > 0, got {value!r}", "timeout")
    return min(float(value), limit_s)


def _error_event(status: int, message: str) -> bytes:
    kind = "timeout" if status == 504 else "server_error" if status >= 500 else \
        "invalid_request_error"
    return _event(ApiError(status, message, kind=kind).body())


def create_app(server: Any) -> FastAPI:
    app = FastAPI(title="colossal-workbench", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        route = request.url.path
        server.metrics.requests.labels(route, str(err.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
        headers.update(err.headers or {})
        if err.status == 413:  # the body was not read: the connection cannot be reused
            headers["Connection"] = "close"
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def authorize(request: Request) -> None:
        if server.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        # bytes, not str: compare_digest refuses non-ASCII str (headers arrive as latin-1)
        if not token or not secrets.compare_digest(token.encode("latin-1"),
                                                   server.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def body_of(request: Request) -> Any:
        too_large = ApiError(413, f"the request body is larger than {MAX_BODY} bytes (8 MiB): "
                                  "send a shorter prompt", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            raise too_large  # answered before reading any of it
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise too_large
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks) or b"null")
        except ValueError as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}") from None
        except RecursionError:
            raise ApiError(400, "the request body's JSON is nested too deeply") from None

    def check_capacity() -> None:
        limit = server.max_inflight or DEFAULT_MAX_INFLIGHT
        if server.active >= limit:
            raise ApiError(429, f"this endpoint is answering its maximum of {limit} requests "
                                f"at once: retry after {RETRY_AFTER_S} s", kind="rate_limit_error",
                           code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

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

    @app.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(openapi_schema.openapi())  # no key needed, as /health

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
        check_capacity()
        body = await body_of(request)
        timeout_s = request_timeout(body, server.request_timeout_s)
        prompt, params = api.completion_request(body)
        adapter = check_model(body)
        return await respond(request, "completion", prompt, params, body, adapter, timeout_s)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        check_capacity()
        body = await body_of(request)
        timeout_s = request_timeout(body, server.request_timeout_s)
        messages, params = api.chat_request(body)
        adapter = check_model(body)
        return await respond(request, "chat", messages, params, body, adapter, timeout_s)

    async def respond(request: Request, kind: str, prompt: Any, params: dict[str, Any],
                      body: dict[str, Any], adapter: str | None, timeout_s: float) -> Response:
        reason = server.unavailable()
        if reason:
            raise ApiError(503, reason, kind="unavailable")
        check_capacity()  # again: others may have been admitted while this body was read
        server.active += 1  # until its response ends: what --stop drains
        try:
            response = await answer(request, kind, prompt, params, body, adapter,
                                    time.monotonic() + timeout_s)
        except BaseException:
            server.active -= 1
            raise
        if not isinstance(response, EventStream):
            server.active -= 1
        return response

    async def answer(request: Request, kind: str, prompt: Any, params: dict[str, Any],
                     body: dict[str, Any], adapter: str | None, deadline: float) -> Response:
        route = request.url.path
        rid = api.new_id(kind)
        model = adapter or server.model_id  # the answer names what answered
        try:
            queue = server.bridge.submit(Command(kind, rid, prompt, params, adapter))
        except Unavailable as err:
            retry = err.retry_after_s
            raise ApiError(503, str(err), kind="unavailable", headers={
                "Retry-After": str(retry)} if retry else None) from None
        streaming = bool(body.get("stream"))
        try:
            first = await next_delta(request, queue, deadline)
        except _ClientGone:
            return gone(rid, route)
        except _DeadlinePassed:
            raise timed_out(rid) from None
        if first.get("error"):
            server.bridge.abort(rid)
            # the bridge's or the ranks' own status, else a rank died, or the request was bad
            status = first.get("status") or (503 if server.unavailable() else 400)
            raise ApiError(status, first["error"], kind="invalid_request_error"
                           if status == 400 else "unavailable" if status == 503
                           else "server_error")
        if streaming:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            server.metrics.requests.labels(route, "200").inc()
            return EventStream(
                stream(kind, rid, model, first, queue, include_usage, deadline),
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        delta, text = first, first.get("text") or ""
        try:
            while delta.get("finish_reason") is None:
                delta = await next_delta(request, queue, deadline)
                text += delta.get("text") or ""
        except _ClientGone:
            return gone(rid, route)
        except _DeadlinePassed:
            raise timed_out(rid) from None
        if delta.get("error"):
            status = delta.get("status") or 503
            raise ApiError(status, delta["error"],
                           kind="unavailable" if status == 503 else "server_error")
        server.metrics.requests.labels(route, "200").inc()
        counts = (delta["prompt_tokens"], delta["completion_tokens"])
        build = api.completion_body if kind == "completion" else api.chat_body
        return JSONResponse(build(rid, model, text, delta["finish_reason"], counts))

    async def next_delta(request: Request, queue: asyncio.Queue,
                         deadline: float) -> dict[str, Any]:
        """The request's next delta, checking every ``DISCONNECT_POLL_S`` that its client is
        still there (``_ClientGone`` if not) and that its deadline has not passed
        (``_DeadlinePassed``)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _DeadlinePassed
            try:
                return await _get(queue, min(DISCONNECT_POLL_S, left))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise _ClientGone from None

    def timed_out(rid: str) -> ApiError:
        """A request past its deadline: aborted on its replica (its KV blocks freed)."""
        server.bridge.abort(rid)
        return ApiError(504, deadline_message(), kind="timeout", code="request_timeout")

    def deadline_message() -> str:
        return (f"the request took longer than its timeout and was aborted: the endpoint "
                f"allows {server.request_timeout_s:g} s (--request-timeout) and a body may ask "
                "for less with \"timeout\"; ask for fewer tokens or a longer timeout")

    def gone(rid: str, route: str) -> Response:
        """A non-streaming client went away: its request is aborted (its KV blocks freed)."""
        server.bridge.abort(rid)
        server.metrics.requests.labels(route, "499").inc()
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    async def stream(kind: str, rid: str, model: str, first: dict[str, Any],
                     queue: asyncio.Queue, include_usage: bool,
                     deadline: float) -> AsyncIterator[bytes]:
        """The request's SSE events: one per turn of this coroutine, carrying every delta
        queued for the request by then (``_take``), so a client whose events fall behind the
        engine's steps costs one event per catch-up, not one per step."""
        delta, done, dequeued_ns = first, False, 0
        text_event = event_template(  # a text event without a finish: only its text varies
            (lambda t: api.completion_chunk(rid, model, t, None)) if kind == "completion"
            else (lambda t: api.chat_chunk(rid, model, {"content": t}, None)))
        # the deadline arrives as an item on the queue: one timer per request, not per delta
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), queue.put_nowait,
                                _DEADLINE)
        try:
            if kind == "chat":
                yield _event(api.chat_chunk(rid, model, {"role": "assistant"}, None))
            while True:
                parts = _take(delta, queue)
                delta = parts[-1]
                late = delta is _DEADLINE
                if late or delta.get("error"):  # after the text before it, an event ends it
                    parts.pop()
                reason = None if late or delta.get("error") else delta.get("finish_reason")
                text = "".join(p.get("text") or "" for p in parts)
                if text and reason is None:
                    yield text_event(text)
                elif reason is not None:
                    chunk = api.completion_chunk(rid, model, text, reason) \
                        if kind == "completion" else \
                        api.chat_chunk(rid, model, {"content": text} if text else {},
                                       reason)
                    yield _event(chunk)
                if server.profile is not None:  # profile.py; not the request's first delta
                    written_ns = time.monotonic_ns()
                    for p in parts if dequeued_ns else parts[1:]:
                        stamps = p.get("t")
                        if isinstance(stamps, list):
                            server.profile.record([*stamps, dequeued_ns or written_ns,
                                                   written_ns], len(p.get("token_ids") or ()))
                if late:  # past its deadline: aborted, told so, ended
                    done = True
                    server.bridge.abort(rid)
                    server.metrics.requests.labels(request_route(kind), "504").inc()
                    yield _error_event(504, deadline_message())
                    return
                if delta.get("error"):  # its replica failed mid-stream
                    done = True
                    status = delta.get("status") or 503
                    server.metrics.requests.labels(request_route(kind), str(status)).inc()
                    yield _error_event(status, delta["error"])
                    return
                if reason is not None:
                    done = True
                    break
                delta = queue.get_nowait() if not queue.empty() else await queue.get()
                dequeued_ns = time.monotonic_ns()
            if include_usage:
                yield _event({"id": rid, "object": "text_completion" if kind == "completion"
                              else "chat.completion.chunk", "model": model,
                              "choices": [], "usage": api.usage(delta["prompt_tokens"],
                                                                delta["completion_tokens"])})
            yield b"data: [DONE]\n\n"
        finally:
            timer.cancel()
            server.active -= 1
            if not done:  # the client went away (or the server is shutting down)
                server.bridge.abort(rid)
                server.metrics.requests.labels(f"{request_route(kind)}", "499").inc()

    return app


def _take(delta: dict[str, Any], queue: asyncio.Queue) -> list[dict[str, Any]]:
    """``delta`` and every delta queued behind it now, up to the request's last (a finish,
    an error or ``_DEADLINE``, which is always last)."""
    parts = [delta]
    while parts[-1].get("finish_reason") is None and parts[-1] is not _DEADLINE \
            and not queue.empty():
        parts.append(queue.get_nowait())
    return parts


_DEADLINE: dict[str, Any] = {"deadline": True}  # put on a stream's queue when its time is up


async def _get(queue: asyncio.Queue, timeout_s: float) -> dict[str, Any]:
    """The queue's next item, ``asyncio.TimeoutError`` past ``timeout_s``; without a task
    (``wait_for`` makes one per call before Python 3.12) when the item is there or where
    ``asyncio.timeout`` exists."""
    if not queue.empty():
        return queue.get_nowait()
    if _TIMEOUT is None:
        return await asyncio.wait_for(queue.get(), timeout_s)
    async with _TIMEOUT(timeout_s):
        return await queue.get()


_TIMEOUT = getattr(asyncio, "timeout", None)  # Python >= 3.11


def request_route(kind: str) -> str:
    return "/v1/completions" if kind == "completion" else "/v1/chat/completions"


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
