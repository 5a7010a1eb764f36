"""Pool-state files: how a kernel's pool tells the Jupyter server what it is doing.

The pool lives in a kernel process, the JupyterLab sidebar and the live dashboard page are
served by the Jupyter server: two processes, and the server must stay responsive however busy
the kernel is. So the kernel side writes one small JSON file per pool into
``jupyter_runtime_dir()/workbench/`` (atomically: a temp file renamed over the old one, so a
reader never sees half a file) and the server only reads files. No socket, no protocol, no
waiting on a busy kernel.

A file holds the pool id, the id of the kernel that owns it (from the kernel's connection file
name ``kernel-<id>.json``), the kernel's pid, the pool's state, one row per rank, and the
telemetry of the running (or last) ``%%colossal`` cell, with its pipeline stage timeline as
plotly traces when the cell ran a pipeline, its offload panel (model state per tier, bytes
moved between tiers per step) as plotly traces and layout when a model offloaded, and its
inference panel (generated tokens/s, the queue, KV blocks per replica) likewise when an engine
generated, its curves panel (loss, eval loss, LR, grad norm per training step) when the
cell trained, and its expert-load heatmap (tokens per expert per MoE layer of the last step,
summed over ranks) when an expert-parallel model stepped, and, once a cell that trained ends
after an earlier one that did, ``compare(previous, this)`` as ready traces (the page's
"compare with the previous run"). While ``%colossal serve`` serves
(no cell runs; ``workbench.serving.display`` writes from a thread), the serving ranks'
telemetry stands as the running cell ("serving ENGINE at URL") and an ``endpoint`` block holds
the endpoint: its address, state or failure, requests/s, in flight, the engines' queue and KV
blocks, and its panel as plotly traces; None when nothing serves. Writes during a cell or
while serving are rate-limited (``min_interval_s``, 0.5 s) so a long training loop costs the
kernel next to nothing.

Files of dead processes (pid gone on this host) are stale: ``read_pools`` deletes them.
This module imports neither torch nor jupyter_server: the kernel imports it (``workbench``
registers it as the pools' publisher) and the server extension imports it to list pools.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.pool.state import rank_row as rank_row  # re-exported: the file's rank rows
from workbench.pool.state import tiers as _tiers
from workbench.ui.dashboard.curves import curve_layout, curve_traces
from workbench.ui.dashboard.endpoint import EndpointHistory
from workbench.ui.dashboard.expert_load import expert_load_layout, expert_load_traces
from workbench.ui.dashboard.history import RunHistory, collective_bytes
from workbench.ui.dashboard.inference import inference_layout, inference_traces
from workbench.ui.dashboard.offload import offload_layout, offload_traces
from workbench.ui.dashboard.runs import trained
from workbench.ui.dashboard.timeline import stage_axes, stage_title, stage_traces

log = logging.getLogger("workbench.ui.lab.state")

SCHEMA_VERSION = 1
STATES = ("starting", "running", "busy", "restarting", "stopping", "stopped", "failed")
LIVE_STATES = ("starting", "running", "busy", "restarting", "stopping")
SERIES_POINTS = 300  # points of each time series kept in the file
INFERENCE_LATEST = ("replica", "leader", "running", "waiting", "swapped", "blocks_total",
                    "blocks_used", "blocks_free", "blocks_shared", "kv_utilisation")
_KERNEL_FILE = re.compile(r"kernel-(?P<id>[^/\\]+)\.json")
POOL_ID = re.compile(r"[0-9a-f]{12}")


def state_dir() -> Path:
    """Where pool-state files live: the Jupyter runtime dir, shared by server and kernels."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "workbench"


def current_kernel_id() -> str | None:
    """The id of the Jupyter kernel this process is, or None outside a kernel."""
    try:
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).name
    except Exception:  # not in a kernel (script, test, plain IPython)
        return None
    match = _KERNEL_FILE.fullmatch(name)
    return match.group("id") if match else None


def _cell_block(history: RunHistory, running: bool) -> dict[str, Any]:
    """The cell's telemetry as the dashboard page draws it: series plus latest per rank."""
    points = history.points[-SERIES_POINTS:]
    latest = {}
    offloads, inferences = history.offloads(), history.inferences()
    for rank, snap in history.latest.items():
        latest[str(rank)] = {
            "steps": snap.get("steps", 0),
            "seconds": snap.get("seconds", {}),
            "throughput": snap.get("throughput", {}),
            "memory": _tiers(snap.get("memory", {})),
            "comm_bytes": collective_bytes(snap),
            "p2p_bytes": {a: c.get("sent", 0) for a, c in snap.get("p2p_by_axis", {}).items()},
            # model-state bytes per tier of an offloading rank, else None
            "offload_tiers": dict(offloads[rank]["tiers"]) if rank in offloads else None,
            # an engine's queue and KV blocks on this rank (its replica's), else None
            "inference": {k: inferences[rank].get(k) for k in INFERENCE_LATEST}
            if rank in inferences else None,
        }
    return {
        "label": history.label, "ranks": history.ranks, "running": running,
        "elapsed": round(history.elapsed, 3), "points": len(history.points),
        "latest": latest,
        "series": {
            "t": [round(p.t, 3) for p in points],
            "tokens_per_s": {str(r): [p.ranks.get(r, {}).get("tokens_per_s", 0.0)
                                      for p in points] for r in history.ranks},
            "comm_bytes": {axis: [sum(r["comm_bytes"].get(axis, 0) for r in p.ranks.values())
                                  for p in points] for axis in history.axes()},
            "p2p_bytes": {axis: [sum(r["p2p_bytes"].get(axis, 0) for r in p.ranks.values())
                                 for p in points] for axis in history.axes("p2p_by_axis")},
        },
        "stages": _stages_block(history),
        "offload": _panel_block(history, offload_traces, offload_layout),
        "inference": _panel_block(history, inference_traces, inference_layout),
        "expert_load": _panel_block(history, expert_load_traces, expert_load_layout),
        # loss, eval loss, LR, grad norm per step; the page's slider smooths the raw traces
        "curves": _panel_block(history, lambda h, last: curve_traces(h.curves, last=last),
                               lambda h: curve_layout(h.curves)),
    }


