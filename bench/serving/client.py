"""A streaming completion client light enough not to be what it measures.

Why: the bench's 64 clients run in the process that holds the server (and on the two cores
the ranks use). With httpx parsing every SSE line and JSON-decoding every chunk as it arrives,
the clients took about as much CPU as the server itself (0.30 of 0.58 CPU-seconds per round,
issue 30), so served throughput measured the load generator as much as the endpoint. This
client speaks HTTP/1.1 by hand: it writes the request, then only reads, keeping each read's
bytes and arrival time. The response is parsed once the stream has ended (outside the timed
part of a token's path, though inside the round): status, chunked framing, SSE events, each
event timed by the read that completed it. It handles exactly what the endpoint sends (an
HTTP/1.1 response, chunked or with a ``Content-Length``, ``Connection: close``) and says so
otherwise. The reads are an ``asyncio.Protocol``'s ``data_received`` callbacks, not a
``StreamReader`` awaited by a coroutine: a read then costs a callback, not a task wake-up
(on a served round's ~2,000 reads, about half the clients' CPU, which the ranks would lose).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from typing import Any


class _Reads(asyncio.Protocol):
    """Keeps each read's arrival second (from ``start``) and bytes; ``done`` when closed."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.reads: list[tuple[float, bytes]] = []
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.reads.append((time.perf_counter() - self.start, data))

    def eof_received(self) -> bool:
        return False  # close the transport: the response is whole

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


async def stream(host: str, port: int, path: str, key: str, body: dict[str, Any]) -> dict:
    """POST ``body`` to ``path`` and read the response to its end: ``{"times", "text",
    "usage"}`` as ``bench/serving/run.py``'s report reads them (``times``: seconds from the
    start of the connection to each chunk carrying text)."""
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    transport, reads = await loop.create_connection(lambda: _Reads(start), host, port)
    payload = json.dumps(body).encode()
    try:
        transport.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: "
                        f"Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: "
                        f"{len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await reads.done
    finally:
        transport.close()
    return parse(reads.reads)


def parse(reads: list[tuple[float, bytes]]) -> dict:
    """The SSE response in ``reads`` (arrival second, bytes), as ``stream`` returns it."""
    raw = b"".join(data for _, data in reads)
    ends, total = [], 0  # raw offset just past each read
    for _, data in reads:
        total += len(data)
        ends.append(total)
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        raise RuntimeError(f"no complete HTTP response head: {raw[:200]!r}")
    head = raw[:head_end].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {raw[head_end + 4:][:500]!r}")
    chunked = any(h.lower().replace(" ", "") == "transfer-encoding:chunked" for h in head[1:])
    pieces = _dechunk(raw, head_end + 4) if chunked else [(raw[head_end + 4:], len(raw))]
    times, text, usage = [], "", None
    for event, raw_end in _events(pieces):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        chunk = json.loads(event[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        if "error" in chunk:
            raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
        for choice in chunk["choices"]:
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                times.append(reads[min(bisect.bisect_left(ends, raw_end), len(reads) - 1)][0])
                text += piece
    return {"times": times, "text": text, "usage": usage}


def _dechunk(raw: bytes, at: int) -> list[tuple[bytes, int]]:
    """The chunks of a chunked body starting at ``at``: (data, raw offset just past it)."""
    out = []
    while True:
        line_end = raw.find(b"\r\n", at)
        if line_end < 0:
            raise RuntimeError("a chunked response cut off in a chunk's size line")
        size = int(raw[at:line_end].split(b";")[0], 16)
        if size == 0:
            return out
        start = line_end + 2
        if start + size > len(raw):
            raise RuntimeError("a chunked response cut off inside a chunk")
        out.append((raw[start:start + size], start + size))
        at = start + size + 2


def _events(pieces: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    """The SSE events (``\\n\\n``-terminated) of the body ``pieces``, each with the raw offset
    of the piece that completed it."""
    out, pending = [], b""
    for data, raw_end in pieces:
        pending += data
        *done, pending = pending.split(b"\n\n")
        out.extend((event.strip(b"\n"), raw_end) for event in done if event.strip(b"\n"))
    return out
