"""What a pool and its cells publish about themselves, and to whom: the pool layer's side of
the JupyterLab sidebar and live page.

Why here and not in ``workbench.ui.lab.state``: the pool and the cell runner must not import the
ui above them. What they publish is pool state (a lifecycle state, one row per rank, a cell's
start, telemetry and end), so its shape lives in the pool layer: the ``StatePublisher``
protocol and the rank row. How it is drawn and written (a JSON file for the Jupyter server,
with the dashboard's plotly traces) is ui, in ``workbench.ui.lab.state.PoolStateFile``, which
implements the protocol.

Who publishes: a ``Pool`` takes a publisher as ``Pool(state=...)``; without one it asks the
factory the ui registered (``publish_pool_state_with``; ``workbench/__init__.py`` registers
the lab's file writer), and without a registration it publishes nothing (``Unpublished``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class StatePublisher(Protocol):
    """Receives the pool's state changes and the running cell's telemetry; never raises."""

    def update(self, state: str | None = None, **fields: Any) -> None: ...

    def cell_started(self, label: str, ranks: list[int]) -> None: ...

    def cell_data(self, data: dict[int, dict[str, Any]], final: bool = False) -> None: ...

    def cell_finished(self, failed: bool = False) -> None: ...

    def serving_data(self, history: Any, endpoint: Any, final: bool = False) -> None:
        """A serving endpoint's figures (``workbench.serving.display``)."""

    def remove(self) -> None: ...


class Unpublished:
    """The publisher of a pool nobody watches: every call does nothing."""

    enabled = False
    pool_id = ""
    path = None

    def update(self, state: str | None = None, **fields: Any) -> None:
        pass

    def cell_started(self, label: str, ranks: list[int]) -> None:
        pass

    def cell_data(self, data: dict[int, dict[str, Any]], final: bool = False) -> None:
        pass

    def cell_finished(self, failed: bool = False) -> None:
        pass

    def serving_data(self, history: Any, endpoint: Any, final: bool = False) -> None:
        pass

    def remove(self) -> None:
        pass


PublisherFactory = Callable[[bool | None], StatePublisher]
_factory: PublisherFactory = lambda enabled: Unpublished()  # noqa: E731


def publish_pool_state_with(factory: PublisherFactory) -> None:
    """Make ``factory(publish_state)`` the publisher of every ``Pool`` created without one.
    The ui layer calls this once (it knows where the state goes; the pool does not)."""
    global _factory
    _factory = factory


def new_publisher(enabled: bool | None) -> StatePublisher:
    """A publisher from the registered factory; ``enabled`` is ``Pool(publish_state=...)``."""
    return _factory(enabled)


def tiers(memory: dict[str, Any]) -> dict[str, int]:
    """Runtime memory counters -> bytes per tier (device / host / disk)."""
    return {
        "device": int(memory.get("device_allocated", 0) or 0),
        "host": int(memory.get("host_rss", 0) or 0),
        "disk": int(memory.get("disk_spill", 0) or 0),
    }


def rank_row(info: dict[str, Any], rank: int, engine_id: int, state: str) -> dict[str, Any]:
    """One rank of the published state, from ``RankSession.describe()`` output."""
    return {
        "rank": rank, "engine_id": engine_id, "host": info.get("host", ""),
        "pid": info.get("pid"), "device": info.get("device", ""),
        "backend": info.get("backend", ""), "state": state,
        "memory": tiers(info.get("memory", {})),
    }


def rank_rows(ranks_info: list[dict[str, Any]], engine_ids: list[int],
              busy: frozenset[int] = frozenset(),
              dead: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """Every rank's row: dead, busy or idle."""
    return [rank_row(ranks_info[r], r, e, "dead" if r in dead else "busy" if r in busy else "idle")
            for r, e in enumerate(engine_ids) if r < len(ranks_info)]
