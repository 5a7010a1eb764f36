"""One look for every figure: the palette, the units and a theme that reads in light and dark.

Why a module of its own: the notebook's live figure, the curves panel, ``compare``, the
tuner's figures, the serving panel and the lab's dashboard page were each picking colours and
unit strings; a rank drawn green in one panel and orange in the next makes a reader match
legends instead of reading plots. So:

- ``colour(key)`` is the one palette function. A rank (``0``, ``"rank 0"``) has one colour in
  every panel; a named series (a memory tier, a step-time part, a curve, a pipeline action)
  has its own; a compared run (``"run 1"``) takes the rank colours in order (a comparison
  figure draws runs, not ranks). ``dashboard.js`` holds the same tables (a test checks it).
- Units: bytes stay bytes in the data (checkable against ``CommStats``), axes print them with
  SI prefixes and a unit (``1.2MB``), hovers print the exact bytes and the binary size
  (``12,582,912 B (12.0 MiB)``); seconds are ``s``, rates ``tokens/s`` and ``GB/s``.
- The theme. The kernel cannot know JupyterLab's theme (light, dark, or one switched while the
  figure is shown), so figures are drawn theme-neutral: transparent paper and plot, mid-grey
  text and translucent grey grid lines, readable on white and on JupyterLab Dark's near-black
  even where no extension runs (a static HTML report, VS Code). ``layout.meta.workbench`` marks
  them; in JupyterLab our extension (``extension/src/theme.ts``, ``extension/style/base.css``)
  tags every marked plot, also those rendered later, and its CSS paints their text, grid and
  axis lines with the lab's ``--jp-*`` colours, so a theme switch restyles shown plots at once
  without a round trip to the kernel. The lab's dashboard page takes the lab's theme from its
  link and from the lab's theme setting (``workbench/ui/lab/static/dashboard.js``).
"""

from __future__ import annotations

from typing import Any

# Tableau 10, reordered so ranks start on hues the tiers do not use; every colour keeps at
# least 3:1 contrast on white and on JupyterLab Dark's background.
RANK_COLOURS = ("#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#ff9da6", "#9d755d",
                "#4c78a8", "#f58518", "#b279a2", "#bab0ac")
NAMED = {
    # memory tiers (dashboard, offload panel, tuner)
    "device": "#4c78a8", "host": "#f58518", "disk": "#b279a2",
    # step-time parts
    "compute": "#4c78a8", "comm": "#f58518", "waiting": "#bab0ac",
    # training curves (one rank drawn; several ranks take their rank colours)
    "loss": "#4c78a8", "eval loss": "#e45756", "lr": "#54a24b", "grad norm": "#b279a2",
    # pipeline actions
    "F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "idle": "#c9c9c9",
}
MARK = {"workbench": "themed"}  # layout.meta of a themed figure: the extension keys on it
NEUTRAL_TEXT = "#888888"  # mid-grey: 3.5:1 on white, 5.6:1 on #111
NEUTRAL_LINE = "rgba(128, 128, 128, 0.28)"
THEME_LAYOUT: dict[str, Any] = {
    "paper_bgcolor": "rgba(0, 0, 0, 0)", "plot_bgcolor": "rgba(0, 0, 0, 0)",
    "font": {"color": NEUTRAL_TEXT}, "colorway": list(RANK_COLOURS), "meta": MARK,
}
THEME_AXIS: dict[str, Any] = {"gridcolor": NEUTRAL_LINE, "zerolinecolor": NEUTRAL_LINE,
                              "linecolor": NEUTRAL_LINE}
BYTES_AXIS: dict[str, Any] = {"tickformat": "~s", "ticksuffix": "B"}  # 1.2MB, 340kB
SECONDS_AXIS: dict[str, Any] = {"ticksuffix": " s"}
MIB, GB = 2**20, 1e9


def colour(key: int | str) -> str:
    """The colour of a rank (``3``, ``"rank 3"``), a compared run (``"run 1"``: the first
    run) or a named series (``NAMED``); any other name gets a stable colour of its own."""
    if isinstance(key, bool):
        raise TypeError("colour takes a rank, 'rank N', 'run N' or a series name, not a bool")
    if isinstance(key, int):
        if key < 0:
            raise ValueError(f"a rank is >= 0, got {key}")
        return RANK_COLOURS[key % len(RANK_COLOURS)]
    head, _, number = key.partition(" ")
    if head in ("rank", "run") and number.isdigit():
        n = int(number) - (1 if head == "run" else 0)
        return RANK_COLOURS[max(n, 0) % len(RANK_COLOURS)]
    if key in NAMED:
        return NAMED[key]
    return RANK_COLOURS[name_hash(key) % len(RANK_COLOURS)]  # stable across runs


def name_hash(name: str) -> int:
    """A stable 32-bit hash of a series name (not Python's ``hash``, which varies per
    process), small enough that ``dashboard.js`` computes the same one."""
    h = 0
    for ch in name:
        h = (h * 31 + ord(ch)) % 2**32
    return h


def size(nbytes: float) -> str:
    """Bytes for a reader, binary prefixes: 1.2 MiB, 274.0 KiB, 12 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def sizes(values: list[float]) -> list[str]:
    """``size`` of each value: a trace's ``customdata`` for a hover in MiB."""
    return [size(v or 0) for v in values]


def rate(bytes_per_s: float) -> str:
    """A bandwidth in GB/s (decimal, as links are rated)."""
    return f"{bytes_per_s / GB:.2f} GB/s"


def themed(fig: Any) -> Any:
    """``fig`` (a plotly figure) drawn theme-neutral and marked for the lab's restyling;
    returns it. Every builder calls it once, on a new figure."""
    fig.update_layout(THEME_LAYOUT)
    fig.update_xaxes(THEME_AXIS)
    fig.update_yaxes(THEME_AXIS)
    return fig


def theme_layout(layout: dict[str, Any]) -> dict[str, Any]:
    """A layout dict with the theme's entries under it (for builders of plain-dict layouts):
    the page's own entries win."""
    return {**THEME_LAYOUT, **layout}
