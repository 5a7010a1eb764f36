"""Execute a notebook headless with nbclient, echoing each cell's text output as it finishes.

Used by ``workbench demo``/``workbench run`` and by the tests, so the notebooks users open are
the notebooks CI executes. Widget state is not stored (it would add megabytes per notebook).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

import nbformat
from nbclient import NotebookClient


def _output_text(output: dict[str, Any]) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind in ("execute_result", "display_data"):
        text = output.get("data", {}).get("text/plain", "")
        return text + ("\n" if text and not text.endswith("\n") else "")
    if kind == "error":
        return "\n".join(output.get("traceback", [])) + "\n"
    return ""


def run_notebook(
    path: str | os.PathLike[str],
    *,
    timeout_s: int = 600,
    echo: TextIO | None = sys.stdout,
    save_to: str | os.PathLike[str] | None = None,
    kernel_name: str = "python3",
    workdir: str | os.PathLike[str] | None = None,
) -> nbformat.NotebookNode:
    """Run every cell of ``path`` in a fresh kernel (started in ``workdir``, default: the
    notebook's folder); raise on the first error."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    client = NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name=kernel_name,
        store_widget_state=False,
        resources={"metadata": {"path": str(Path(workdir or path.parent).resolve())}},
    )
    if echo is not None:
        def on_cell_executed(cell: Any, cell_index: int, **_: Any) -> None:
            for output in cell.get("outputs", []):
                echo.write(_output_text(output))
            echo.flush()

        client.on_cell_executed = on_cell_executed
    client.execute()
    if save_to is not None:
        nbformat.write(nb, save_to)
    return nb
