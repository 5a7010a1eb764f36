"""The inference panel: how fast an engine generates, how long its queue is, how full its cache.

Serving trades three things against each other: tokens per second, requests kept waiting and
KV-cache blocks. One figure, three plots side by side:

- left, generated tokens/s over time, all replicas together (and each replica's own line when
  there are several): the ranks' ``throughput.tokens_per_s``, which an engine's steps count in
  generated tokens (``kernels_runtime.inference.engine``);
- middle, the queue over time: requests running, waiting and swapped out to the host, summed
  over replicas;
- right, each replica's paged KV cache now, stacked to its ``blocks_total``: blocks used by one
  request, blocks shared by several (prefix sharing; part of the used ones) and free blocks,
  with the cache's utilisation (tokens held per slot allocated, over the engine's steps),
  preemptions and prefix-hit blocks in the hover text.

Counting replicas, not ranks: an engine's figures are per replica (``Engine.stats``), and the
tp and pp ranks of one replica keep identical schedulers, so every one of them publishes the
same queue, blocks and generated tokens. Summing over ranks would count a tp=2 replica twice;
so each replica is counted once, labelled by its ``replica`` (dp coordinate), through the rank
its block marks as ``leader`` (its first tp and pp rank; until that one has published, the
lowest rank of the replica that has). A block without these fields (an older engine) stands
for a replica of its own, labelled by its rank. The title gives the latest totals over
replicas; utilisation there is the mean over replicas, preemptions and prefix hits the
engines' cumulative counts, and, once some request speculated, the draft tokens accepted of
those verified (``speculation.py``).

The panel shows once some rank's engine has stepped during the cell: telemetry forgets the
block when a cell starts (``Telemetry.pause``), so a block seen belongs to this cell
(``RunHistory.inferences``). Traces are plain dicts, no plotly, so the notebook's figure and
the lab's dashboard page (through the pool-state file) draw the very same ones; the three plots
share one layout through three pairs of axes (domains), which plotly.py and plotly.js both read.
"""

from __future__ import annotations

from typing import Any

from workbench.ui.dashboard.history import RunHistory
from workbench.ui.dashboard.style import NEUTRAL_TEXT, colour

TITLE = "inference engine"
TOKENS, QUEUE, KV = "generated tokens/s: ", "queue: ", "KV blocks: "  # trace name prefixes
QUEUES = (("running", colour("device")), ("waiting", colour("host")),
          ("swapped", colour("disk")))
BLOCKS = (("used (unshared)", "#4c78a8"), ("shared", "#54a24b"), ("free", "#d8d8d8"))


def replicas(blocks: dict[int, dict[str, Any] | None]) -> dict[str, tuple[int, dict[str, Any]]]:
    """``{replica label: (rank, block)}``: the one rank that stands for each replica, its
    leader or else its lowest rank with a block (module docstring), in replica order."""
    ranked = sorted(((r, b) for r, b in blocks.items() if isinstance(b, dict)),
                    key=lambda rb: (not rb[1].get("leader", True), rb[0]))
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for rank, block in ranked:
        replica = block.get("replica")
        out.setdefault(f"replica {replica}" if replica is not None else f"rank {rank}",
                       (rank, block))
    return dict(sorted(out.items(), key=lambda item: _order(item[0])))


def series(history: RunHistory) -> tuple[list[float], dict[str, list[float]],
                                         dict[str, list[int]]]:
    """(times, {replica: generated tokens/s}, {queue: requests summed over replicas}) at each
    point where some replica's engine had stepped; a replica not yet stepped counts 0."""
    rows = []
    for point in history.points:
        stood = replicas({r: s.get("inference") for r, s in point.ranks.items()})
        if stood:
            rows.append((point.t, {label: (point.ranks[rank].get("tokens_per_s", 0.0), block)
                                   for label, (rank, block) in stood.items()}))
    labels = sorted({label for _, row in rows for label in row}, key=_order)
    tokens = {label: [row[label][0] if label in row else 0.0 for _, row in rows]
              for label in labels}
    queue = {name: [sum(int(b.get(name, 0) or 0) for _, b in row.values()) for _, row in rows]
             for name, _ in QUEUES}
    return [t for t, _ in rows], tokens, queue


def _order(label: str) -> tuple[str, int]:
    kind, _, number = label.partition(" ")
    return kind, int(number) if number.isdigit() else 0


