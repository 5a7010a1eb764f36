"""JupyterLab integration: the server extension behind the "Colossal" sidebar.

Two halves meet in files: kernels write pool-state files (``state.py``, the pools' publisher),
and the server extension (``handlers.py``) lists them, serves a live dashboard page and runs
``%colossal start|stop|restart`` in the owning kernel. The frontend (TypeScript in
``extension/``) is shipped prebuilt in the wheel under ``share/jupyter/labextensions``, and
``etc/jupyter/jupyter_server_config.d/colossal-workbench.json`` enables this module as a server
extension.

This module is imported by every kernel that starts a pool, so it imports nothing heavy:
jupyter_server and tornado are imported only when the server loads the extension.
"""

from __future__ import annotations

from typing import Any

LABEXTENSION_NAME = "colossal-workbench"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """For ``jupyter labextension develop``: the built bundle next to this file."""
    return [{"src": "labextension", "dest": LABEXTENSION_NAME}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "workbench.ui.lab"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the ``/workbench/...`` routes on the running Jupyter server."""
    from workbench.ui.lab.handlers import setup_handlers

    routes = setup_handlers(server_app.web_app)
    server_app.log.info("colossal-workbench: registered %d routes under /workbench", len(routes))
