"""The notebook tests' runner: ``workbench.notebook_runner.run_notebook``, keeping what it ran.

Why: the documentation site (``make docs``, docs/hooks/repo_pages.py) renders each notebook
with outputs, and the only runs of the notebooks are these tests. So every notebook that runs
to the end here is also written, outputs included, to ``artifacts/notebooks/NAME.ipynb``
(written whole then renamed: a docs build running meanwhile reads the old copy or the new one).
A failing notebook writes nothing, so the site keeps the last good run, or the stored notebook.
The copy's consecutive stream outputs are merged and carriage returns applied, as JupyterLab
shows them (a progress bar is one line, not one line per update); the tests read the notebook
as run.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import nbformat
from nbconvert.preprocessors import CoalesceStreamsPreprocessor

from workbench.notebook_runner import run_notebook as _run_notebook

EXECUTED = Path(__file__).resolve().parents[2] / "artifacts" / "notebooks"


def run_notebook(path: str | os.PathLike[str], **options: Any) -> nbformat.NotebookNode:
    """``workbench.notebook_runner.run_notebook(path, **options)``, then the executed notebook
    written to ``artifacts/notebooks/`` under the notebook's own file name."""
    nb = _run_notebook(path, **options)
    EXECUTED.mkdir(parents=True, exist_ok=True)
    target = EXECUTED / Path(path).name
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    shown, _ = CoalesceStreamsPreprocessor().preprocess(copy.deepcopy(nb), {})
    nbformat.write(shown, partial)
    partial.replace(target)
    return nb
