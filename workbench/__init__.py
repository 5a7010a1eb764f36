"""Notebook side of colossal-workbench: the pool of ranks, the ``%colossal`` magics, the CLI.

``%load_ext workbench`` registers the magics. The notebook talks to ranks only through
ipyparallel; it never touches torch.distributed itself.
"""

from typing import Any

from kernels_runtime._lazy import lazy_module as _lazy_module
from workbench.cells.rank_fit import RankFit, fit_ranks
from workbench.errors import PoolError, RankFailureError
from workbench.planner import recommend as recommend  # re-export: workbench.recommend(...)
from workbench.pool.pool import Pool, RankStatus
from workbench.pool.state import publish_pool_state_with
from workbench.ui.lab.state import PoolStateFile
from workbench.version import __version__ as __version__

# The ui registers itself with the layer below: every Pool publishes its state to the file the
# JupyterLab extension reads (inside a kernel), without the pool importing the lab. This
# package's face is the one module above every layer (tests/workbench/test_workbench_layering.py).
publish_pool_state_with(PoolStateFile)

__all__ = ["Pool", "PoolError", "RankFailureError", "RankFit", "RankStatus", "RemoteEngine",
           "active_pool", "compare", "fit_ranks", "free_port", "load_ipython_extension",
           "recommend", "show_dashboard", "tune"]

# what notebooks use from deeper modules, imported on first use (IPython and the serving
# stack are not needed to import the workbench), by the runtime's one lazy loader (torch-free)
_LAZY = {"RemoteEngine": "workbench.inference.remote_engine",
         "active_pool": "workbench.cells.session",
         "compare": "workbench.ui.dashboard.compare",
         "free_port": "workbench.serving.server"}

__getattr__, __dir__ = _lazy_module(_LAZY, globals())


def show_dashboard(run: Any = None, shell: Any = None) -> Any:
    """The dashboard of ``run`` (a ``RunHistory`` or ``LiveDashboard``), by default the last
    ``%%colossal`` cell of this session (the magics keep it as ``last_run``).

    Display it (last expression of a cell) for the interactive figure, or write a report with
    ``workbench.show_dashboard().to_html("reports/run.html")``. Named so as not to shadow the
    ``workbench.ui.dashboard`` package (``from workbench.ui.dashboard import LiveDashboard``)."""
    from workbench.ui.dashboard import Dashboard, LiveDashboard

    if isinstance(run, LiveDashboard):
        run = run.history
    if run is None:
        from workbench.cells.session import active_magics

        magics = active_magics(shell)
        run = magics.last_run if magics is not None else None
        if run is None:
            raise ValueError("no %%colossal cell has run in this session yet: run one, or "
                             "pass its history: workbench.show_dashboard(run)")
    return Dashboard(run)


def tune(model: Any, **options: Any) -> Any:
    """Show the plan tuner widget for ``model``; see ``workbench.tuner.tune`` (imported here on
    first use: ipywidgets is not needed to import the workbench)."""
    from workbench.tuner import tune as make

    return make(model, **options)


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext workbench``: register ``%colossal`` and ``%%colossal``."""
    from workbench.magic_completion import register
    from workbench.magics import ColossalMagics, parsers

    if "ColossalMagics" not in ip.magics_manager.registry:
        ip.register_magics(ColossalMagics(ip))
        register(ip, *parsers())


def unload_ipython_extension(ip: Any) -> None:
    magics = ip.magics_manager.registry.get("ColossalMagics")
    if magics is not None and magics.pool is not None:
        magics.pool.stop()
        magics.pool = None
