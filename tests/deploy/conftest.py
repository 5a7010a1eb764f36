"""deploy/jupyterhub/ is not a package (JupyterHub loads its config file, which puts that
folder on sys.path); the tests import its modules the same way."""

import sys
from pathlib import Path

HUB_DIR = Path(__file__).resolve().parents[2] / "deploy" / "jupyterhub"
if str(HUB_DIR) not in sys.path:
    sys.path.insert(0, str(HUB_DIR))

# Markers whose tests run only in their own CI step, never in a tier that does not name them.
OWN_STEP = ("hub", "image")


def pytest_collection_modifyitems(config, items):
    """The hub test (marker ``hub``, `make test-hub`) starts a JupyterHub with three servers
    (~2 min); the image test (marker ``image``, `make test-image`) builds the playground image
    with podman (minutes: see the Makefile). Each is left out of every run whose ``-m`` does
    not name its marker, as ``install`` is."""
    named = config.option.markexpr or ""
    own = [m for m in OWN_STEP if m not in named]
    left_out = [item for item in items if any(item.get_closest_marker(m) for m in own)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
