"""A run's telemetry as the notebook saw it: the latest snapshot per rank and a time series.

Ranks publish cumulative snapshots (``kernels_runtime.telemetry``); the notebook polls them
about four times a second and appends one point whenever some rank's snapshot is new. Plotly
resends whole arrays on every update, so the series is bounded: beyond ``max_points`` every
other point is dropped (the run's whole span stays, at half the resolution), which keeps both
memory and each widget update small however long a run is. No plotly here, so collecting a
history costs nothing until a figure is wanted.

Bytes per axis are split in two: collective bytes (every op but point-to-point) and
point-to-point bytes, counted once, at the sender (a pipeline's activations and gradients on
"pp"), so that a pipeline's traffic is named as such and not summed with its receives.

An offloading rank's points also keep its cumulative offload counters (bytes moved per
"from->to", evictions, seconds waited, offloading steps), so per-step figures are differences
between points (``offload.py``); a rank's placement counts only once those counters move on
during the run (``offloads``), since they outlive a cell.

An inference engine's points keep its queue (running, waiting, swapped) and which replica the
rank stands for (``inference.py`` counts each replica once); its block is per cell already
(telemetry forgets it when a cell starts), so ``inferences`` needs no baseline; so is an
expert-parallel model's expert load (``expert_loads``), whose heatmap is ``expert_load.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernels_runtime.telemetry import TELEMETRY_KEY
from workbench.ui.dashboard.curves import CurveLog


@dataclass(frozen=True)
class Point:
    t: float  # seconds since the run started, notebook clock
    ranks: dict[int, dict[str, Any]]  # rank -> throughput and comm bytes per axis at that time


def append_bounded(points: list, point: Any, max_points: int) -> list:
    """``points`` with ``point`` appended; beyond ``max_points`` every other point is dropped,
    keeping the last (the whole span stays, at half the resolution)."""
    points.append(point)
    return points[-1::-2][::-1] if len(points) > max_points else points


def _summary(snapshot: dict[str, Any]) -> dict[str, Any]:
    tp = snapshot.get("throughput", {})
    p2p = snapshot.get("p2p_by_axis", {})
    return {
        "tokens_per_s": tp.get("tokens_per_s", 0.0),
        "samples_per_s": tp.get("samples_per_s", 0.0),
        "flops_per_s": tp.get("flops_per_s", 0.0),
        "comm_bytes": collective_bytes(snapshot),
        "p2p_bytes": {axis: c.get("sent", 0) for axis, c in p2p.items()},
        "offload": _offload_counters(snapshot.get("offload")),
        "inference": _inference_queue(snapshot.get("inference")),
        "train_steps": (snapshot.get("curves") or {}).get("steps", 0),  # this cell's
    }


def _offload_counters(block: Any) -> dict[str, Any] | None:
    """The cumulative offload counters of a snapshot (per-step figures are their
    differences, ``offload.py``), or None: this rank has not offloaded."""
    if not isinstance(block, dict):
        return None
    return {"moved": dict(block.get("moved", {})), "evictions": block.get("evictions", 0),
            "wait_seconds": block.get("wait_seconds", 0.0), "steps": block.get("steps", 0)}


def _inference_queue(block: Any) -> dict[str, Any] | None:
    """An engine's queue now and the replica it belongs to, or None: no engine stepped."""
    if not isinstance(block, dict):
        return None
    return {"replica": block.get("replica"), "leader": bool(block.get("leader", True)),
            **{k: int(block.get(k, 0) or 0) for k in ("running", "waiting", "swapped")}}


def collective_bytes(snapshot: dict[str, Any]) -> dict[str, float]:
    """Bytes per axis of one snapshot's collectives, point-to-point sends and receives left
    out (they are ``p2p_by_axis``)."""
    p2p = snapshot.get("p2p_by_axis", {})
    return {axis: c.get("bytes", 0) - p2p.get(axis, {}).get("sent", 0)
            - p2p.get(axis, {}).get("received", 0)
            for axis, c in snapshot.get("comm_by_axis", {}).items()}


def _offload_steps(snapshot: dict[str, Any]) -> int:
    block = snapshot.get("offload")
    return int(block.get("steps", 0)) if isinstance(block, dict) else 0