def _kv_bars(latest: dict[str, tuple[int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each replica's blocks now, stacked to its total; its figures in the hover text."""
    labels = list(latest)
    blocks = [block for _, block in latest.values()]
    used = [int(b.get("blocks_used", 0)) for b in blocks]
    shared = [int(b.get("blocks_shared", 0)) for b in blocks]
    free = [int(b.get("blocks_free", 0)) for b in blocks]
    # per bar: used, total, utilisation in %, preemptions, prefix-hit blocks, tokens held
    custom = [[u, int(b.get("blocks_total", 0)), _percent(b.get("kv_utilisation")),
               int(b.get("preemptions", 0)), int(b.get("prefix_hit_blocks", 0)),
               int(b.get("kv_tokens", 0))] for u, b in zip(used, blocks)]
    hover = ("%{x}: %{y:,} blocks WHAT<br>%{customdata[0]:,} of %{customdata[1]:,} blocks used, "
             "%{customdata[5]:,} tokens held<br>utilisation %{customdata[2]}<br>"
             "%{customdata[3]:,} preemptions, %{customdata[4]:,} prefix-hit blocks"
             "<extra></extra>")
    values = {"used (unshared)": [u - s for u, s in zip(used, shared)], "shared": shared,
              "free": free}
    what = {"used (unshared)": "used by one request", "shared": "shared by several requests",
            "free": "free"}
    return {f"{KV}{name}": {"type": "bar", "x": labels, "y": values[name], "xaxis": "x3",
                            "yaxis": "y3", "marker": {"color": colour}, "customdata": custom,
                            "hovertemplate": hover.replace("WHAT", what[name])}
            for name, colour in BLOCKS}


def _percent(fraction: Any) -> str:
    return f"{100 * fraction:.0f}%" if isinstance(fraction, (int, float)) else "n/a"


def inference_traces(history: RunHistory, last: int | None = None) -> dict[str, dict[str, Any]]:
    """``{trace name: plotly trace properties, "type" included}``; empty while no engine has
    stepped in this cell. ``last`` keeps only the last points of the series (the pool-state
    file's bound)."""
    latest = replicas(history.inferences())
    if not latest:
        return {}
    times, tokens, queue = series(history)
    start = -last if last else 0
    times = times[start:]
    traces: dict[str, dict[str, Any]] = {}
    total = [sum(ys) for ys in zip(*tokens.values())][start:]
    traces[f"{TOKENS}all replicas"] = {
        "type": "scatter", "mode": "lines+markers", "x": times, "y": total,
        "xaxis": "x", "yaxis": "y", "line": {"color": NEUTRAL_TEXT},
        "hovertemplate": "%{y:,.1f} generated tokens/s (all replicas)<extra></extra>"}
    if len(tokens) > 1:
        for label, y in tokens.items():
            traces[f"{TOKENS}{label}"] = {
                "type": "scatter", "mode": "lines", "x": times, "y": y[start:],
                "xaxis": "x", "yaxis": "y",
                "line": {"dash": "dot", "color": colour(latest[label][0])},
                "hovertemplate": f"{label}: %{{y:,.1f}} generated tokens/s<extra></extra>"}
    for name, hue in QUEUES:
        traces[f"{QUEUE}{name}"] = {
            "type": "scatter", "mode": "lines", "x": times, "y": queue[name][start:],
            "xaxis": "x2", "yaxis": "y2", "line": {"color": hue, "shape": "hv"},
            "hovertemplate": f"%{{y}} requests {name} (all replicas)<extra></extra>"}
    traces.update(_kv_bars(latest))
    return traces


def inference_title(history: RunHistory) -> str:
    """The panel's title: the latest generated tokens/s, queue and KV blocks over replicas, on
    two lines (a notebook's figure is about 700 pixels wide)."""
    latest = replicas(history.inferences())
    if not latest:
        return f"{TITLE} (no engine stepped in this cell)"
    blocks = [b for _, b in latest.values()]
    tokens = sum(history.latest[rank].get("throughput", {}).get("tokens_per_s", 0.0)
                 for rank, _ in latest.values())

    def total(key: str) -> int:
        return sum(int(b.get(key, 0) or 0) for b in blocks)

    used = [b["kv_utilisation"] for b in blocks
            if isinstance(b.get("kv_utilisation"), (int, float))]
    utilised = _percent(sum(used) / len(used)) if used else "n/a"
    count = f"{len(latest)} replica{'s' if len(latest) > 1 else ''}"
    return (f"{TITLE} · {tokens:,.0f} generated tokens/s · {total('running')} running, "
            f"{total('waiting')} waiting, {total('swapped')} swapped ({count})<br>KV "
            f"{total('blocks_used'):,}/{total('blocks_total'):,} blocks used "
            f"({total('blocks_shared'):,} shared), {utilised} utilised · "
            f"{total('preemptions'):,} preemptions · {total('prefix_hit_blocks'):,} prefix-hit "
            f"blocks{_speculation(total('spec_accepted_tokens'), total('spec_drafted_tokens'))}")


def _speculation(accepted: int, drafted: int) -> str:
    """The title's speculative decoding part; empty while no request speculated."""
    if not drafted:
        return ""
    return f" · speculation: {accepted:,}/{drafted:,} drafts accepted ({accepted / drafted:.0%})"


def inference_layout(history: RunHistory) -> dict[str, Any]:
    """Title and the three plots' axes: tokens/s on x/y (left), the queue on x2/y2 (middle),
    the KV blocks on x3/y3 (right). No size, margins or legend: each page sets its own."""
    time = {"text": "s since the cell started"}
    return {
        "title": {"text": inference_title(history), "font": {"size": 13}},
        "barmode": "stack",
        "xaxis": {"domain": [0.0, 0.28], "anchor": "y", "title": time},
        "yaxis": {"anchor": "x", "rangemode": "tozero",
                  "title": {"text": "generated tokens/s"}},
        "xaxis2": {"domain": [0.36, 0.64], "anchor": "y2", "title": time},
        "yaxis2": {"anchor": "x2", "rangemode": "tozero", "title": {"text": "requests"}},
        "xaxis3": {"domain": [0.74, 1.0], "anchor": "y3"},
        "yaxis3": {"anchor": "x3", "rangemode": "tozero",
                   "title": {"text": "KV blocks (now)"}},
    }
