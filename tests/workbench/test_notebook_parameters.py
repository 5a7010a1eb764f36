"""From notebook to job: ``workbench run NB -p NAME=VALUE`` (papermill-style parameters) and
``workbench export-script NB`` (its ``%%colossal`` cells as a torchrun script).

Fast: values parse as Python literals, the injected cell follows the cell tagged
``parameters``, and a name that cell does not assign (or a notebook without one) is refused
before anything runs; the exported script maps the cells' predefined names to
``RankSession.from_env()`` and leaves the notebook-only cells out. Full tier: the real CLI runs
notebook 01 with ``-p STEPS=40`` on a real pool (exactly 40 steps), and its exported script
under ``torchrun --nproc-per-node=2`` prints the same losses (1e-3, as printed).
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


def test_the_exported_script_runs_rank_cells_under_from_env_and_leaves_the_notebook_out():
    from workbench.export_script import export_script

    nb = _notebook()
    nb.cells += [nbformat.v4.new_code_cell("%load_ext workbench\n%colossal start -n 2"),
                 nbformat.v4.new_code_cell('%%colossal --plan "dp=2 zero=1" --push STEPS\n'
                                           "total = STEPS + rank"),
                 nbformat.v4.new_code_cell("%%colossal --targets 0 --pull total\nprint(total)"),
                 nbformat.v4.new_code_cell("import workbench\nworkbench.show_dashboard()")]
    script = export_script(nb, "nb.ipynb", "nb.py")
    compile(script, "nb.py", "exec")
    assert "session = RankSession.from_env()" in script
    assert "plan = Plan.parse('dp=2 zero=1').validate(world_size)\nsession.plan = plan\n" \
           "total = STEPS + rank" in script
    assert "if rank in (0,):\n    print(total)" in script
    assert "# %colossal start -n 2" in script and "# workbench.show_dashboard()" in script


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step +(\d+)  loss ([\d.]+)$", text,
                                                    re.M)}


@pytest.mark.full
@pytest.mark.engines
def test_workbench_run_and_the_exported_script_train_the_same_steps(tmp_path):
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

    script = tmp_path / "job" / "pretrain.py"
    script.parent.mkdir()
    subprocess.run([sys.executable, "-m", "workbench.cli", "export-script",
                    str(NOTEBOOKS / "01_pretrain_gpt.ipynb"), "-o", str(script), "-p",
                    "STEPS=40"], check=True, timeout=60)
    torchrun = Path(sys.executable).with_name("torchrun")
    job = subprocess.run([str(torchrun), "--nproc-per-node=2", str(script)], capture_output=True,
                         text=True, timeout=600, cwd=script.parent)
    assert job.returncode == 0, job.stderr[-3000:]
    notebook, exported = _losses(done.stdout), _losses(job.stdout)
    assert set(notebook) == set(exported) == {0, 39}, (notebook, exported)
    for step, loss in notebook.items():
        assert abs(exported[step] - loss) <= 1e-3 * loss, (step, exported[step], loss)
