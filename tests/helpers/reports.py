"""Read the plot data back out of a standalone HTML report written by ``Dashboard.to_html``."""

from __future__ import annotations

import json
from pathlib import Path


def report_traces(path: str | Path) -> dict[str, tuple[list, list]]:
    """``{trace name: (x, y)}`` of the first ``Plotly.newPlot`` call in the file.

    plotly writes ``Plotly.newPlot("<div id>", [traces], {layout}, {config})``; the JSON it
    embeds escapes "/" (``tokens\\/s``), so the traces are decoded rather than searched for."""
    text = Path(path).read_text()
    call = text.index("Plotly.newPlot(")
    start = text.index("[", text.index(",", call))
    traces, _ = json.JSONDecoder().raw_decode(text, start)
    return {t["name"]: (t.get("x", []), t.get("y", [])) for t in traces}
