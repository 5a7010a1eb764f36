"""The image's own test: execute a notebook (the quickstart) with nbclient on the image's
Python kernel and check what it printed; the Dockerfile's ``test`` stage runs it as a build step.

Why it exists: no container can be started where the image is built and tested here (podman
builds, but cannot run), and an image that builds is not yet one that runs the examples: a
missing library, a lab extension that is not installed, or ranks that cannot start inside the
image show up only when a notebook runs. So the build runs the quickstart itself, and a failure
stops the build with the failing cell and its traceback (the last lines start ``QUICKSTART``,
which tests/deploy/test_image_build.py quotes).

    python deploy/image/check_quickstart.py notebooks/00_quickstart.ipynb OUT_DIR

OUT_DIR receives the executed notebook and ``verdict.txt`` (the checks that passed).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What the quickstart prints when it worked: its 2-rank all-reduce, its training loop.
EXPECTED = ["rank 0 of 2: [3.0, 3.0, 3.0]", "loss went from"]


def fail(message: str) -> None:
    print(f"QUICKSTART FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def output_text(nb: nbformat.NotebookNode) -> str:
    """Every stream and text/plain output of ``nb``, in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def first_error(nb: nbformat.NotebookNode) -> str | None:
    """The first cell that ended in an error: its number, its first lines, its traceback."""
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                trace = ANSI.sub("", "\n".join(out.get("traceback", [])))
                head = "\n".join(cell.source.splitlines()[:5])
                return f"cell {i} raised {out['ename']}: {out['evalue']}\n{head}\n{trace[-3000:]}"
    return None


def main(notebook: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", store_widget_state=False,
                            resources={"metadata": {"path": str(notebook.parent)}})
    try:
        client.execute()
    except CellExecutionError:
        pass  # reported below from the notebook itself, with the cell that failed
    finally:
        nbformat.write(nb, out_dir / notebook.name)
    error = first_error(nb)
    if error:
        fail(error)
    text = output_text(nb)
    missing = [e for e in EXPECTED if e not in text]
    if missing:
        fail(f"ran without an error but never printed {missing}; its output ends:\n{text[-2000:]}")
    listing = ANSI.sub("", subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"], check=True, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout)
    if not re.search(r"colossal-workbench\S* .*enabled.*OK", listing):
        fail(f"the lab extension is not installed and enabled:\n{listing}")
    verdict = (f"QUICKSTART PASSED: {notebook.name}, {len(nb.cells)} cells, "
               f"printed {EXPECTED}; lab extension enabled\n")
    (out_dir / "verdict.txt").write_text(verdict)
    print(verdict, end="")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
