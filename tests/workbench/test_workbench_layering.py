"""The notebook side's layers hold in the code, as ``tests/runtime/test_layering.py`` holds the
runtime's.

What is protected: every module of ``workbench`` has a layer; no module imports a module of a
higher layer (read from its import statements, those inside functions too, so a "lazy" import
cannot hide a dependency on the layer above); ``workbench`` has no import cycle at all, within
a layer either (``tests/tools/cycles.py``); and the check itself catches an injected upward
import, at the file and line that does it.

The layer map, lowest first, one package per layer:

- ``base``: what every layer may use (errors, the version, the event loop thread, models).
- ``planner``: the cost model and recommendation, pure functions of a plan and a model
  (``oom_hint`` in the cell layer reads it, so it sits below the pool: ``planner/``).
- ``pool``: processes and ranks: the pool, its rank table and published state, launchers,
  Slurm, the reaper, the calls rank processes run (``pool/``).
- ``cells``: running a cell on the ranks and explaining its failures (``cells/``).
- ``ui``: drawing what ranks publish, in the notebook (``ui/dashboard/``) and for the
  JupyterLab server (``ui/lab/``); the ui registers itself with the pool
  (``workbench.pool.state``), the pool never imports it.
- ``serving``: engines on the ranks reached from the notebook (``inference/``: ``RemoteEngine``)
  and over HTTP (``serving/``); both show their progress with the dashboard.
- ``front``: what a notebook touches and wires the rest together: the magics and their
  completion, the tuner widget, the CLIs, and the package's face (``workbench/__init__.py``).
  The magics are the composition root (they start the pool, run cells, draw the dashboard and
  serve), so they stay on top.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import workbench


def _load_cycles():
    """``tests/tools/cycles.py`` by its path: ``tools`` is also a folder at the repository's
    root, so the name alone could find another module first."""
    path = Path(__file__).resolve().parents[1] / "tools" / "cycles.py"
    spec = importlib.util.spec_from_file_location("tests_tools_cycles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_cycles = _load_cycles()
cycles, import_graph, imports = _cycles.cycles, _cycles.import_graph, _cycles.imports
module_name, modules = _cycles.module_name, _cycles.modules

ROOT = Path(workbench.__file__).parent.parent
# lowest first; a module may import its own layer and any lower one, nothing above
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("version", "errors", "_async", "models")),
    ("planner", ("planner",)),
    ("pool", ("pool",)),
    ("cells", ("cells",)),
    ("ui", ("ui",)),
    ("serving", ("serving", "inference")),
    ("front", ("", "magics", "magic_completion", "tuner",
               "export_script", "notebook_runner", "demo", "cli")),  # "": workbench itself
]
LEVEL = {key: level for level, (_, keys) in enumerate(LAYERS) for key in keys}
NAME = [name for name, _ in LAYERS]


def _key(module: str) -> str:
    """``workbench.ui.lab.state`` -> ``ui``; ``workbench`` -> ``""`` (the package's face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def unmapped(root: Path) -> list[str]:
    return sorted(m for m in modules(root, ["workbench"]) if _key(m) not in LEVEL)


def upward_imports(root: Path) -> list[str]:
    """``file:line`` of every import of a higher layer by a module of ``root/workbench``."""
    found = modules(root, ["workbench"])
    known = set(found)
    problems = []
    for name, path in found.items():
        own = LEVEL.get(_key(name))
        if own is None:
            continue
        for line, target in imports(path, name, known):
            other = LEVEL.get(_key(target))
            if other is not None and other > own:
                problems.append(f"{path.relative_to(root)}:{line}: {name} ({NAME[own]}) "
                                f"imports {target} ({NAME[other]}), a layer above")
    return sorted(problems)


def test_every_module_has_a_layer():
    missing = unmapped(ROOT)
    assert not missing, (f"modules without a layer: {missing}; add each to LAYERS in "
                         "tests/workbench/test_workbench_layering.py")


def test_no_module_imports_a_layer_above_its_own():
    problems = upward_imports(ROOT)
    assert not problems, "\n".join(problems)


def test_the_notebook_side_has_no_import_cycle():
    graph = import_graph(ROOT, ["workbench"])
    found = cycles(graph)
    assert not found, f"import cycles (run python -m tests.tools.cycles): {found}"


def _synthetic(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_the_check_catches_an_injected_upward_import(tmp_path):
    """A pool that imports the lab (module level) and an error module that imports the magics
    inside a function are both reported with file and line; downward imports are not."""
    root = _synthetic(tmp_path, {
        "workbench/__init__.py": "from workbench.pool.pool import Pool\n",
        "workbench/errors.py": """\
            class PoolError(Exception):
                pass


            def hint():
                from workbench.magics import active_pool  # upward, hidden in a function
                return active_pool
            """,
        "workbench/pool/pool.py": "from workbench.errors import PoolError\n"
                             "from workbench.ui.lab.state import PoolStateFile\n",
        "workbench/magics.py": "from workbench.pool.pool import Pool\n",
        "workbench/ui/lab/__init__.py": "",
        "workbench/ui/lab/state.py": "from workbench.pool.state import rank_row\n",
        "workbench/pool/state.py": "",
    })
    problems = upward_imports(root)
    assert problems == [
        "workbench/errors.py:6: workbench.errors (base) imports workbench.magics (front), a "
        "layer above",
        "workbench/pool/pool.py:2: workbench.pool.pool (pool) imports workbench.ui.lab.state (ui), "
        "a layer above",
    ], problems
    assert cycles(import_graph(root, ["workbench"])) == [["workbench.errors",
                                                          "workbench.magics",
                                                          "workbench.pool.pool"]]


def test_an_unmapped_module_is_named(tmp_path):
    root = _synthetic(tmp_path, {"workbench/__init__.py": "", "workbench/newthing.py": ""})
    assert unmapped(root) == ["workbench.newthing"]
    assert module_name(root / "workbench/__init__.py", root) == "workbench"


def test_the_dashboard_package_is_not_shadowed():
    """``workbench.ui.dashboard`` is the package (a function once shadowed it, so
    ``workbench.dashboard.LiveDashboard`` raised AttributeError); the function that shows the
    last run is ``workbench.show_dashboard``."""
    import sys

    import workbench.ui.dashboard

    assert workbench.ui.dashboard is sys.modules["workbench.ui.dashboard"]
    assert workbench.ui.dashboard.LiveDashboard.__name__ == "LiveDashboard"
    assert callable(workbench.show_dashboard)


class _Recorder:
    """A publisher that keeps what the pool tells it."""

    def __init__(self) -> None:
        self.updates: list[tuple[str | None, dict]] = []

    def update(self, state=None, **fields):
        self.updates.append((state, fields))

    def cell_started(self, label, ranks):
        pass

    def cell_data(self, data, final=False):
        pass

    def cell_finished(self, failed=False):
        pass

    def serving_data(self, history, endpoint, final=False):
        pass

    def remove(self):
        pass


def test_the_pool_publishes_to_the_publisher_the_layer_above_gives_it():
    """The pool never imports the lab: by default it publishes to the factory the package
    registered (the lab's state file), and to any publisher passed as ``state=``."""
    from workbench.pool.pool import Pool
    from workbench.ui.lab.state import PoolStateFile

    assert isinstance(Pool(2, publish_state=False).state, PoolStateFile)
    recorder = _Recorder()
    pool = Pool(2, state=recorder)
    pool.publish_ranks("running")
    assert recorder.updates == [("running", {"ranks": [], "world_size": 0, "backend": ""})]
