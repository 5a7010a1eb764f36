"""Run functions on N local ranks (gloo on CPU by default) and get their return values back.

Used by the tests and the benchmarks, and handy for a quick multi-rank run without a notebook
pool or torchrun. ``RankPool`` keeps N rank processes (one process group) alive across calls,
so a test suite pays the start-up (spawn, import torch, rendezvous) once per world size and
each test is one ``pool.run(fn, ...)``; ``run_ranks`` is the one-call form on fresh processes.

A failure reads like an ordinary exception: the pool collects every rank's result or
traceback, retries the start when the rendezvous port was taken meanwhile, and never leaves a
process behind. A rank that raised, died or hung may have left its peers inside a collective,
so after any failure the pool replaces its processes before the next call: one hung test fails
alone instead of taking every later one with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from kernels_runtime.comm import destroy_distributed, find_free_port, init_distributed
from kernels_runtime.comm.process_group import PORT_TAKEN as _PORT_TAKEN


class RanksFailedError(AssertionError):
    """One or more ranks raised, died or hung; the message holds each one's traceback.

    An AssertionError so that pytest shows it as a plain test failure."""


_ATTEMPTS = 3
_GRACE_S = 5.0  # how long the other ranks may still report after one rank failed
_READY = -1  # task id of the start-up message


def _worker(rank: int, world_size: int, port: int, backend: str, pg_timeout_s: float,
            tasks: Any, results: Any) -> None:
    """Body of each rank: join the group, then run tasks until told to stop.

    A task is (id, sys.path, pickled (fn, args, kwargs)): the caller's path comes first so
    functions of modules imported after the pool started (test modules) unpickle here too."""
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores, as under torchrun
        init_distributed(rank, world_size, "127.0.0.1", port, backend=backend,
                         timeout_s=pg_timeout_s)
        results.put((_READY, rank, True, b""))
    except BaseException:
        results.put((_READY, rank, False, traceback.format_exc()))
        return
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            task_id, path, payload = task
            sys.path[:0] = [p for p in path if p not in sys.path]
            try:
                fn, args, kwargs = pickle.loads(payload)
                value = fn(rank, world_size, *args, **kwargs)
                results.put((task_id, rank, True, pickle.dumps(value)))  # failures caught here
            except BaseException:
                results.put((task_id, rank, False, traceback.format_exc()))
            _return_freed_memory()
    finally:
        destroy_distributed()


def _return_freed_memory() -> None:
    """Collect the last task's garbage and hand freed heap pages back to the OS: a long-lived
    rank otherwise keeps the high-water mark of every test it ran (GiBs after a suite of real
    models), which starves later tests that size themselves by the host's free memory."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the allocator keeps them
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _stop(procs: list, grace_s: float) -> None:
    """Let ranks finish their teardown for `grace_s`, then terminate, then kill what is left."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


class RankPool:
    """``world_size`` long-lived rank processes in one process group; see the module doc.

    ``pg_timeout_s`` is the process group's timeout: a collective one rank skips fails after
    it on the others."""

    def __init__(self, world_size: int, backend: str = "gloo", pg_timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0) -> None:
        self.world_size, self.backend = world_size, backend
        self.pg_timeout_s, self.start_timeout_s = pg_timeout_s, start_timeout_s
        self._procs: list = []
        self._tasks: list = []
        self._results: Any = None
        self._ids = itertools.count()
        self.starts = 0  # how many times processes were (re)started

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        for attempt in range(_ATTEMPTS):
            self._results = ctx.Queue()
            self._tasks = [ctx.Queue() for _ in range(self.world_size)]
            port = find_free_port()
            self._procs = [
                ctx.Process(target=_worker, daemon=True,
                            args=(rank, self.world_size, port, self.backend, self.pg_timeout_s,
                                  self._tasks[rank], self._results))
                for rank in range(self.world_size)
            ]
            for proc in self._procs:
                proc.start()
            self.starts += 1
            _, failures = _collect(self._procs, self._results, _READY, self.start_timeout_s)
            if not failures:
                return
            self._kill()
            taken = any(m in text.lower() for text in failures.values() for m in _PORT_TAKEN)
            if not (taken and attempt + 1 < _ATTEMPTS):
                raise RanksFailedError(_report(self.world_size, "failed to start", failures))

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            **kwargs: Any) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the values in
        rank order, or raise ``RanksFailedError`` with every failing rank's traceback (the
        processes are then replaced before the next call). ``fn`` must be a module-level
        function and its arguments and return value picklable."""
        if not self.alive:
            self._kill()
            self.start()
        task_id = next(self._ids)
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((task_id, list(sys.path), payload))
        values, failures = _collect(self._procs, self._results, task_id, timeout_s)
        if failures:
            self._kill()
            raise RanksFailedError(_report(self.world_size, "failed", failures))
        return [values[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop the processes (they tear their process group down first)."""
        if self._procs and self.alive:
            for q in self._tasks:
                q.put(None)
            _stop(self._procs, grace_s=_GRACE_S)
        else:
            self._kill()
        self._procs = []

    def _kill(self) -> None:
        _stop(self._procs, grace_s=0.0)
        self._procs = []


def _collect(procs: list, results: Any, task_id: int, timeout_s: float) -> tuple[dict, dict]:
    """Wait for one message per rank about ``task_id``; give up at the deadline or shortly
    after a failure. Ranks that died silently or never answered are failures too."""
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    dead_since: dict[int, float] = {}
    while len(values) + len(failures) < len(procs) and time.monotonic() < deadline:
        try:
            got, rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in values or rank in failures or proc.is_alive():
                    continue
                if now - dead_since.setdefault(rank, now) > 1.0:  # its message would be here
                    failures[rank] = f"rank {rank} exited with code {proc.exitcode} silently"
            continue
        if got != task_id:  # a late answer to an abandoned task
            continue
        if ok:
            values[rank] = pickle.loads(payload) if payload else None
        else:
            failures[rank] = payload
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    for rank in range(len(procs)):
        if rank not in values and rank not in failures:
            failures[rank] = f"rank {rank} did not finish in time and was killed"
    return values, failures


def _report(world_size: int, what: str, failures: dict[int, str]) -> str:
    text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failures.items()))
    return f"{len(failures)} of {world_size} ranks {what}:\n{text}"


def _entry(rank: int, world_size: int, port: int, backend: str, pg_timeout_s: float,
           fn: Callable[..., Any], args: tuple, kwargs: dict, results: Any) -> None:
    """Body of each ``run_ranks`` rank: join, run `fn` once, post its result. Arguments come
    with the process (so inheritance-only objects such as multiprocessing events work)."""
    try:
        torch.set_num_threads(1)
        init_distributed(rank, world_size, "127.0.0.1", port, backend=backend,
                         timeout_s=pg_timeout_s)
        value = fn(rank, world_size, *args, **kwargs)
        results.put((0, rank, True, pickle.dumps(value)))  # pickled here, so failures are caught
    except BaseException:
        results.put((0, rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes.

    `fn` must be a module-level function and its return value picklable. `pg_timeout_s` (a
    keyword, default 30) is the process group's timeout. Returns the values in rank order; if
    any rank raised, raises RanksFailedError with every failing rank's traceback.
    """
    pg_timeout_s = kwargs.pop("pg_timeout_s", 30.0)
    ctx = mp.get_context("spawn")
    for attempt in range(_ATTEMPTS):
        results = ctx.Queue()
        port = find_free_port()
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(rank, world_size, port, backend, pg_timeout_s, fn, args,
                                   kwargs, results))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        values: dict[int, Any] = {}
        try:
            values, failures = _collect(procs, results, 0, timeout_s)
        finally:  # ranks that all reported get a moment to tear down; hung ones none
            _stop(procs, grace_s=_GRACE_S if len(values) == world_size else 0.0)
        taken = any(m in text.lower() for text in failures.values() for m in _PORT_TAKEN)
        if not (taken and attempt + 1 < _ATTEMPTS):
            break
    if failures:
        raise RanksFailedError(_report(world_size, "failed", failures))
    return [values[rank] for rank in range(world_size)]
