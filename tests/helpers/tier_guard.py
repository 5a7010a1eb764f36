"""What each test tier may start, counted rather than timed.

The inner loop (``make test-fast``) must stay a few minutes whatever the machine's load, so its
budget is checked by counts that do not depend on load: it starts no ipyparallel engine, no
Jupyter kernel and no rank pool of more than two ranks. This plugin records every such start
in this pytest process, with the test that caused it, prints the counts at the end of every
tier, and fails the session when the tier named by ``WORKBENCH_TEST_TIER`` started something
it may not: make test-fast nothing but pools of up to 2 ranks, make test nothing of 8 ranks
(the 8-rank matrix is make test-full's). Starts inside child processes, e.g. a kernel that
starts its own engines, are seen as the kernel's start.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from dataclasses import dataclass, field

import pytest

TIER_ENV = "WORKBENCH_TEST_TIER"


@dataclass(frozen=True)
class Allowed:
    """What a tier may start: ipyparallel engines per engine set (0: none), Jupyter kernels,
    ranks per rank pool."""

    engines: int
    kernels: bool
    max_ranks: int


TIERS = {
    "fast": Allowed(engines=0, kernels=False, max_ranks=2),
    "test": Allowed(engines=4, kernels=True, max_ranks=4),  # the 8-rank matrix is test-full's
    "full": Allowed(engines=8, kernels=True, max_ranks=8),
}


@dataclass
class StartLog:
    """Every engine set, kernel and rank pool this process started, by the test running then."""

    current: str = "(session setup)"
    starts: list[tuple[str, str, int]] = field(default_factory=list)  # (test, kind, ranks)
    # kinds: "ranks" (a rank pool started), "pool use" (a test ran on one), "engines", "kernel"

    def record(self, kind: str, n: int) -> None:
        self.starts.append((self.current, kind, int(n)))

    def violations(self, allowed: Allowed) -> list[str]:
        found: list[str] = []
        for test, kind, n in dict.fromkeys(self.starts):  # each (test, kind, size) once
            if kind == "engines" and n > allowed.engines:
                found.append(f"{test}: started {n} ipyparallel engines (at most "
                             f"{allowed.engines})")
            elif kind == "kernel" and not allowed.kernels:
                found.append(f"{test}: started a Jupyter kernel")
            elif kind == "ranks" and n > allowed.max_ranks:
                found.append(f"{test}: started a {n}-rank pool (at most {allowed.max_ranks})")
            elif kind == "pool use" and n > allowed.max_ranks:
                found.append(f"{test}: ran on a {n}-rank pool (at most {allowed.max_ranks})")
        return found

    def summary(self) -> str:
        pools = Counter(n for _, kind, n in self.starts if kind == "ranks")
        engines = [n for _, kind, n in self.starts if kind == "engines"]
        kernels = sum(1 for _, kind, _ in self.starts if kind == "kernel")
        pool_text = ", ".join(f"{c} of {n}" for n, c in sorted(pools.items())) or "none"
        return (f"rank pools started: {pool_text}; ipyparallel engine sets: {len(engines)} "
                f"({sum(engines)} engines); Jupyter kernels: {kernels}")


LOG = StartLog()


def _counting(cls: type, name: str, kind: str, size) -> None:
    """Wrap ``cls.name`` so each call records ``kind`` with ``size(self, *args, **kw)`` ranks."""
    original = getattr(cls, name)
    if getattr(original, "_tier_counted", False):
        return
    if _is_async(original):
        @functools.wraps(original)
        async def wrapper(self, *args, **kwargs):
            LOG.record(kind, size(self, *args, **kwargs))
            return await original(self, *args, **kwargs)
    else:
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            LOG.record(kind, size(self, *args, **kwargs))
            return original(self, *args, **kwargs)
    wrapper._tier_counted = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def _is_async(fn) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _install() -> None:
    import ipyparallel
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    from kernels_runtime import testing as launch  # the RankPool harness's public face

    _counting(launch.RankPool, "start", "ranks", lambda self: self.world_size)
    # a session's pools are shared: a test that only runs on one another test started counts too
    _counting(launch.RankPool, "run", "pool use", lambda self, *a, **k: self.world_size)
    _counting(ipyparallel.Cluster, "start_engines", "engines",
              lambda self, n=None, *a, **k: n if n is not None else (self.n or 0))
    _counting(LocalProvisioner, "launch_kernel", "kernel", lambda self, *a, **k: 1)
    original_run_ranks = launch.run_ranks
    if not getattr(original_run_ranks, "_tier_counted", False):
        @functools.wraps(original_run_ranks)
        def run_ranks(fn, world_size, *args, **kwargs):
            LOG.record("ranks", world_size)
            return original_run_ranks(fn, world_size, *args, **kwargs)
        run_ranks._tier_counted = True  # type: ignore[attr-defined]
        launch.run_ranks = run_ranks
        import helpers.distributed as helper
        helper.run_ranks = run_ranks


def pytest_configure(config: pytest.Config) -> None:
    tier = os.environ.get(TIER_ENV)
    if tier is not None and tier not in TIERS:
        raise pytest.UsageError(f"{TIER_ENV}={tier!r}: expected one of {', '.join(TIERS)}")
    _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    LOG.current = item.nodeid
    yield
    LOG.current = "(session teardown)"


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    tier = os.environ.get(TIER_ENV)
    terminalreporter.write_line(f"tier {tier or '(none)'}: {LOG.summary()}")
    if tier is None:
        return
    found = LOG.violations(TIERS[tier])
    if found:
        terminalreporter.write_line(
            f"tier {tier} started what it may not ({TIERS[tier]}); mark these tests for the "
            "tier that may (slow or engines: make test; full: make test-full):", red=True)
        for line in found:
            terminalreporter.write_line(f"  {line}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    tier = os.environ.get(TIER_ENV)
    if tier is not None and LOG.violations(TIERS[tier]) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def on_ranks(world: int, *values, **kwargs):
    """``pytest.param(*values)`` marked for the tier that may run a pool of ``world`` ranks:
    up to 2 make test-fast, 4 make test (``slow``), 8 make test-full (``full``)."""
    marks = [] if world <= 2 else [pytest.mark.slow] if world <= 4 else [pytest.mark.full]
    return pytest.param(*(values or (world,)), marks=marks, **kwargs)
