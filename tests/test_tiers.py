"""The tiers' own checks: make test-fast fails when one of its tests starts a pool it may not
(``helpers/tier_guard.py``), and the report reads the tiers' JUnit files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from report import describe, read_cases  # tests/report.py (tests/ is on sys.path)

TESTS = Path(__file__).resolve().parent

POOL_TEST = """
from kernels_runtime.testing import RankPool


def _rank(rank, world_size):
    return rank


def test_a_pool_of_{n}():
    with RankPool({n}) as pool:
        pool.start()
        assert pool.run(_rank) == list(range({n}))
"""


def _run_tier(folder: Path, tier: str, *ranks: int) -> subprocess.CompletedProcess:
    """pytest, as ``make test-<tier>`` runs it, on one test per size in ``ranks``, each
    starting a pool of that many ranks."""
    folder.mkdir(exist_ok=True)
    for n in ranks:
        (folder / f"test_pool_of_{n}.py").write_text(textwrap.dedent(POOL_TEST.format(n=n)))
    env = {**os.environ, "WORKBENCH_TEST_TIER": tier,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "helpers.tier_guard", "--rootdir", str(folder), "-c", os.devnull, str(folder)],
        env=env, capture_output=True, text=True, timeout=240)


# make test: each child pytest starts torch ranks (~5 s on 2 cores); one child checks both
# sizes against make test-fast's limit, so the fast tier itself starts none of them
@pytest.mark.slow  # starts a 4-rank pool (in a child pytest)
def test_fast_tier_fails_a_four_rank_pool_and_allows_two_ranks(tmp_path: Path):
    done = _run_tier(tmp_path / "fast", "fast", 2, 4)
    out = done.stdout + done.stderr
    assert "2 passed" in out, out  # both tests passed: the tier failed the session
    assert done.returncode == 1, out
    assert "test_pool_of_4.py::test_a_pool_of_4: started a 4-rank pool (at most 2)" in out, out
    assert "test_pool_of_2.py::test_a_pool_of_2:" not in out, out  # 2 ranks are allowed
    assert "tier fast: rank pools started: 1 of 2, 1 of 4" in out, out

    allowed = _run_tier(tmp_path / "test", "test", 4)  # the same test in make test is fine
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "tier test: rank pools started: 1 of 4" in allowed.stdout, allowed.stdout


def test_an_unknown_tier_is_refused(tmp_path: Path):
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "WORKBENCH_TEST_TIER": "fastest",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "helpers.tier_guard",
                           "-c", os.devnull, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "WORKBENCH_TEST_TIER='fastest': expected one of fast, test, full" in done.stderr


def test_report_lists_the_slowest_and_the_time_per_package(tmp_path: Path):
    xml = tmp_path / "test.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.runtime.parallel.test_a" name="test_x[2]" time="12.5"/>
<testcase classname="tests.runtime.parallel.test_a" name="test_y" time="0.5"><skipped/></testcase>
<testcase classname="tests.workbench.test_b" name="test_z" time="3.0"><failure/></testcase>
</testsuite></testsuites>""")
    cases = read_cases(xml)
    assert [(c.nodeid, c.outcome) for c in cases] == [
        ("tests/runtime/parallel/test_a.py::test_x[2]", "passed"),
        ("tests/runtime/parallel/test_a.py::test_y", "skipped"),
        ("tests/workbench/test_b.py::test_z", "failed")]
    text = describe("test", cases, slowest=2)
    assert text.splitlines()[0] == "== test: 3 cases (1 failed, 1 passed, 1 skipped), 16 s in " \
                                   "tests (0.3 min)"
    assert "    12.5 s  tests/runtime/parallel/test_a.py::test_x[2]" in text
    assert "test_y" not in text.split("per package:")[0]  # only the 2 slowest
    assert "    13.0 s  tests/runtime/parallel" in text and "     3.0 s  tests/workbench" in text
