"""Driving JupyterLab in Debian's Chromium with Playwright, for the browser tests.

One JupyterLab per test (``lab_page``), or per module (``lab_session`` in a fixture, each test
in ``reporting``), on a copy of the notebooks, screenshots into
``artifacts/browser/``, and on a failure the page, the browser console and the server log in
the error. Chromium comes from apt (``.ci/run`` installs it); Playwright's own browser download
is not used. Without /usr/bin/chromium a test skips, unless WORKBENCH_REQUIRE_BROWSER is set
(CI), where a missing browser is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers.jupyter import start_lab, stop_lab

CHROMIUM = Path(os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
README_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


def keep_for_readme(screenshot: Path, name: str) -> None:
    """Copy a screenshot the test just took to ``docs/images/name`` (the README shows it), so
    the README's pictures are what the product looks like at the last browser run."""
    README_IMAGES.mkdir(parents=True, exist_ok=True)
    (README_IMAGES / name).write_bytes(screenshot.read_bytes())
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-dev-shm-usage"]
MS = 1000


def require_browser() -> None:
    problems = []
    if not CHROMIUM.exists():
        problems.append(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problems.append("the playwright package is missing (pip install -e '.[test]')")
    if problems:
        reason = "browser test: " + "; ".join(problems)
        if os.environ.get("WORKBENCH_REQUIRE_BROWSER"):
            pytest.fail(reason + " (WORKBENCH_REQUIRE_BROWSER is set)")
        pytest.skip(reason)


@dataclass
class Lab:
    """A JupyterLab and the Chromium page driving it, with the browser console so far."""

    page: Any
    server: Any  # helpers.jupyter.LabServer
    console: list[str]


@contextlib.contextmanager
def lab_session(tmp_path: Path, settings: dict[str, dict] | None = None) -> Iterator[Lab]:
    """JupyterLab on a copy of the notebooks, in Chromium, with the user ``settings`` given
    (``{"@jupyterlab/notebook-extension/tracker": {...}}``): for one test (``lab_page``) or
    for a module's tests in a fixture, each wrapping its body in ``reporting``."""
    require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for plugin, values in (settings or {}).items():
        path = tmp_path / "settings" / f"{plugin}.jupyterlab-settings"  # start_lab's folder
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    server = start_lab(tmp_path, copy_notebooks=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
            context = browser.new_context(viewport={"width": 1500, "height": 950})
            context.set_default_timeout(60 * MS)  # a loaded 2-core machine answers slowly
            lab = Lab(context.new_page(), server, [])
            lab.page.on("console", lambda m: lab.console.append(f"{m.type}: {m.text}"))
            try:
                yield lab
            finally:
                browser.close()
    finally:
        stop_lab(server)


@contextlib.contextmanager
def reporting(lab: Lab, failure: str) -> Iterator[None]:
    """On a failure inside, the page is saved as ``failure`` and the browser console and the
    server log join the error."""
    try:
        yield
    except BaseException as err:
        with contextlib.suppress(Exception):
            lab.page.screenshot(path=str(ARTIFACTS / failure))
        raise AssertionError(
            f"{err}\n--- browser console ---\n" + "\n".join(lab.console[-30:])
            + f"\n--- workbench lab log ---\n{lab.server.log_tail(30)}") from err


@contextlib.contextmanager
def lab_page(tmp_path: Path, failure: str,
             settings: dict[str, dict] | None = None) -> Iterator[tuple]:
    """(page, server) of a ``lab_session`` for one test, ``reporting`` as ``failure``."""
    with lab_session(tmp_path, settings) as lab, reporting(lab, failure):
        yield lab.page, lab.server


def write_notebook(server, name: str, cells: list[str]) -> None:
    """A notebook of ``cells`` (code) for the Python 3 kernel, in the lab's root."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, server.root / name)


def run_all_cells(page, server, notebook: str, sampler: str):
    """Open ``notebook`` in the lab, open the Colossal sidebar, start ``sampler`` in the page
    and run every cell; returns the sidebar's locator."""
    page.goto(f"{server.url}/lab/tree/{notebook}?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90 * MS)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=60 * MS)
    page.click(".jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id='colossal-workbench-sidebar']")
    sidebar = page.locator("#colossal-workbench-sidebar")
    sidebar.locator(".jp-Colossal-active").wait_for(timeout=30 * MS)
    page.evaluate(sampler)
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
    return sidebar


def wait_for_plot(page, cell_text: str, title: str, screenshot: str) -> None:
    """The plot titled ``title`` under the cell holding ``cell_text`` has drawn bars; scrolled
    to and saved as ``screenshot``. The cell is brought into view first (JupyterLab draws only
    the cells in view), by the page's own ``scrollIntoView``: Playwright's waits for the plot to
    stand still, which a plot redrawn four times a second in a notebook whose cells are laid
    out as they come into view may never do on a loaded machine."""
    cell = page.locator(".jp-CodeCell", has_text=cell_text)
    cell.evaluate("el => el.scrollIntoView({block: 'end'})")
    plot = cell.locator(".js-plotly-plot", has=page.locator(".gtitle", has_text=title))
    plot.locator(".barlayer .point").first.wait_for(state="attached", timeout=60 * MS)
    plot.evaluate("el => el.scrollIntoView({block: 'center'})")
    page.wait_for_timeout(500)  # the cells that came into view are laid out
    page.screenshot(path=str(ARTIFACTS / screenshot))
