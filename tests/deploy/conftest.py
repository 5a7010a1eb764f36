"""deploy/jupyterhub/ is not a package (JupyterHub loads its config file, which puts that
folder on sys.path); the tests import its modules the same way."""

import sys
from pathlib import Path

HUB_DIR = Path(__file__).resolve().parents[2] / "deploy" / "jupyterhub"
if str(HUB_DIR) not in sys.path:
    sys.path.insert(0, str(HUB_DIR))


def pytest_collection_modifyitems(config, items):
    """The hub test (marker ``hub``) starts a JupyterHub with two servers (~3 min): it runs in
    its own CI step, `make test-hub` (``-m hub``), and is left out of every tier that does not
    name it, as ``install`` is."""
    if "hub" in (config.option.markexpr or ""):
        return
    hub = [item for item in items if item.get_closest_marker("hub")]
    if hub:
        config.hook.pytest_deselected(items=hub)
        items[:] = [item for item in items if not item.get_closest_marker("hub")]
