"""The ``%colossal`` magics of this IPython session and the pool they drive, found by name.

Why here: ``RemoteEngine``, the tuner and the package's face all act on "the pool the notebook
started", while the magics that start it sit at the top of the layers. Looking the magics up in
IPython's registry by their class name lets every layer from the cells up find them without
importing the layer above.
"""

from __future__ import annotations

from typing import Any

MAGICS_NAME = "ColossalMagics"  # the registry key: the magics class's name


def active_magics(shell: Any = None) -> Any:
    """The ``%colossal`` magics registered in this IPython session, if any."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    return shell.magics_manager.registry.get(MAGICS_NAME) if shell else None


def active_pool(shell: Any = None) -> Any:
    """The pool driven by ``%colossal`` in this IPython session, if any (a ``Pool``)."""
    magics = active_magics(shell)
    return magics.pool if magics else None
