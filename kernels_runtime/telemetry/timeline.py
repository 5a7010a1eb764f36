"""A pipeline step's timeline, made small enough to publish with every snapshot.

The pipeline executor hands ``Telemetry.record_pipeline`` the timeline of each step it ran
(``kernels_runtime.parallel.pipeline.executor``): which action (F forward, B backward, W weight
gradients) of which micro-batch and chunk ran when, and how long the rank waited on a receive
before it, in seconds from the step's start on this rank's clock. The notebook draws the last
one as the dashboard's stage panel. A snapshot is pickled onto the IOPub socket up to four
times a second and written into the lab's pool-state file, so the published copy is bounded:
at most ``MAX_EVENTS`` events (the first ones of the step; the number left out is kept), times
rounded to microseconds, and only the fields the panel uses.
"""

from __future__ import annotations

from typing import Any

MAX_EVENTS = 256  # 1f1b with 64 micro-batches, interleaved 2 chunks x 32, zbv 3 x 42 ...
EVENT_FIELDS = ("kind", "chunk", "mb", "stage", "start", "end", "wait")
_TIMES = ("start", "end", "wait")


def _seconds(value: Any) -> float:
    return round(float(value), 6)


def compact_timeline(timeline: dict[str, Any], step: int,
                     max_events: int = MAX_EVENTS) -> dict[str, Any]:
    """The published form of one step's ``timeline``; ``step`` is the telemetry step it is in.

    Keys: step, schedule, stage (this rank's pipeline coordinate), stages, chunks,
    microbatches, step_seconds, waited_seconds, bubble (waited / step), p2p_bytes,
    deferred_weight_grads, events [{kind, chunk, mb, stage (virtual), start, end, wait}],
    events_dropped."""
    events = list(timeline.get("events", ()))
    kept = [{k: (_seconds(e[k]) if k in _TIMES else e[k]) for k in EVENT_FIELDS if k in e}
            for e in events[:max_events]]
    return {
        "step": step,
        "schedule": str(timeline.get("schedule", "")),
        "stage": int(timeline.get("stage", 0)),
        "stages": int(timeline.get("stages", 1)),
        "chunks": int(timeline.get("chunks", 1)),
        "microbatches": int(timeline.get("microbatches", 0)),
        "step_seconds": _seconds(timeline.get("step_seconds", 0.0)),
        "waited_seconds": _seconds(timeline.get("waited_seconds", 0.0)),
        "bubble": round(float(timeline.get("bubble", 0.0)), 4),
        "p2p_bytes": int(timeline.get("p2p_bytes", 0)),
        "deferred_weight_grads": int(timeline.get("deferred_weight_grads", 0)),
        "events": kept,
        "events_dropped": len(events) - len(kept),
    }
