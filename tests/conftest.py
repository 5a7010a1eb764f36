"""Shared fixtures: an in-process IPython shell with the workbench loaded and a 2-rank pool."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("IPP_NONINTERACTIVE", "1")


@pytest.fixture(scope="module")
def shell():
    """An IPython shell with ``%load_ext workbench`` and a running 2-rank gloo pool.

    The pool's collective timeout is 5 s so tests of stuck collectives finish quickly.
    """
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "workbench")
    ip.run_line_magic("colossal", "start -n 2 --timeout 5")
    yield ip
    ip.run_line_magic("colossal", "stop")
