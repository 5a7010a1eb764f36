"""The runtime's layers, as docs/architecture.md draws them, hold in the code.

What is protected: every module of ``kernels_runtime`` imports alone in a fresh interpreter (no
import cycle that only works in a lucky order); no module imports a layer above its own (read
from its import statements, those inside functions too; the check is shown catching an
injected one); only ``comm/`` names device kinds;
the public names import from the package, and the torch-free modules the notebook side uses
stay torch-free.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kernels_runtime

ROOT = Path(kernels_runtime.__file__).parent
# bottom to top; a module may import its own package and any lower layer, nothing else
LAYERS: list[tuple[str, ...]] = [
    ("telemetry", "user_cache", "byte_sizes", "_lazy"),
    ("comm",),
    ("launcher_env",),
    ("mesh",),
    ("precision", "data", "session", "testing", "deferred_params"),
    ("policies",),
    ("optim",),
    ("parallel",),
    ("memory",),
    ("api",),
    ("checkpoint", "inference"),
    ("calibrate",),
]
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def _modules() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every kernels_runtime import in the file, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m.startswith("kernels_runtime.")]


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()} - {None}
    assert packages <= set(LEVEL), f"packages without a layer: {sorted(packages - set(LEVEL))}"


def upward_imports(root: Path = ROOT) -> list[str]:
    """``path:line (package, layer) imports module (package, layer)`` for every import of a
    module in the same layer or one above, in the ``kernels_runtime`` tree at ``root``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        own = _package(module)
        if own is None or own == "__init__":  # the package's public face may name anything
            continue
        for line, imported in _imports(path):
            other = _package(imported)
            if other == own or other is None:
                continue
            if LEVEL[other] >= LEVEL[own]:
                problems.append(f"{path.relative_to(root.parent)}:{line} ({own}, layer "
                                f"{LEVEL[own]}) imports {imported} ({other}, layer "
                                f"{LEVEL[other]})")
    return problems


def test_no_module_imports_a_layer_above_its_own():
    problems = upward_imports()
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_injected_upward_import(tmp_path):
    """A synthetic tree: ``comm`` (layer 1) reaching up into ``api`` inside a function, the
    kind of "lazy" import that hides a dependency, is named at its file and line; the
    downward import beside it is not."""
    files = {
        "kernels_runtime/__init__.py": "",
        "kernels_runtime/comm/__init__.py": "",
        "kernels_runtime/comm/wire.py": "def send():\n"
                                        "    from kernels_runtime.api.loop import step\n"
                                        "    return step\n",
        "kernels_runtime/api/__init__.py": "",
        "kernels_runtime/api/loop.py": "from kernels_runtime.comm.wire import send\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert upward_imports(tmp_path / "kernels_runtime") == [
        f"kernels_runtime/comm/wire.py:2 (comm, layer {LEVEL['comm']}) imports "
        f"kernels_runtime.api.loop (api, layer {LEVEL['api']})"]


ZYGOTE = r"""
import importlib, os, sys, traceback
# heavy and outside the runtime: imported once, shared by the forks (a cycle inside the runtime
# still fails its fork, since no module of the runtime is imported here)
import torch, torch.distributed
import transformers.modeling_utils
failed, running = [], {}
names = list(sys.argv[1:])
while names or running:
    while names and len(running) < 2:  # two forks at a time: the import is mostly CPU
        name = names.pop(0)
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        running[pid] = name
    pid, status = os.wait()
    name = running.pop(pid)
    if status:
        failed.append(name)
print("FAILED:" + ",".join(sorted(failed)))
"""


@pytest.mark.slow  # ~13 s: every module in its own interpreter; make test, not the inner loop
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork (POSIX)")
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module is imported in a process that has imported nothing of the runtime (a fork
    of an interpreter holding only torch), so an import cycle shows up as a failure."""
    modules = _modules()
    result = subprocess.run([sys.executable, "-c", ZYGOTE, *modules], capture_output=True,
                            text=True, timeout=600)
    failed = result.stdout.strip().rsplit("FAILED:", 1)[-1]
    assert result.returncode == 0 and not failed, f"{failed}\n{result.stderr[-3000:]}"


def test_only_comm_names_device_kinds():
    """The accelerator abstraction is the one place that knows device kinds (cuda, nccl)."""
    named = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == "comm":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if "cuda" in line.lower() or "nccl" in line.lower():
                named.append(f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}")
    assert not named, "\n".join(named)


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_public_names_import_from_the_package():
    names = ["parallelize", "parallelize_model", "train_step", "Plan", "ParallelContext",
             "save", "load", "save_model", "load_model", "export_hf"]
    result = _fresh("import sys\nimport kernels_runtime\n"
                    "assert 'torch' not in sys.modules, 'importing the package loaded torch'\n"
                    f"from kernels_runtime import {', '.join(names)}\n"
                    "print(sorted(kernels_runtime.__all__))")
    assert result.returncode == 0, result.stderr[-3000:]
    for name in names:
        assert name in result.stdout


def test_the_notebook_side_imports_no_torch():
    result = _fresh("import sys\nimport workbench, workbench.magics, workbench.planner, "
                    "workbench.tuner, workbench.ui.lab, workbench.models\n"
                    "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
                    "assert not heavy, heavy")
    assert result.returncode == 0, result.stderr[-3000:]