def _stages_block(history: RunHistory) -> dict[str, Any] | None:
    """The stage timeline as ready plotly traces (the notebook's, from ``timeline.py``), so
    the page draws the same bars without a second implementation; None without a pipeline."""
    timelines = history.pipelines()
    if not timelines:
        return None
    xaxis, yaxis = stage_axes(timelines)
    traces = [{"type": "bar", "name": name, **props}
              for name, props in stage_traces(timelines).items()]
    return {"title": stage_title(timelines), "xaxis": xaxis, "yaxis": yaxis, "traces": traces}


def _panel_block(history: RunHistory, traces: Callable[..., dict[str, dict[str, Any]]],
                 layout: Callable[[RunHistory], dict[str, Any]]) -> dict[str, Any] | None:
    """A panel (offload, inference) as ready plotly traces and layout, the notebook's own
    (``offload.py``, ``inference.py``), its series bounded like the others; None while the
    cell has no data for it."""
    data = traces(history, last=SERIES_POINTS)
    if not data:
        return None
    panel_layout = layout(history)
    return {"title": panel_layout["title"]["text"], "layout": panel_layout,
            "traces": [{"name": name, **props} for name, props in data.items()]}


class PoolStateFile:
    """The kernel side: keeps one pool's document and writes it on every change.

    It is the pool's ``workbench.pool.state.StatePublisher`` (registered by
    ``workbench/__init__.py``), so neither the pool nor the cell runner imports this module.

    Never raises: a full disk or a read-only runtime dir must not fail a pool or a cell.
    ``enabled=None`` publishes only inside a Jupyter kernel (scripts and tests stay quiet).
    """

    def __init__(self, enabled: bool | None = None, min_interval_s: float = 0.5) -> None:
        self.kernel_id = current_kernel_id()
        self.enabled = self.kernel_id is not None if enabled is None else enabled
        self.pool_id = uuid.uuid4().hex[:12]
        self.min_interval_s = min_interval_s
        self.doc: dict[str, Any] = {
            "version": SCHEMA_VERSION, "id": self.pool_id, "kernel_id": self.kernel_id,
            "pid": os.getpid(), "host": socket.gethostname(), "state": "stopped",
            "error": None, "created": time.time(), "updated": time.time(),
            "backend": "", "launcher": "", "world_size": 0, "ranks": [], "cell": None,
            "endpoint": None,
        }
        self.history: RunHistory | None = None
        self.previous_run: RunHistory | None = None  # the last cell that trained
        self.path: Path | None = None
        self._last_write = float("-inf")
        self._lock = threading.Lock()
        self._first = True

    # ---- lifecycle ----------------------------------------------------------------------
    def update(self, state: str | None = None, **fields: Any) -> None:
        """Change the state and/or fields and write now."""
        if state is not None and state not in STATES:
            raise ValueError(f"pool state must be one of {STATES}, got {state!r}")
        with self._lock:  # a serving endpoint's thread writes the same document
            if state is not None:
                self.doc["state"] = state
            self.doc.update(fields)
        self.write(force=True)

    def cell_started(self, label: str, ranks: list[int]) -> None:
        if not self.enabled:
            return
        self.history = RunHistory(ranks, label=label, max_points=2 * SERIES_POINTS)
        for row in self.doc["ranks"]:
            if row["rank"] in ranks:
                row["state"] = "busy"
        self.doc["cell"] = _cell_block(self.history, running=True)
        self.update("busy")

    def cell_data(self, data: dict[int, dict[str, Any]], final: bool = False) -> None:
        """Telemetry polled by ``run_cell``; written at most every ``min_interval_s``."""
        if self.history is None:
            return
        try:
            if self.history.ingest(data):
                for row in self.doc["ranks"]:
                    snap = self.history.latest.get(row["rank"])
                    if snap is not None:
                        row["memory"] = _tiers(snap.get("memory", {}))
            if final:
                self.history.finish()
            if not (final or self._due()):
                return
            self.doc["cell"] = _cell_block(self.history, running=not final)
        except Exception as err:  # a malformed snapshot must not break the cell
            log.debug("pool state: ignoring telemetry: %s", err)
            return
        self.write(force=final)

    def cell_finished(self, failed: bool = False) -> None:
        if self.history is not None:
            self.history.finish()
            self.doc["cell"] = _cell_block(self.history, running=False)
            self.doc["cell"]["failed"] = failed
            self.doc["cell"]["compare"] = self._compare_with_previous(self.history)
        for row in self.doc["ranks"]:
            if row["state"] == "busy":
                row["state"] = "idle"
        if self.doc["state"] == "busy":
            self.update("running")
        else:
            self.write(force=True)

    def serving_data(self, history: RunHistory, endpoint: EndpointHistory,
                     final: bool = False) -> None:
        """A serving endpoint's figures, from its display thread: the serving ranks'
        telemetry as the running cell, the ``endpoint`` block, the ranks busy; written at most
        every ``min_interval_s``. ``final``: serving stopped, so the cell ends, the endpoint
        block goes and the ranks are idle again (always written)."""
        if not self.enabled or not (final or self._due()):
            return
        try:
            cell = _cell_block(history, running=not final)
            block = None if final else endpoint.block(last=SERIES_POINTS)
        except Exception as err:  # a malformed snapshot must not stop the display
            log.debug("pool state: ignoring serving data: %s", err)
            return
        with self._lock:
            self.doc["cell"], self.doc["endpoint"] = cell, block
            for row in self.doc["ranks"]:
                snap = history.latest.get(row["rank"])
                if snap is not None:
                    row["memory"] = _tiers(snap.get("memory", {}))
                if row["state"] != "dead":
                    row["state"] = "idle" if final else "busy"
        self.write(force=final)

    def _compare_with_previous(self, history: RunHistory) -> dict[str, Any] | None:
        """The page's "compare with the previous run" panel: ``compare(previous, this)`` of
        this pool's last two cells that trained (``previous.py``); None before the second.
        Built once, as the cell ends, so a training loop pays nothing for it."""
        if not trained(history):
            return None
        previous, self.previous_run = self.previous_run, history
        if previous is None:
            return None
        try:
            from workbench.ui.dashboard.previous import compare_panel

            return compare_panel(previous, history)
        except Exception as err:  # a figure that cannot be built must not fail the cell
            log.debug("pool state: no comparison with the previous run: %s", err)
            return None

    # ---- files --------------------------------------------------------------------------
    def _due(self) -> bool:
        return time.monotonic() - self._last_write >= self.min_interval_s

    def write(self, force: bool = False) -> None:
        if not self.enabled or not (force or self._due()):
            return
        with self._lock:
            self._last_write = time.monotonic()
            self.doc["updated"] = time.time()
            try:
                directory = state_dir()
                directory.mkdir(parents=True, exist_ok=True)
                if self._first:
                    self._first = False
                    _remove_ended_pools_of(directory, os.getpid())
                self.path = directory / f"pool-{self.pool_id}.json"
                _atomic_write(self.path, self.doc)
            except (OSError, ValueError, RuntimeError) as err:  # never fail a pool or cell
                log.debug("pool state: cannot write %s: %s", self.path, err)

    def remove(self) -> None:
        if self.path is not None:
            with self._lock:
                self.path.unlink(missing_ok=True)


