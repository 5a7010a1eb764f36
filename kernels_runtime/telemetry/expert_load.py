"""Expert load of one rank: tokens routed to each expert of each MoE layer, in the last step.

Why: an expert-parallel step waits for the rank of the busiest expert, and a router that sends
most tokens to a few experts trains the others little, so the load per expert is what a user
watches while a mixture of experts trains (the heatmap of
``workbench/ui/dashboard/expert_load.py``).

Where the counts come from: an expert-parallel MoE layer (``kernels_runtime.parallel.expert``)
reads its per-expert row counts on the host to size its all-to-all anyway; it hands that list
to ``record``, so counting costs no extra collective and no extra device sync. Counts are rows
this rank sent (its own tokens, each counted top-k times, once per chosen expert), by global
expert index, so summing the ranks' matrices gives the whole step's load.

Steps: ``record`` adds into the step under way (all its micro-batches); ``end_step`` (at the
telemetry's ``tick``) makes it the last step's; ``begin_step`` (a training step starts, or a
pause) forgets counts from forwards outside a step, such as ``eval_step``'s. The published
block, under the snapshot's ``expert_load`` key, or None before the first counted step of the
cell::

    step        steps counted in this cell (the last one's number)
    layers      the MoE layers' names (module paths), in forward order: the matrix's rows
    counts      [[tokens routed to expert e of layer l] for each layer]   (layers x experts)
    tokens      per layer, the sum of its row: this rank's tokens x top-k
    imbalance   per layer, max / mean over its experts (1.0: balanced)

No torch here, as for the rest of the telemetry package: counts arrive as Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def imbalance(counts: Sequence[int]) -> float:
    """max / mean of one layer's tokens per expert: 1.0 when balanced, E when one expert takes
    every token; 0.0 for a layer that routed no token."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


class ExpertLoad:
    """Tokens per expert per MoE layer of one rank: the step under way and the last one."""

    def __init__(self) -> None:
        self.new_cell()

    def new_cell(self) -> None:
        """A new cell starts: nothing counted yet (its heatmap shows its own model only)."""
        self.steps = 0
        self.last: dict[str, list[int]] | None = None
        self._pending: dict[str, list[int]] = {}

    def record(self, layer: str, counts: Sequence[int]) -> None:
        """One forward of ``layer``: ``counts[e]`` tokens routed to expert e (global index),
        added to the step under way (a layer runs once per micro-batch)."""
        pending = self._pending.get(layer)
        if pending is None:
            self._pending[layer] = [int(c) for c in counts]
            return
        if len(pending) != len(counts):
            raise ValueError(f"expert load of {layer}: {len(counts)} experts recorded after "
                             f"{len(pending)} in the same step; give each MoE layer its own "
                             "name (ExpertParallelMoE(..., name=path))")
        for e, c in enumerate(counts):
            pending[e] += int(c)

    def begin_step(self) -> None:
        """A step starts: counts recorded since the last step (forwards outside any step, such
        as evaluation) are not part of it."""
        self._pending = {}

    def end_step(self) -> None:
        """The step under way ended: its counts become the last step's (a step that ran no MoE
        layer leaves the previous one shown)."""
        if self._pending:
            self.steps += 1
            self.last, self._pending = self._pending, {}

    def block(self) -> dict[str, Any] | None:
        """The published block (see the module docstring), or None: no step counted."""
        if self.last is None:
            return None
        rows = list(self.last.values())
        return {"step": self.steps, "layers": list(self.last), "counts": [list(r) for r in rows],
                "tokens": [sum(r) for r in rows], "imbalance": [imbalance(r) for r in rows]}
