"""The expert-load panel: tokens routed to each expert of each MoE layer, as a heatmap.

A mixture of experts trains well when its router spreads tokens over the experts, and an
expert-parallel step waits for the rank of the busiest expert; so the panel answers "which
experts get the tokens, layer by layer, and how uneven is it?" while the cell trains. One
heatmap: rows are the MoE layers in forward order ("layer 3" for ``model.layers.3.mlp``, else
the module path), columns the experts by global index, colour the tokens of the last step,
summed over ranks. Each rank publishes the tokens it routed itself (its own data-parallel
share, ``kernels_runtime.telemetry.expert_load``), so the sum is the whole step's load, each
(token, choice) once. The title gives the step and the imbalance (max / mean over a layer's
experts, 1.0 balanced) of the worst layer and the mean over layers, from the summed counts.

Ranks publish at their own pace, so the sum may join one rank's step N with another's N-1
for a moment while training runs; the title names both steps when they differ. The panel
shows once some rank has published expert load in this cell (telemetry forgets it when a cell
starts). Traces are plain dicts, no plotly, so the notebook's figure and the lab's dashboard
page (through the pool-state file) draw the very same heatmap.
"""

from __future__ import annotations

import re
from typing import Any

from kernels_runtime.telemetry.expert_load import imbalance
from workbench.ui.dashboard.history import RunHistory

TITLE = "expert load"
TRACE = "expert load: tokens"
_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")


def label(path: str) -> str:
    """A layer's row label: "layer 3" for ``model.layers.3.mlp``, else the path itself."""
    match = _LAYER.search(path)
    return f"layer {match.group(1)}" if match else path


def summed(blocks: dict[int, dict[str, Any]]) -> tuple[list[str], list[list[int]]]:
    """(layer paths, (layers, experts) counts summed over ranks): layers in the first rank's
    forward order (another rank's extra layers after them), a row as long as its widest."""
    rows: dict[str, list[int]] = {}
    for block in blocks.values():
        for path, counts in zip(block.get("layers", []), block.get("counts", [])):
            row = rows.setdefault(path, [])
            row.extend([0] * (len(counts) - len(row)))
            for e, c in enumerate(counts):
                row[e] += int(c)
    return list(rows), list(rows.values())


def expert_load_traces(history: RunHistory, last: int | None = None
                       ) -> dict[str, dict[str, Any]]:
    """``{trace name: plotly trace properties, "type" included}``: the heatmap; empty while no
    rank published expert load in this cell. ``last`` is accepted for the pool-state file's
    panels and unused: the heatmap has no time series to bound."""
    paths, counts = summed(history.expert_loads())
    if not paths:
        return {}
    experts = max(len(row) for row in counts)
    z = [row + [0] * (experts - len(row)) for row in counts]  # (layers, experts)
    share = [[f"{c / sum(row):.1%}" if sum(row) else "n/a" for c in row] for row in z]
    return {TRACE: {
        "type": "heatmap", "z": z, "x": list(range(experts)), "y": [label(p) for p in paths],
        "customdata": share, "colorscale": "Viridis", "zmin": 0,
        "colorbar": {"title": {"text": "tokens"}},
        "hovertemplate": ("%{y}, expert %{x}: %{z:,} tokens (%{customdata} of the layer's)"
                          "<extra></extra>")}}


def expert_load_title(history: RunHistory) -> str:
    """The panel's title: the step(s) shown, the ranks summed and the imbalance."""
    blocks = history.expert_loads()
    paths, counts = summed(blocks)
    if not paths:
        return f"{TITLE} (no expert-parallel step in this cell)"
    steps = sorted({int(b.get("step", 0)) for b in blocks.values()})
    step = f"step {steps[-1]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    ratios = [imbalance(row) for row in counts]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    ranks = f"{len(blocks)} rank{'s' if len(blocks) > 1 else ''}"
    return (f"{TITLE} · tokens per expert, {step}, {ranks} · imbalance (max/mean) "
            f"{ratios[worst]:.2f} in {label(paths[worst])}, mean "
            f"{sum(ratios) / len(ratios):.2f} over {len(ratios)} layers")


def expert_load_height(history: RunHistory) -> int:
    """Pixels for the heatmap: about 28 per layer, at least 260."""
    return max(260, 140 + 28 * len(summed(history.expert_loads())[0]))


def expert_load_layout(history: RunHistory) -> dict[str, Any]:
    """Title and axes (experts across, layers down in forward order). No size, margins or
    legend: each page sets its own."""
    return {
        "title": {"text": expert_load_title(history), "font": {"size": 13}},
        "xaxis": {"title": {"text": "expert"}, "dtick": 1},
        "yaxis": {"title": {"text": "MoE layer"}, "type": "category", "autorange": "reversed"},
    }
