"""A stream writes one SSE event per turn carrying every delta queued for its request by then
(issue 30: what a client that falls behind the engine's steps costs is one event per catch-up,
not one per step), and never reorders, drops or outlives what it carries: deltas already
queued arrive as one event with their text in order and the request's finish; text queued
before a replica's error is sent before the error event; text queued before the deadline is
sent before the timeout event. The real app; a scripted bridge puts the deltas on the request's
queue (no ranks: the app's batching is on trial)."""

from __future__ import annotations

import asyncio
import json

from workbench.serving.server import Server

from helpers import inprocess_serving as served


class _Bridge:
    """Puts ``deltas`` on each request's queue at once, as a step's message would."""

    connected = 1

    def __init__(self, deltas: list[dict]) -> None:
        self.deltas, self.queues, self.aborted = deltas, {}, []

    def problem(self) -> None:
        return None

    def submit(self, command) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        for delta in self.deltas:
            queue.put_nowait({"id": command.request_id, **delta})
        return queue

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _delta(text: str, **last) -> dict:
    return {"token_ids": [7] * len(text), "text": text, "finish_reason": None, "error": None,
            **last}


def _events(deltas: list[dict], **body) -> tuple[list, list[str]]:
    """The stream's events (JSON or the string ``[DONE]``) for ``deltas``, and the aborts."""
    server = Server(None, "tiny", api_key=served.KEY)
    server.bridge, server.accepting, server.replicas = _Bridge(deltas), True, 1

    async def go() -> str:
        async with served.client(server) as client:
            r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True,
                                                           "max_tokens": 20, **body})
            assert r.status_code == 200, r.text
            return r.text

    text = asyncio.run(go())
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events], server.bridge.aborted


def test_deltas_queued_together_are_one_event_in_order_with_the_finish():
    last = _delta("", finish_reason="length", prompt_tokens=2, completion_tokens=6)
    events, aborted = _events([_delta("ab"), _delta("c"), _delta("def"), last])
    (chunk, done) = events
    assert chunk["choices"][0]["text"] == "abcdef", events
    assert chunk["choices"][0]["finish_reason"] == "length" and done == "[DONE]", events
    assert not aborted


def test_text_before_an_error_or_the_deadline_is_sent_before_its_event():
    error = _delta("", finish_reason="error", error="rank 1 died", status=503)
    events, _ = _events([_delta("ab"), _delta("cd"), error])
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["abcd"], events
    assert events[-1]["error"]["message"] == "rank 1 died" and "[DONE]" not in events

    events, aborted = _events([_delta("ab"), _delta("cd")], timeout=0.3)  # no finish comes
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["abcd"], events
    assert events[-1]["error"]["type"] == "timeout" and len(aborted) == 1, events
