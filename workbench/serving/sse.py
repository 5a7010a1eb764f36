"""``EventStream``: a streamed response of server-sent events, sent from the request's own task.

Why not Starlette's ``StreamingResponse``: under an ASGI server of spec 2.3 (uvicorn's h11 and
httptools servers) it runs each stream in an anyio task group (two anyio tasks, a cancel
scope), and the first one imports anyio's asyncio backend, about 0.1 s on the event loop inside
the first streamed request. On a machine whose cores the ranks fill, every CPU-second the
serving process takes is one the ranks lose (issue 30), so a stream here is what it must be:
the events written in the request's task as the generator yields them, and one plain asyncio
task per stream that waits for the client's disconnect and then cancels the stream (the
generator's ``finally`` then aborts its request, as with ``StreamingResponse``).

``event_template`` makes the JSON of a stream's text events once per stream: each event then
costs one ``json.dumps`` of its text, not of the whole chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_MARK = "\x00mark\x00"  # stands for a chunk's text while its template is made


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None
                 ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"ended": False, "gone": False}

        async def listen() -> None:  # the client went away: end the stream where it waits
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["ended"]:
                state["gone"] = True
                task.cancel()

        listener = asyncio.get_running_loop().create_task(listen())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            state["ended"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise  # the server is shutting down: not ours to swallow
            uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
            if uncancel is not None:
                uncancel()
        finally:
            state["ended"] = True
            listener.cancel()
            await self.events.aclose()  # its finally runs now if it has not yet


def event_template(chunk: Callable[[str], dict[str, Any]]) -> Callable[[str], bytes]:
    """``text -> b"data: <chunk(text) as JSON>\\n\\n"`` where ``chunk(text)`` differs between
    calls only in ``text`` (a stream's id, model and ``created`` are fixed): the JSON around the
    text is encoded once, exactly as ``json.dumps`` encodes the whole chunk."""
    head, tail = json.dumps(chunk(_MARK)).split(json.dumps(_MARK))
    head_b, tail_b = f"data: {head}".encode(), f"{tail}\n\n".encode()

    def event(text: str) -> bytes:
        return head_b + json.dumps(text).encode() + tail_b

    return event
