"""The hosted playground's install, run for real: Binder's steps in a fresh virtualenv.

Binder (repo2docker) and the Dockerfile install the workbench with the same two steps:
``binder/requirements.txt``, then ``binder/install.sh`` (which ``binder/postBuild`` runs). This
test runs them in a new virtualenv on a copy of the files a clean checkout holds (tracked and
untracked-but-not-ignored: no local build of the lab extension, no node_modules), then executes
``notebooks/00_quickstart.ipynb`` with nbclient on a kernel of that virtualenv, and checks
``jupyter labextension list`` there. A missing dependency, a broken extension build or a
notebook that needs something only the development install has fails here, not on Binder.

Substitutions, because this machine reaches PyPI but not PyTorch's CPU index:

- torch is installed first, pinned to the build running this test (``2.13.0+cpu`` here, which
  pip finds in the local wheel store), and the ``--extra-index-url`` line of requirements.txt is
  dropped; its ``torch>=2.4`` is then already satisfied, as on an image that has torch.
- pip's and yarn's download caches are used (``YARN_ENABLE_GLOBAL_CACHE``): repo2docker starts
  without them, but what is installed is the same. pip does not byte-compile what it installs
  (``PIP_NO_COMPILE``): Python compiles on first import instead; it saves a minute of CI.

Not covered here: repo2docker itself (no Docker engine runs here). The image the Dockerfile
makes is built by podman and runs the quickstart in its test stage in ``make test-image``
(``tests/deploy/test_image_build.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BINDER = REPO / "binder"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

RUN_QUICKSTART = r"""
import sys

import nbformat
from nbclient import NotebookClient

source, target, kernel, workdir = sys.argv[1:]
nb = nbformat.read(source, as_version=4)
nb.cells.append(nbformat.v4.new_code_cell(
    "import sys, workbench\nprint('kernel python:', sys.executable)\n"
    "print('workbench from:', workbench.__file__)"))
client = NotebookClient(nb, timeout=300, kernel_name=kernel, store_widget_state=False,
                        resources={"metadata": {"path": workdir}})
try:
    client.execute()
finally:
    nbformat.write(nb, target)
"""


def _run(cmd: list[str], log: Path, *, env: dict[str, str], cwd: Path | None = None,
         timeout: float = 900) -> str:
    """Run ``cmd``, appending its output to ``log``; on failure, fail with the output's end."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}  ({time.perf_counter() - t0:.0f} s, "
                f"exit {proc.returncode})\n{proc.stdout}\n")
    if proc.returncode:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


def _clean_checkout(dest: Path) -> Path:
    """Copy the files a clean checkout of the working tree holds (what Binder clones)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, check=True,
                            stdout=subprocess.PIPE).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = REPO / name
        if src.is_file():  # listed but deleted in the working tree: skip
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _requirements_without_index(dest: Path) -> Path:
    """binder/requirements.txt less its index options (the CPU index is unreachable here)."""
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    kept = [ln for ln in lines if not ln.strip().startswith(("--extra-index-url", "--index-url"))]
    assert len(kept) == len(lines) - 1, "expected exactly one index line to substitute"
    dest.write_text("\n".join(kept) + "\n")
    return dest


def _venv_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "JUPYTER_PATH", "JUPYTER_DATA_DIR")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               IPP_NONINTERACTIVE="1", YARN_ENABLE_GLOBAL_CACHE="true", PIP_NO_COMPILE="1")
    return env


@pytest.mark.engines
@pytest.mark.install
@pytest.mark.timeout(1500)
def test_binder_install_runs_the_quickstart_in_a_fresh_virtualenv(tmp_path):
    import torch

    log = tmp_path / "install.log"
    durations: dict[str, float] = {}
    t0 = time.perf_counter()
    repo = _clean_checkout(tmp_path / "repo")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = _venv_env(venv)
    python = str(venv / "bin" / "python")
    durations["venv"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    _run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__}"], log, env=env)
    requirements = _requirements_without_index(tmp_path / "requirements.txt")
    _run([python, "-m", "pip", "install", "-q", "-r", str(requirements)], log, env=env)
    durations["requirements"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    env_build = dict(env, REPO_DIR=str(repo))
    out = _run(["bash", str(repo / "binder" / "postBuild")], log, env=env_build, cwd=repo)
    durations["postBuild"] = time.perf_counter() - t0
    assert re.search(r"install.sh: workbench \S+, torch 2\.", out), out[-3000:]
    assert not (repo / "extension" / "node_modules").exists(), "install.sh left node_modules"
    _run([python, "-m", "pip", "check"], log, env=env)

    # The extension, once extension/ exists, must be installed and enabled in this environment.
    listing = ANSI.sub("", _run([python, "-m", "jupyter", "labextension", "list"], log,
                                env=env))
    package = REPO / "extension" / "package.json"
    if package.exists():
        name = json.loads(package.read_text())["name"]
        rows = [ln.split() for ln in listing.splitlines()]
        assert any(r[:1] == [name] and "enabled" in r and "OK" in r for r in rows), listing

    t0 = time.perf_counter()
    kernel = "workbench-binder-test"
    _run([python, "-m", "ipykernel", "install", "--prefix", str(venv), "--name", kernel], log,
         env=env)
    script = tmp_path / "run_quickstart.py"
    script.write_text(RUN_QUICKSTART)
    executed = tmp_path / "quickstart.ipynb"
    workdir = tmp_path / "work"
    workdir.mkdir()
    _run([python, str(script), str(repo / "notebooks" / "00_quickstart.ipynb"), str(executed),
          kernel, str(workdir)], log, env=env, timeout=600)
    durations["quickstart"] = time.perf_counter() - t0

    import nbformat

    nb = nbformat.read(executed, as_version=4)
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                   for o in outputs)
    assert "rank 0 of 2: [3.0, 3.0, 3.0]" in text  # the all-reduce ran on 2 ranks
    assert "loss went from" in text
    assert f"kernel python: {venv / 'bin' / 'python'}" in text
    assert f"workbench from: {venv}" in text  # the installed package, not the checkout
    print("binder install durations (s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in durations.items()))


@pytest.mark.parametrize("cgroup, preset, expected", [
    ({"cpu.max": "200000 100000\n"}, None, "1"),       # 2 CPUs, 2 ranks: one thread each
    ({"cpu.max": "650000 100000\n"}, None, "3"),       # 6.5 CPUs round up to 7: 3 each
    ({"cpu.max": "50000 100000\n"}, None, "1"),        # half a CPU still gets a thread
    ({"cpu.max": "max 100000\n"}, None, ""),           # no quota: leave torch's default
    ({"cpu/cpu.cfs_quota_us": "800000\n", "cpu/cpu.cfs_period_us": "100000\n"}, None, "4"),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None, ""),
    ({"cpu.max": "200000 100000\n"}, "7", "7"),        # the user's setting wins
])
def test_start_sizes_cpu_threads_to_the_container_quota(tmp_path, cgroup, preset, expected):
    for name, content in cgroup.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["WORKBENCH_CGROUP_DIR"] = str(tmp_path)
    if preset is not None:
        env["OMP_NUM_THREADS"] = preset
    out = subprocess.run([str(BINDER / "start"), "sh", "-c", 'echo "threads=${OMP_NUM_THREADS}"'],
                         env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    assert out.strip() == f"threads={expected}"
