"""The serving bench's light client (``bench/serving/client.py``) reads what the endpoint sends
as an OpenAI client would: against the real app (uvicorn on loopback, a fake bridge feeding
deltas), its text, usage and per-chunk times match what the app streamed, events split
across chunks and reads included; a response that is not a 200 is an error naming its status,
never an empty result. No ranks: the app and uvicorn are real, the deltas are scripted."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from bench.serving.client import parse, stream
from workbench.serving.app import create_app
from workbench.serving.server import Server, free_port


class _ScriptedBridge:
    """Answers every request with ``deltas``, one step at a time on the event loop."""

    connected = 1

    def __init__(self, deltas: list[dict]) -> None:
        self.deltas, self.queues = deltas, {}

    def problem(self) -> None:
        return None

    def submit(self, command) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for i, delta in enumerate(self.deltas):
            loop.call_later(0.01 * i, queue.put_nowait, {"id": command.request_id, **delta})
        return queue

    def abort(self, request_id: str) -> None:
        pass


def _serve(bridge: _ScriptedBridge) -> tuple[uvicorn.Server, int]:
    server = Server(None, "tiny", api_key="k")
    server.bridge, server.accepting, server.replicas = bridge, True, 1
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port,
                                        log_level="warning", lifespan="off"))
    threading.Thread(target=web.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not web.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    return web, port


def test_the_light_client_reads_text_usage_and_times_as_streamed():
    words = ["d\u00e9f", " f(", "x)", ""]
    deltas = [{"token_ids": [1] * len(w), "text": w, "finish_reason": None, "error": None}
              for w in words[:-1]]
    deltas.append({"token_ids": [], "text": "", "finish_reason": "length", "error": None,
                   "prompt_tokens": 3, "completion_tokens": 9})
    web, port = _serve(_ScriptedBridge(deltas))
    try:
        body = {"prompt": "hi", "max_tokens": 9, "stream": True,
                "stream_options": {"include_usage": True}}
        got = asyncio.run(stream("127.0.0.1", port, "/v1/completions", "k", body))
        assert got["text"] == "".join(words), got
        assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 9,
                                "total_tokens": 12}, got
        assert 1 <= len(got["times"]) <= 3 and got["times"] == sorted(got["times"]), got
        refused = None
        try:
            asyncio.run(stream("127.0.0.1", port, "/v1/completions", "wrong key", body))
        except RuntimeError as err:
            refused = str(err)
        assert refused is not None and refused.startswith("HTTP 401"), refused
    finally:
        web.should_exit = True


def test_events_split_across_reads_are_timed_by_the_read_that_completed_them():
    events = (b'data: {"choices": [{"text": "ab"}]}\n\ndata: {"choices": [{"text": "c"}]}'
              b'\n\ndata: [DONE]\n\n')
    cut = events.index(b'"c"') + 3  # the first chunk ends inside the second event
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"%x\r\n%s\r\n" % (cut, events[:cut])
    rest = b"%x\r\n%s\r\n0\r\n\r\n" % (len(events) - cut, events[cut:])
    got = parse([(0.5, head + body[:7]), (0.75, body[7:]), (1.0, rest)])
    assert got == {"times": [0.75, 1.0], "text": "abc", "usage": None}, got
