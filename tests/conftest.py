"""Shared fixtures: pools of real gloo ranks reused across the session, and an in-process
IPython shell with the workbench loaded and a 2-rank engine pool."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("IPP_NONINTERACTIVE", "1")
# %%colossal cells that train keep a run directory (workbench/ui/dashboard/runs.py): in tests under
# a temporary folder, never the checkout's runs/ (kernels and engines started by tests inherit it)
os.environ.setdefault("WORKBENCH_RUNS_DIR", tempfile.mkdtemp(prefix="workbench-runs-"))

# counts the pools, engines and kernels each tier starts (make test-fast may start none)
pytest_plugins = ["helpers.tier_guard"]


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], object]]:
    """``ranks(n)``: a ``RankPool`` of n gloo ranks (2, 4 or 8), started on first use and reused
    by every test of the session; ``ranks(n).run(fn, *args)`` returns each rank's value. A test
    whose ranks fail gets fresh processes for the next test. ``ranks.close_all()`` stops them
    (they restart on next use), for a test that measures the host's free memory."""
    from helpers.distributed import RankPool

    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in pools:
            pools[n] = RankPool(n, pg_timeout_s=30.0)
        return pools[n]

    def close_all() -> None:
        for pool in pools.values():
            pool.close()

    get.close_all = close_all
    yield get
    close_all()


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


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once per session (``helpers/real_model.py``), in
    ``$WORKBENCH_CACHE_DIR`` when it is set, else in a session folder; the planted temporary
    folders are removed after."""
    import shutil

    from kernels_runtime.user_cache import CACHE_ENV

    from helpers import real_model

    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    root = None if os.environ.get(CACHE_ENV) else tmp_path_factory.mktemp("cache")
    prepared = real_model.prepare(root)
    print(f"SmolLM2 folder {prepared.folder}: {prepared.seconds:.1f} s "
          f"({'converted' if prepared.converted else 'cached'})")
    yield prepared
    for planted in (prepared.dead, prepared.live):
        shutil.rmtree(planted, ignore_errors=True)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Tiny GPT-2 and LLaMA trained for 200 steps (``helpers/inference.py``): ``trained[kind]``
    is a weight file, trained on first use (most tests need only GPT-2)."""
    from helpers import inference as inf

    folder = tmp_path_factory.mktemp("trained")

    class Trained(dict):
        def __missing__(self, kind: str) -> str:
            self[kind] = str(inf.train(kind, folder))
            return self[kind]

    return Trained()
