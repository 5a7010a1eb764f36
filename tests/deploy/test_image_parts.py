"""The pieces the Dockerfile runs, checked without building an image (`make test-fast`; the build
itself is test_image_build.py, `make test-image`): the dependency list of its cached layer is
pyproject.toml's, and its test stage's verdict names the failing cell or the missing output."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "image"))

import check_quickstart  # noqa: E402
import project_deps  # noqa: E402


def test_the_cached_layer_installs_what_pyproject_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project_deps.requirements(ROOT / "pyproject.toml", ["hf"])
    assert listed == project["dependencies"] + project["optional-dependencies"]["hf"]
    with pytest.raises(SystemExit, match="has no extra \\['nope'\\]"):
        project_deps.requirements(ROOT / "pyproject.toml", ["nope"])


def _notebook(*outputs: list[dict]) -> nbformat.NotebookNode:
    cells = []
    for i, outs in enumerate(outputs):
        cell = nbformat.v4.new_code_cell(f"step_{i}()")
        cell.outputs = [nbformat.from_dict(o) for o in outs]
        cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells)


def test_the_test_stage_names_the_failing_cell_and_reads_the_outputs():
    ok = {"output_type": "stream", "name": "stdout", "text": "rank 0 of 2: [3.0, 3.0, 3.0]\n"}
    err = {"output_type": "error", "ename": "ModuleNotFoundError", "evalue": "No module 'x'",
           "traceback": ["\x1b[0;31mModuleNotFoundError\x1b[0m: No module 'x'"]}
    nb = _notebook([ok], [err])
    assert check_quickstart.first_error(nb).startswith(
        "cell 1 raised ModuleNotFoundError: No module 'x'\nstep_1()\nModuleNotFoundError")
    assert check_quickstart.output_text(nb) == ok["text"]
    assert check_quickstart.first_error(_notebook([ok])) is None
