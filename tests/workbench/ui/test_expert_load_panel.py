"""The expert-load heatmap shows what the ranks published: tokens per expert per layer, summed.

What is protected: fed the snapshots two real ``ep=2`` ranks published while training
(``helpers.expert_load``: a tiny Mixtral, 4 experts, top-2, 2 MoE layers), a shown dashboard
gains the heatmap as a new figure when the first expert load arrives, and at every poll its
cells equal the ranks' published counts summed (layers down, experts across), which are the
tokens per expert recomputed in one process; it moves in place to the next step's counts; the
title gives the step and the worst layer's imbalance (max / mean) of the summed counts, and
both steps while the ranks are a step apart. The lab page's pool-state file carries the very
same heatmap, none before any expert load; the report holds it.
"""

from __future__ import annotations

import pytest

from kernels_runtime.telemetry import TELEMETRY_KEY
from kernels_runtime.telemetry.expert_load import imbalance
from workbench.ui.dashboard import Dashboard, RunHistory
from workbench.ui.dashboard.expert_load import TRACE, label
from workbench.ui.dashboard.figures import build_expert_load_figure
from workbench.ui.lab.state import _cell_block

from helpers.expert_load import EXPERTS, LAYERS, TOP_K, ep2_expert_load


def _summed(*matrices: list[list[int]]) -> list[list[int]]:
    return [[sum(m[layer][e] for m in matrices) for e in range(EXPERTS)]
            for layer in range(LAYERS)]


def _heatmap(fig) -> tuple[list[list[int]], list, list]:
    (trace,) = [t for t in fig.data if t.name == TRACE]
    return [list(row) for row in trace.z], list(trace.x), list(trace.y)


def _poll(history: RunHistory, runs: list[dict], index: dict[int, int]) -> None:
    """One notebook poll: rank r's ``index[r]``-th published snapshot."""
    assert history.ingest({r: {TELEMETRY_KEY: runs[r]["published"][i]}
                           for r, i in index.items()})


@pytest.fixture(scope="module")
def runs(ranks) -> list[dict]:
    return ep2_expert_load(ranks)


def test_heatmap_joins_and_equals_the_published_counts_summed_over_ranks(runs, tmp_path):
    history = RunHistory([0, 1], label="ep=2 training")
    view = Dashboard(history)
    assert view.widget.children == (view.figure,)  # shown before any expert load
    assert _cell_block(history, running=True)["expert_load"] is None

    _poll(history, runs, {0: 0, 1: 0})  # the first step, as each rank published it
    view.refresh()
    # the curves join on top (the ranks trained), the heatmap under the main figure
    assert view.widget.children == (view.curves_box, view.figure, view.expert_load_figure)
    z, x, y = _heatmap(view.expert_load_figure)
    assert z == _summed(runs[0]["first"], runs[1]["first"])
    assert x == list(range(EXPERTS)) and y == [f"layer {i}" for i in range(LAYERS)]

    _poll(history, runs, {0: -1, 1: 0})  # rank 0 a step ahead
    view.refresh()
    assert "steps 1-2, 2 ranks" in view.expert_load_figure.layout.title.text

    _poll(history, runs, {0: -1, 1: -1})  # the last step on both: updated in place
    view.refresh()
    z, _, _ = _heatmap(view.expert_load_figure)
    published = [[s["expert_load"] for s in run["published"]][-1]["counts"] for run in runs]
    assert z == _summed(*published) == _summed(runs[0]["expected"], runs[1]["expected"])
    tokens = sum(run["tokens"] for run in runs) * TOP_K
    assert [sum(row) for row in z] == [tokens] * LAYERS
    ratios = [imbalance(row) for row in z]
    worst = max(range(LAYERS), key=ratios.__getitem__)
    assert view.expert_load_figure.layout.title.text == (
        f"expert load · tokens per expert, step 2, 2 ranks · imbalance (max/mean) "
        f"{ratios[worst]:.2f} in layer {worst}, mean {sum(ratios) / LAYERS:.2f} over "
        f"{LAYERS} layers")
    assert _heatmap(build_expert_load_figure(history, widget=False))[0] == z  # same as fresh

    panel = _cell_block(history, running=True)["expert_load"]  # the lab page's
    assert [t["z"] for t in panel["traces"]] == [z]
    assert panel["title"] == view.expert_load_figure.layout.title.text
    report = view.to_html(tmp_path / "moe.html", include_plotlyjs="cdn").read_text()
    assert report.count("Plotly.newPlot") == 3 and '"heatmap"' in report  # main, curves, load


def test_layer_labels_name_the_layer_index_else_the_path() -> None:
    assert label("model.layers.11.mlp") == "layer 11"
    assert label("model.layers.3.block_sparse_moe") == "layer 3"
    assert label("encoder.moe") == "encoder.moe"
