"""Run one cell on a set of ranks: stream output, notice failures, handle interrupts.

The waiting loop runs in the notebook's main thread so that output it forwards lands in the
running cell (ipykernel routes output printed from other threads to the cell that started the
thread) and so that the kernel's interrupt arrives here as KeyboardInterrupt.

Failure policy, chosen so the notebook never hangs:
- an exception on some rank: the others get ``failure_grace_s`` to finish, then are interrupted
  (they may be waiting for the failed rank inside a collective);
- a dead rank: reported by rank and exit signal as soon as ipyparallel's nanny notices;
- the kernel's interrupt: SIGINT to every busy rank, then KeyboardInterrupt in the notebook;
- after any failure the process group is marked for re-creation before the next cell, since an
  interrupted or timed-out collective leaves gloo and nccl groups unusable.
- a rank out of device, host or disk memory: the error also names the tier, the budget that
  rank measures and the plans the planner predicts would fit (``oom_hint``).

Live data: what ranks publish with datapub (``AsyncResult.data``, the latest value per key) is
handed to an optional ``data_sink`` from the same loop, at most every ``data_interval_s``, and
once more with ``final=True`` when the cell has ended, whatever the outcome. The dashboard is
such a sink; a sink that raises is dropped with a note, never failing the cell. The same data
goes to the pool's state file (``pool.state``, rate-limited there), which is how the JupyterLab
sidebar knows a pool is busy and how its dashboard page plots a cell while it runs.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ipyparallel.error import RemoteError

from workbench.cells.oom_hint import memory_hint
from workbench.errors import PoolError, RankError, RankFailureError
from workbench.pool.pool import Pool
from workbench.pool.state import StatePublisher

StreamSink = Callable[[int, str, str], None]  # (rank, "stdout"|"stderr", text)
DisplaySink = Callable[[int, dict[str, Any]], None]  # (rank, display_data content)
DataSink = Callable[[dict[int, dict[str, Any]], bool], None]  # ({rank: ar.data}, final)

POLL_S = 0.02


@dataclass
class CellOutcome:
    ranks: list[int]
    seconds: float
    execute_results: dict[int, dict[str, Any]] = field(default_factory=dict)


class _OutputForwarder:
    """Forward each rank's new stdout/stderr/display output since the last call.

    ipyparallel keeps a rank's stream as the text a terminal would show: a line rewritten
    after a carriage return (a progress bar) replaces the old line, so the stored text can
    change behind what was sent, not only grow. What was sent is kept; text that only grew
    sends its new end, and a rewritten last line is sent again after a ``\r`` (which
    Jupyter's output area and a terminal both draw over the line)."""

    def __init__(self, ranks: list[int], metadata: list[dict], stream: StreamSink,
                 display: DisplaySink) -> None:
        self.ranks, self.metadata = ranks, metadata
        self.stream, self.display = stream, display
        self.sent: list[dict[str, Any]] = [{"stdout": "", "stderr": "", "outputs": 0}
                                           for _ in ranks]

    def flush(self) -> None:
        for i, rank in enumerate(self.ranks):
            md, sent = self.metadata[i], self.sent[i]
            for name in ("stdout", "stderr"):
                text = md.get(name) or ""
                new = _new_text(sent[name], text)
                if new:
                    self.stream(rank, name, new)
                sent[name] = text
            outputs = md.get("outputs") or []
            for content in outputs[sent["outputs"]:]:
                self.display(rank, content)
            sent["outputs"] = len(outputs)


def _new_text(sent: str, text: str) -> str:
    """What to write so a reader of ``sent`` sees ``text``: its new end, or, where a line was
    rewritten, a carriage return and that line onwards."""
    if text.startswith(sent):
        return text[len(sent):]
    same = 0
    for a, b in zip(sent, text):
        if a != b:
            break
        same += 1
    line_start = text.rfind("\n", 0, same) + 1
    return "\r" + text[line_start:]


class _DataForwarder:
    """Hand each rank's latest published data to ``sink``, rate-limited."""

    def __init__(self, ranks: list[int], metadata: list[dict], sink: DataSink | None,
                 interval_s: float, stream: StreamSink, state: StatePublisher) -> None:
        self.ranks, self.metadata, self.sink = ranks, metadata, sink
        self.interval_s, self.stream, self.state = interval_s, stream, state
        self.last = float("-inf")

    def poll(self, now: float, final: bool = False) -> None:
        if not final and now - self.last < self.interval_s:
            return
        self.last = now
        data = {r: dict(m.get("data") or {}) for r, m in zip(self.ranks, self.metadata)}
        self.state.cell_data(data, final)  # never raises
        if self.sink is None:
            return
        try:
            self.sink(data, final)
        except Exception as err:  # live plots are a view; the cell's outcome must not depend
            self.sink = None
            self.stream(self.ranks[0], "stderr",
                        f"[workbench] live data display stopped: {type(err).__name__}: {err}\n")


def _dead_rank_error(pool: Pool, rank: int) -> RankError:
    host = pool.host_of(rank)
    where = f" on host {host}" if host else ""
    return RankError(rank, "died", "RankDied",
                     f"rank {rank}{where} process died ({pool.death_reason(rank)})")


def _rank_error(pool: Pool, rank: int, exc: BaseException) -> RankError:
    if isinstance(exc, RemoteError):
        if exc.ename == "EngineError" or _stopped_by_sigterm(exc):
            return _dead_rank_error(pool, rank)
        kind = "interrupted" if exc.ename == "KeyboardInterrupt" else "error"
        tb = exc.traceback.splitlines() if isinstance(exc.traceback, str) else list(exc.traceback)
        return RankError(rank, kind, exc.ename, exc.evalue, tb)
    return RankError(rank, "error", type(exc).__name__, str(exc))


def _stopped_by_sigterm(exc: RemoteError) -> bool:
    """The engine's SIGTERM handler (``workbench.pool.rank_process``) ends a running cell with
    ``SystemExit(128 + SIGTERM)`` on its way out: a rank told to stop (``scancel``, the pool's
    reaper), which is dying, not a cell that failed."""
    return exc.ename == "SystemExit" and exc.evalue == str(128 + signal.SIGTERM)


def check_ranks_alive(pool: Pool, ranks: list[int]) -> None:
    dead = [r for r in pool.dead_ranks() if r in ranks]
    if dead:
        errors = [_dead_rank_error(pool, r) for r in dead]
        raise RankFailureError(errors, hint="Run `%colossal restart` to bring back a full pool.")


def run_cell(
    pool: Pool,
    code: str,
    *,
    ranks: list[int] | None = None,
    stream: StreamSink,
    display: DisplaySink,
    timeout_s: float | None = None,
    failure_grace_s: float = 1.0,
    interrupt_wait_s: float = 2.0,
    data_sink: DataSink | None = None,
    data_interval_s: float = 0.25,
    stop: threading.Event | None = None,
) -> CellOutcome:
    """Execute ``code`` on ``ranks`` (all by default) and wait, forwarding output live and,
    to ``data_sink``, the ranks' published data. ``stop`` set (from another thread: a
    ``--noblock`` cell's ``interrupt()``) interrupts the ranks as a KeyboardInterrupt does."""
    ranks = list(range(pool.world_size)) if ranks is None else ranks
    check_ranks_alive(pool, ranks)
    if pool.needs_reset:
        pool.reset_process_group()
        pool.needs_reset = False
    pool.state.cell_started(cell_label(code), ranks)
    try:
        outcome = _run(pool, code, ranks, stream, display, timeout_s, failure_grace_s,
                       interrupt_wait_s, data_sink, data_interval_s, stop)
    except BaseException:
        pool.state.cell_finished(failed=True)
        raise
    pool.state.cell_finished()
    return outcome


def cell_label(code: str) -> str:
    """The cell's first non-empty line, for the sidebar and the dashboard page."""
    line = next((ln.strip() for ln in code.splitlines() if ln.strip()), "")
    return line if len(line) <= 80 else line[:77] + "..."


def _run(pool: Pool, code: str, ranks: list[int], stream: StreamSink, display: DisplaySink,
         timeout_s: float | None, failure_grace_s: float, interrupt_wait_s: float,
         data_sink: DataSink | None, data_interval_s: float,
         stop: threading.Event | None = None) -> CellOutcome:
    t0 = time.perf_counter()
    ar = pool.view(ranks).execute(code, silent=False, block=False)
    md = ar.metadata
    md = [md] if isinstance(md, dict) else md
    out = _OutputForwarder(ranks, md, stream, display)
    data = _DataForwarder(ranks, md, data_sink, data_interval_s, stream, pool.state)
    first_failure: float | None = None
    try:
        while not ar.wait(POLL_S):
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt  # handled below, as the stop button's
            out.flush()
            now = time.perf_counter()
            data.poll(now)
            if first_failure is None and any(m.get("status") == "error" for m in md):
                first_failure = now
            if first_failure is not None and now - first_failure > failure_grace_s:
                _interrupt(pool, ranks, ar)
                first_failure = float("inf")  # interrupt once
            if timeout_s is not None and now - t0 > timeout_s:
                _interrupt(pool, ranks, ar)
                ar.wait(interrupt_wait_s)
                out.flush()
                data.poll(time.perf_counter(), final=True)
                pool.needs_reset = True
                raise PoolError(
                    f"cell did not finish within --timeout {timeout_s:g} s; every rank was "
                    "interrupted and the process group will be re-created before the next cell"
                )
    except KeyboardInterrupt:
        _interrupt(pool, ranks, ar)
        ar.wait(interrupt_wait_s)
        out.flush()
        data.poll(time.perf_counter(), final=True)
        pool.needs_reset = True
        busy = [r for r, p in zip(ranks, ar.split()) if not p.done()]
        if busy:
            stream(ranks[0], "stderr", f"[workbench] ranks {busy} still busy after the interrupt"
                   " (inside a collective?); they stop at the collective timeout\n")
        raise
    ar.wait_for_output(1.0)
    out.flush()
    data.poll(time.perf_counter(), final=True)
    if not ar.successful():
        failures = [_rank_error(pool, r, p.exception()) for r, p in zip(ranks, ar.split())
                    if p.exception() is not None]
        pool.needs_reset = True
        hint = ""
        if any(f.kind == "died" for f in failures):
            hint = "Run `%colossal restart` to bring back a full pool."
        hint = "\n\n".join(h for h in (memory_hint(pool, failures), hint) if h)
        raise RankFailureError(failures, hint=hint)
    results = {r: m["execute_result"] for r, m in zip(ranks, md) if m.get("execute_result")}
    return CellOutcome(ranks, time.perf_counter() - t0, results)


def _interrupt(pool: Pool, ranks: list[int], ar: Any) -> None:
    busy = [pool.engine_ids[r] for r, p in zip(ranks, ar.split()) if not p.done()]
    alive = set(pool.client.ids) if pool.client else set()
    targets = [e for e in busy if e in alive]
    if targets:
        pool.client.send_signal("SIGINT", targets=targets, block=False)
