"""One look: every figure follows the lab's theme, one colour per rank, units on axes and hovers.

What is protected: every builder (the notebook's live figure and its panels, the curves panel,
``workbench.compare``, the tuner's figures) draws theme-neutral figures (transparent paper and
plot, mid-grey text and grid) marked with ``layout.meta.workbench``, the mark the JupyterLab
extension keys its restyling on (``extension/src/theme.ts``); a rank has the same colour in
every panel that draws ranks, from the one palette function ``style.colour``; bytes are printed
with a unit on axes and in MiB in hovers; and the lab's dashboard page holds the very palette
tables of ``style.py``. No browser, no ranks (the browser test switches the lab to dark).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels_runtime.telemetry import TELEMETRY_KEY, Telemetry
from workbench.planner import predict
from workbench.tuner.figures import memory_figure, time_figure
from workbench.ui.dashboard import style
from workbench.ui.dashboard.compare import compare
from workbench.ui.dashboard.figures import build_curve_figure, build_figure
from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.style import colour, size

DASHBOARD_JS = Path(style.__file__).parents[1] / "lab" / "static" / "dashboard.js"
SPEC = dict(hidden=64, layers=2, heads=2, vocab=256, seq=64, batch=4, model_type="gpt2",
            positions=64, activation="gelu_new", attention="sdpa")


def _history(plan: str, differ: bool = False) -> RunHistory:
    """Two ranks, six training steps; with ``differ`` the ranks' losses differ (each drawn)."""
    tels = [Telemetry(None, memory=lambda r=r: {"host_rss": 3 * 2**20 + r}) for r in range(2)]
    history = RunHistory([0, 1], label=f'%%colossal --plan "{plan}"', plan=plan)
    for step in range(6):
        for r, tel in enumerate(tels):
            loss = 2.0 / (step + 1) + (0.1 * r if differ else 0.0)
            tel.record_train(loss, True, 0.5 + step, 1e-3, None)
        history.ingest({r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": step, "time": 0.1 * step,
                                            "throughput": {"tokens_per_s": 100.0 + r}}}
                        for r, tel in enumerate(tels)})
    return history


def _themed(fig) -> None:
    layout = fig.layout
    assert layout.meta == style.MARK
    assert layout.paper_bgcolor == layout.plot_bgcolor == "rgba(0, 0, 0, 0)"
    assert layout.font.color == style.NEUTRAL_TEXT
    axes = [k for k in fig.to_plotly_json()["layout"] if re.fullmatch(r"[xy]axis\d*", k)]
    assert axes and all(layout[k].gridcolor == style.NEUTRAL_LINE for k in axes)


def test_every_builder_draws_theme_neutral_marked_figures() -> None:
    history = _history("dp=2")
    p = predict("dp=2", SPEC, "H100", world_size=2)
    figures = [build_figure(history, widget=False), build_curve_figure(history, widget=False),
               compare(history, _history("dp=2 zero=1")), time_figure(p),
               memory_figure(p, {"device": None, "host": None, "disk": None})]
    for fig in figures:
        _themed(fig)


def test_a_rank_has_one_colour_in_every_panel() -> None:
    assert colour(1) == colour("rank 1") != colour(0)
    assert colour("run 1") == colour(0) and colour("device") == style.NAMED["device"]
    assert colour("comm: dp") == colour("comm: dp")  # stable, not Python's per-process hash
    with pytest.raises(TypeError, match="not a bool"):
        colour(True)
    with pytest.raises(ValueError, match=">= 0"):
        colour(-1)
    history = _history("dp=2", differ=True)
    main = build_figure(history, widget=False)
    curves = build_curve_figure(history, widget=False)
    for r in (0, 1):
        tokens = next(t for t in main.data if t.name == f"tokens/s: rank {r}")
        loss = next(t for t in curves.data if t.name == f"curves: loss (rank {r}) (smoothed)")
        assert tokens.line.color == loss.line.color == colour(r)


def test_units_on_axes_and_hovers() -> None:
    fig = build_figure(_history("dp=2"), widget=False)
    assert fig.layout.yaxis.ticksuffix == "B" and fig.layout.yaxis2.ticksuffix == " s"
    host = next(t for t in fig.data if t.name == "memory: host")
    assert list(host.customdata) == [size(3 * 2**20), size(3 * 2**20 + 1)] == ["3.0 MiB"] * 2
    assert "B (%{customdata})" in host.hovertemplate
    tokens = next(t for t in fig.data if t.name == "tokens/s: rank 0")
    assert "tokens/s" in tokens.hovertemplate and " s" in tokens.hovertemplate
    assert style.rate(25e9) == "25.00 GB/s"


def test_the_dashboard_page_holds_the_same_palette() -> None:
    js = DASHBOARD_JS.read_text(encoding="utf-8")
    ranks = re.search(r"const RANK_COLOURS = \[(.*?)\];", js, re.S).group(1)
    assert re.findall(r"'(#[0-9a-f]{6})'", ranks) == list(style.RANK_COLOURS)
    named = re.search(r"const NAMED = \{(.*?)\};", js, re.S).group(1)
    for key, value in re.findall(r"(\w+): '(#[0-9a-f]{6})'", named):
        assert style.NAMED[key] == value, key
    assert "h * 31 + name.charCodeAt(i)) % 4294967296" in js  # style.name_hash, in JS
