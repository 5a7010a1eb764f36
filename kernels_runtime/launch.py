"""Run a function on N local ranks (gloo on CPU by default) and get their return values back.

Used by the tests and the benchmarks, and handy for a quick multi-rank run without a notebook
pool or torchrun. Each rank is its own process with its own process group, yet a failure reads
like an ordinary exception: the launcher collects every rank's result or traceback, retries
when the rendezvous port was taken meanwhile, and never leaves a process behind, even when a
rank hangs.
"""

from __future__ import annotations

import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from kernels_runtime.comm import destroy_distributed, find_free_port, init_distributed


class RanksFailedError(AssertionError):
    """One or more ranks raised, died or hung; the message holds each one's traceback.

    An AssertionError so that pytest shows it as a plain test failure."""


_PORT_TAKEN = ("address already in use", "eaddrinuse")
_ATTEMPTS = 3
_GRACE_S = 5.0  # how long the other ranks may still report after one rank failed


def _entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
) -> None:
    """Body of each rank: join the group, run `fn`, post (rank, ok, pickled result or text)."""
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores, as under torchrun
        init_distributed(
            rank, world_size, "127.0.0.1", port, backend=backend, timeout_s=pg_timeout_s
        )
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, pickle.dumps(value)))  # pickled here, so failures are caught
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


def _collect(procs: list, results: Any, timeout_s: float) -> tuple[dict, dict]:
    """Wait for one message per rank; give up at the deadline or shortly after a failure."""
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    dead_since: dict[int, float] = {}
    while len(values) + len(failures) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in values or rank in failures or proc.is_alive():
                    continue
                if now - dead_since.setdefault(rank, now) > 1.0:  # its message would be here
                    failures[rank] = f"rank {rank} exited with code {proc.exitcode} silently"
            continue
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    for rank in range(len(procs)):
        if rank not in values and rank not in failures:
            failures[rank] = f"rank {rank} did not finish in time and was killed"
    return values, failures


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
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, port, backend, pg_timeout_s, fn, args, kwargs, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        values: dict[int, Any] = {}
        try:
            values, failures = _collect(procs, results, timeout_s)
        finally:  # ranks that all reported get a moment to tear down; hung ones none
            _stop(procs, grace_s=_GRACE_S if len(values) == world_size else 0.0)
        port_taken = any(m in text.lower() for text in failures.values() for m in _PORT_TAKEN)
        if not (port_taken and attempt + 1 < _ATTEMPTS):
            break
    if failures:
        report = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(failures.items()))
        raise RanksFailedError(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    return [values[rank] for rank in range(world_size)]
