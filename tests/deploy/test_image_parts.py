"""The pieces the Dockerfile runs, checked without building an image (`make test-fast`; the build
itself is test_image_build.py, `make test-image`): the dependency list of its cached layer is
pyproject.toml's, and its test stage's verdict names the failing cell or the missing output."""

from __future__ import annotations

import os
import re
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


def test_every_build_argument_the_image_test_passes_is_declared_by_the_dockerfile():
    """podman only warns about a build argument no ARG declares, so a renamed ARG would make
    the image test silently compile the lab extension again or drop the local torch wheel."""
    declared = set(re.findall(r"^ARG (\w+)", (ROOT / "Dockerfile").read_text(), re.M))
    passed = set(re.findall(r'"--build-arg",\s*f?"(\w+)=',
                            (ROOT / "tests" / "deploy" / "test_image_build.py").read_text()))
    assert {"BASE_IMAGE", "TORCH_WHEELS", "LABEXTENSION"} <= passed
    assert passed <= declared, f"not declared by an ARG in the Dockerfile: {passed - declared}"


def test_the_build_log_times_each_step(tmp_path):
    """The image test's log gives each step's seconds (the longest first), from podman's
    ``[stage/stages] STEP i/n:`` lines, so a slow build says where its time went."""
    from test_image_build import timed_build  # tests/deploy/ is on sys.path, as conftest

    script = ("echo '[1/2] STEP 1/2: FROM base'; echo '[1/2] STEP 2/2: RUN slow'; sleep 0.3; "
              "echo pip output; echo '[2/2] STEP 1/1: COPY x y'")
    rc, output, steps = timed_build(["sh", "-c", script], dict(os.environ),
                                    tmp_path / "build.log", timeout=30)
    assert rc == 0 and output.count("\n") == 4
    assert steps[0][1] == "RUN slow" and steps[0][0] >= 0.3
    assert {s for _, s in steps} == {"(before the first step)", "FROM base", "RUN slow",
                                     "COPY x y"}
    logged = (tmp_path / "build.log").read_text().splitlines()
    assert logged[2].endswith("s pip output") and logged[5].endswith("s RUN slow")
