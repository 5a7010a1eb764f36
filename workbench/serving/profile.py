"""Where a served token's time goes: the per-token split ``python -m bench serving`` prints.

Why: served throughput trails ``engine.generate`` on the same ranks (issue 30), and the path
between them has five hops in two processes (rank 0's loop, its ZeroMQ socket, the bridge's
thread, uvicorn's event loop, the SSE write). Guessing which one costs is how the wrong one
gets optimized, so each delta a leader sends carries a few timestamps, appended as it travels:

    turn     the leader's loop turn began (receive commands, share them, admit)
    step0    ``engine.step()`` called
    step1    it returned (its tokens are on the host already: no extra device sync)
    sent     the deltas are built and about to be JSON-encoded and sent (rank_side.py)
    recv     the bridge's thread decoded it and hands it to the event loop (bridge.py)
    dequeued the request's stream coroutine took it off its queue (app.py)
    written  its SSE event was encoded and handed to the ASGI server (the generator resumed)

All are ``time.monotonic_ns()``: one clock for every process of a host (the ranks of a bench
run on the host of its server). Off unless asked for (``Server(profile=True)``): a delta then
carries no ``t`` and nothing is recorded. Consecutive stamps telescope, so the parts of a token
add up to its latency from its loop turn to its SSE write; each delta is weighted by the tokens
it carries. A request's first delta is left out (it waits for the response to start: that is
time to first token, reported apart). ``record`` only keeps a delta's stamps; they are checked
and summed when read (``summary``, ``merge``) or once ``_FOLD_AT`` are kept, so the event loop
serving the clients pays an append per delta, not the arithmetic.
"""

from __future__ import annotations

from typing import Any

STAMPS = ("turn", "step0", "step1", "sent", "recv", "dequeued", "written")
PARTS = ("rank loop: receive, share, admit", "rank: engine.step", "rank: deltas built",
         "bridge: JSON, ZeroMQ, decode", "server: event loop wake + queue wait",
         "server: SSE encode + write")
_MAX_NS = 3600 * 10**9  # a part longer than an hour is no measurement: the stamps are bad
_FOLD_AT = 100_000  # deltas kept before they are summed (bounds the memory of a long run)


class ServingProfile:
    """Per-run sums of each part over every profiled token (not thread-safe: the event loop
    records, the bench reads once the run is over)."""

    def __init__(self) -> None:
        self.sums_ns = [0] * len(PARTS)
        self.tokens = 0
        self.latency_ns = 0  # sum over tokens of written - turn, measured apart from the parts
        self.rejected = 0  # deltas whose stamps were malformed (they come over the network)
        self._kept: list[tuple[Any, int]] = []  # (stamps, tokens) recorded, not summed yet

    def record(self, stamps: Any, tokens: int) -> None:
        """Add one delta's stamps (``STAMPS``, in order), weighted by its ``tokens``."""
        if tokens <= 0:
            return
        self._kept.append((stamps, tokens))
        if len(self._kept) >= _FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        kept, self._kept = self._kept, []
        for stamps, tokens in kept:
            self._add(stamps, tokens)

    def _add(self, stamps: Any, tokens: int) -> None:
        if not (isinstance(stamps, list) and len(stamps) == len(STAMPS)
                and all(type(s) is int for s in stamps)):
            self.rejected += 1
            return
        parts = [b - a for a, b in zip(stamps, stamps[1:])]
        if any(not 0 <= p < _MAX_NS for p in parts):
            self.rejected += 1
            return
        for i, p in enumerate(parts):
            self.sums_ns[i] += p * tokens
        self.latency_ns += (stamps[-1] - stamps[0]) * tokens
        self.tokens += tokens

    def merge(self, other: ServingProfile) -> None:
        """Add ``other``'s tokens to these (rounds of a bench run)."""
        self._fold()
        other._fold()
        self.sums_ns = [a + b for a, b in zip(self.sums_ns, other.sums_ns)]
        self.tokens += other.tokens
        self.latency_ns += other.latency_ns
        self.rejected += other.rejected

    def summary(self) -> dict[str, Any]:
        """``{"tokens", "total_ms", "latency_ms", "parts": {name: (mean ms per token, share
        of total)}, "rejected"}``; ``total_ms`` sums the parts, ``latency_ms`` is measured
        end to end."""
        self._fold()
        n = max(self.tokens, 1)
        total = sum(self.sums_ns)
        parts = {name: (s / n / 1e6, s / total if total else 0.0)
                 for name, s in zip(PARTS, self.sums_ns)}
        return {"tokens": self.tokens, "total_ms": total / n / 1e6,
                "latency_ms": self.latency_ns / n / 1e6, "parts": parts,
                "rejected": self.rejected}


def rows(summary: dict[str, Any]) -> list[list[str]]:
    """The split as table rows: part, ms per token, share."""
    out = [[name, f"{ms:.2f}", f"{share:.0%}"] for name, (ms, share) in summary["parts"].items()]
    return out + [["total (loop turn -> SSE written)", f"{summary['total_ms']:.2f}", "100%"]]