def _atomic_write(path: Path, doc: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".pool-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _remove_ended_pools_of(directory: Path, pid: int) -> None:
    """A process starting a new pool drops its own stopped/failed ones (one per kernel)."""
    for path in directory.glob("pool-*.json"):
        doc = _load(path)
        if doc and doc.get("pid") == pid and doc.get("state") not in LIVE_STATES:
            path.unlink(missing_ok=True)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("version") == SCHEMA_VERSION else None


def _alive(pid: Any) -> bool:
    import psutil

    return isinstance(pid, int) and psutil.pid_exists(pid)


def read_pools(directory: Path | None = None, clean: bool = True) -> list[dict[str, Any]]:
    """Every pool whose process is alive, oldest first; stale files are deleted (``clean``).

    Files from other hosts (a shared home directory) are kept but not listed: their pid says
    nothing here."""
    directory = state_dir() if directory is None else directory
    here = socket.gethostname()
    pools = []
    for path in sorted(directory.glob("pool-*.json")):
        doc = _load(path)
        if doc is None or doc.get("host") != here:
            continue
        if not _alive(doc.get("pid")):
            if clean:
                path.unlink(missing_ok=True)
            continue
        pools.append(doc)
    return sorted(pools, key=lambda d: d.get("created", 0))


def read_pool(pool_id: str, directory: Path | None = None) -> dict[str, Any] | None:
    """One live pool by id, or None (unknown, malformed id, or its process is gone)."""
    if not POOL_ID.fullmatch(pool_id):
        return None
    directory = state_dir() if directory is None else directory
    doc = _load(directory / f"pool-{pool_id}.json")
    if doc is None or doc.get("host") != socket.gethostname() or not _alive(doc.get("pid")):
        return None
    return doc
