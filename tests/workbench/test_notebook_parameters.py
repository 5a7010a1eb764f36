"""``workbench run NB -p NAME=VALUE``: a notebook as a job with papermill-style parameters.

Fast: values parse as Python literals, the injected cell follows the cell tagged
``parameters``, and a name that cell does not assign (or a notebook without one) is refused
before anything runs. Full tier: the real CLI runs notebook 01 with ``-p STEPS=40`` on a real
pool and trains exactly 40 steps.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from workbench.notebook_runner import ParameterError, inject_parameters, parse_parameter

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _notebook(tagged: bool = True) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("STEPS, LR = 300, 3e-3\nNAME = 'gpt'")
    if tagged:
        params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_code_cell("import os"), params,
                nbformat.v4.new_code_cell("print(STEPS)")]
    return nb


def test_values_parse_as_literals_else_text():
    assert parse_parameter("STEPS=20") == ("STEPS", 20)
    assert parse_parameter("LR=3e-4") == ("LR", 3e-4)
    assert parse_parameter("NAME=llama") == ("NAME", "llama")
    assert parse_parameter("PLANS=['dp=2', 'tp=2']") == ("PLANS", ["dp=2", "tp=2"])
    with pytest.raises(ParameterError, match="write NAME=VALUE"):
        parse_parameter("STEPS")


def test_the_injected_cell_follows_the_parameters_cell():
    nb = _notebook()
    inject_parameters(nb, {"STEPS": 20, "NAME": "llama"})
    assert nb.cells[2].source == "# injected by workbench run -p\nSTEPS = 20\nNAME = 'llama'\n"
    assert nb.cells[2].metadata["tags"] == ["injected-parameters"]
    assert nb.cells[3].source == "print(STEPS)"


def test_unknown_names_and_untagged_notebooks_are_refused():
    with pytest.raises(ParameterError, match="STEP: not a parameter of this notebook; its "
                                             "parameters cell assigns LR, NAME, STEPS"):
        inject_parameters(_notebook(), {"STEP": 20})
    with pytest.raises(ParameterError, match="no cell tagged 'parameters'"):
        inject_parameters(_notebook(tagged=False), {"STEPS": 20})


def test_the_pretraining_notebook_defaults_are_its_parameters():
    nb = nbformat.read(NOTEBOOKS / "01_pretrain_gpt.ipynb", as_version=4)
    inject_parameters(nb, {"STEPS": 40})  # raises if the tag or the name went missing


@pytest.mark.full
@pytest.mark.engines
def test_workbench_run_trains_the_steps_it_was_given(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", str(NOTEBOOKS / "01_pretrain_gpt.ipynb"),
         "-p", "STEPS=40", "--save", str(tmp_path / "run.ipynb")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^step   39  loss \d", done.stdout, re.M), done.stdout[-2000:]
    assert not re.search(r"^step  299 ", done.stdout, re.M)
    executed = nbformat.read(tmp_path / "run.ipynb", as_version=4)
    assert any(c.metadata.get("tags") == ["injected-parameters"] for c in executed.cells)
    refused = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", str(NOTEBOOKS / "01_pretrain_gpt.ipynb"),
         "-p", "STEP=40"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert refused.returncode == 2 and "not a parameter of this notebook" in refused.stderr