class RunHistory:
    """What one ``%%colossal`` cell's ranks published, as of the last poll."""

    def __init__(self, ranks: list[int], *, max_points: int = 600, label: str = "",
                 plan: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks = list(ranks)
        self.label = label
        self.plan = plan  # the cell's plan as text (legends of ``compare``), "" if unknown
        self.wall_started = time.time()
        self.max_points = max_points
        self.clock = clock
        self.started = clock()
        self.seconds: float | None = None  # set when the cell has ended
        self.latest: dict[int, dict[str, Any]] = {}  # rank -> its last snapshot
        self.points: list[Point] = []
        self._seen: dict[int, tuple] = {}
        self._offload_start: dict[int, int] = {}  # rank -> offload steps when first seen
        self.curves: dict[int, CurveLog] = {}  # rank -> its training curves (``curves.py``)

    @property
    def has_data(self) -> bool:
        return bool(self.latest)

    @property
    def elapsed(self) -> float:
        return self.seconds if self.seconds is not None else self.clock() - self.started

    def ingest(self, data: dict[int, dict[str, Any]]) -> bool:
        """Take ``{rank: AsyncResult.data}``; True if some rank published something new."""
        new = False
        for rank, published in data.items():
            snap = published.get(TELEMETRY_KEY)
            if not isinstance(snap, dict):
                continue
            key = (snap.get("seq"), snap.get("time"))
            if self._seen.get(rank) == key:
                continue
            self._seen[rank], self.latest[rank], new = key, snap, True
            self._offload_start.setdefault(rank, _offload_steps(snap))
            self.curves.setdefault(rank, CurveLog()).ingest(snap.get("curves"))
        if new:
            ranks = {r: _summary(s) for r, s in self.latest.items()}
            self.points = append_bounded(self.points, Point(self.clock() - self.started, ranks),
                                         self.max_points)
        return new

    def finish(self) -> None:
        """The cell ended: freeze the run's duration."""
        if self.seconds is None:
            self.seconds = self.clock() - self.started

    # ---- series for the figures ---------------------------------------------------------
    def axes(self, key: str = "comm_by_axis") -> list[str]:
        """Axes (process group names) any rank has used, in mesh order: for collectives, or
        for point-to-point traffic with ``key="p2p_by_axis"``."""
        names = {a for s in self.latest.values() for a in s.get(key, {})}
        order = {a: i for i, a in enumerate(("dp", "pp", "sp", "tp", "world"))}
        return sorted(names, key=lambda a: (order.get(a, len(order)), a))

    def times(self) -> list[float]:
        return [p.t for p in self.points]

    def comm_bytes(self, axis: str) -> list[float]:
        """Collective bytes moved on ``axis`` so far, summed over ranks, at each point."""
        return [sum(r["comm_bytes"].get(axis, 0) for r in p.ranks.values()) for p in self.points]

    def p2p_bytes(self, axis: str) -> list[float]:
        """Point-to-point bytes sent on ``axis`` so far, summed over ranks, at each point."""
        return [sum(r["p2p_bytes"].get(axis, 0) for r in p.ranks.values()) for p in self.points]

    def pipelines(self) -> dict[int, dict[str, Any]]:
        """Rank -> the timeline of its last published pipeline step; empty without a pipeline."""
        return {r: s["pipeline"] for r, s in sorted(self.latest.items())
                if isinstance(s.get("pipeline"), dict)}

    def offloads(self) -> dict[int, dict[str, Any]]:
        """Rank -> its latest offload block, for ranks whose offloading steps moved on during
        this run; empty without offload. The counters outlive a cell, so a block that never
        moves on is a previous cell's model and is left out."""
        return {r: s["offload"] for r, s in sorted(self.latest.items())
                if _offload_steps(s) > self._offload_start.get(r, 0)}

    def inferences(self) -> dict[int, dict[str, Any]]:
        """Rank -> its latest inference block (``Engine.stats``), for ranks whose engine has
        stepped during this run; empty without one."""
        return {r: s["inference"] for r, s in sorted(self.latest.items())
                if isinstance(s.get("inference"), dict)}

    def expert_loads(self) -> dict[int, dict[str, Any]]:
        """Rank -> its latest expert-load block (tokens per expert per MoE layer in its last
        step, ``kernels_runtime.telemetry.expert_load``); empty before an expert-parallel
        step in this cell (telemetry forgets the block when a cell starts)."""
        return {r: s["expert_load"] for r, s in sorted(self.latest.items())
                if isinstance(s.get("expert_load"), dict)}

    def rank_series(self, rank: int, key: str) -> list[float]:
        """``tokens_per_s``, ``samples_per_s`` or ``flops_per_s`` of one rank at each point."""
        return [p.ranks[rank][key] if rank in p.ranks else 0.0 for p in self.points]

    def summary(self) -> str:
        """One line for plain-text outputs (headless runs, logs)."""
        if not self.latest:
            return f"colossal dashboard: ranks {self.ranks}, no telemetry published yet"
        steps = max(s.get("steps", 0) for s in self.latest.values())
        tokens = sum(s.get("throughput", {}).get("tokens_per_s", 0.0)
                     for s in self.latest.values())
        comm = sum(sum(collective_bytes(s).values())
                   + sum(c.get("sent", 0) for c in s.get("p2p_by_axis", {}).values())
                   for s in self.latest.values())
        return (f"colossal dashboard: ranks {self.ranks}, {steps} steps, "
                f"{tokens:,.0f} tokens/s over all ranks, {comm / 2**20:,.1f} MiB communicated")
