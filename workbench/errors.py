"""Errors the notebook sees, each saying what went wrong on which rank and what to do next.

A failing distributed cell produces one exception in the notebook, not one per rank: ranks with
an identical remote traceback are grouped, so eight ranks hitting the same bug print it once.
IPython calls ``_render_traceback_`` to show it, so the user sees the remote tracebacks instead
of the workbench's own waiting loop.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field


class PoolError(RuntimeError):
    """The pool cannot do what was asked (not started, a rank is dead, start failed)."""


@dataclass
class RankError:
    """What went wrong on one rank."""

    rank: int
    kind: str  # "error" | "died" | "interrupted"
    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)

    def headline(self) -> str:
        return f"{self.ename}: {self.evalue}" if self.evalue else self.ename


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL = re.compile(r"Cell In\[\d+\]|<ipython-input-\d+-[0-9a-f]+>")


def _comparable(traceback: list[str]) -> tuple[str, ...]:
    """Traceback lines without colours and per-engine cell numbers, for grouping ranks."""
    return tuple(_CELL.sub("Cell", _ANSI.sub("", line)) for line in traceback)


def describe_exit(exit_code: int | None) -> str:
    """'killed by SIGKILL', 'exited with status 3', or 'exit status unknown'."""
    if exit_code is None:
        return "exit status unknown"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exited with status {exit_code}"


def _rank_list(ranks: list[int]) -> str:
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(map(str, sorted(ranks)))}"


class RankFailureError(RuntimeError):
    """A ``%%colossal`` cell failed on one or more ranks. ``hint`` (what to do next: restart
    the pool, the plans that fit a rank out of memory) follows the summary in ``str()`` too,
    for scripts that print the error rather than IPython's rendering of it."""

    def __init__(self, failures: list[RankError], hint: str = "") -> None:
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.hint = hint
        super().__init__(self.summary() + (f"\n{hint}" if hint else ""))

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    def groups(self) -> list[tuple[list[int], RankError]]:
        """Failures with the same kind, error and traceback, grouped by rank."""
        grouped: dict[tuple, tuple[list[int], RankError]] = {}
        for f in self.failures:
            key = (f.kind, f.ename, f.evalue, _comparable(f.traceback))
            grouped.setdefault(key, ([], f))[0].append(f.rank)
        return list(grouped.values())

    def summary(self) -> str:
        parts = [f"[{_rank_list(r)}] {f.headline()}" for r, f in self.groups()]
        return f"cell failed on {_rank_list(self.ranks)}: " + "; ".join(parts)

    def _render_traceback_(self) -> list[str]:
        lines = [f"RankFailureError: cell failed on {_rank_list(self.ranks)}"]
        for ranks, f in self.groups():
            lines.append("")
            lines.append(f"---- {_rank_list(ranks)}: {f.headline()} ----")
            lines.extend(f.traceback or [f.headline()])
        if self.hint:
            lines += ["", self.hint]
        return lines
