"""Notebook side of colossal-workbench: the pool of ranks, the ``%colossal`` magics, the CLI.

``%load_ext workbench`` registers the magics. The notebook talks to ranks only through
ipyparallel; it never touches torch.distributed itself.
"""

__version__ = "0.1.0"

from typing import Any

# The function deliberately shadows the ``workbench.dashboard`` subpackage as an attribute of
# ``workbench``: users call ``workbench.dashboard()``, while imports such as
# ``from workbench.dashboard import LiveDashboard`` still resolve through sys.modules.
from workbench.dashboard import dashboard
from workbench.errors import PoolError, RankFailureError
from workbench.planner import recommend as recommend  # re-export: workbench.recommend(...)
from workbench.pool import Pool, RankStatus
from workbench.rank_fit import RankFit, fit_ranks

__all__ = ["Pool", "PoolError", "RankFailureError", "RankFit", "RankStatus", "RemoteEngine",
           "active_pool", "dashboard", "fit_ranks", "free_port", "load_ipython_extension",
           "recommend", "tune"]

# what notebooks use from deeper modules, imported on first use (IPython and the serving
# stack are not needed to import the workbench)
_LAZY = {"RemoteEngine": "workbench.inference", "active_pool": "workbench.magics",
         "free_port": "workbench.serving.server"}


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


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
