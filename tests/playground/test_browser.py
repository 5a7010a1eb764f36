"""The playground in a real browser: JupyterLab (``workbench lab``) with our extension, driven
through Debian's Chromium by Playwright, the way a user clicks through it.

What is protected: the quickstart notebook runs top to bottom from the UI ("Run All Cells"),
the Colossal sidebar and status bar show the 2-rank pool (busy while a cell runs), the live
plot under the training cell gains points while that cell is still running, the extension's
dashboard page gains points while it runs too, and no cell ends in an error. Then, in cells
appended to it (``browser_themes.py``): the sidebar's Start (for the notebook's kernel, with no
pool running) and Stop buttons, two cells training under two plans compared by
``workbench.compare`` in one figure,
and the lab switched to its dark theme restyling the plots and the dashboard page. Then the plan
tuner widget: choosing values in its dropdowns in the browser (browser-to-kernel widget
events) re-predicts the plan, and an impossible choice shows ``Plan.validate``'s words. The
dashboard's extra panels (stage timeline, offload, inference) are ``test_browser_panels.py``.
Screenshots go to ``artifacts/browser/``.

"While running" is judged inside the page: a sampler (setInterval, 200 ms) records the plot's
point count next to the cell's prompt ("[*]" while executing) and the sidebar's state, so the
verdict does not depend on how fast Playwright's round trips are on a loaded 2-core machine.
Browser set-up and skipping: ``helpers/browser.py``.
"""

from __future__ import annotations

import pytest

from helpers.browser import (
    ARTIFACTS,
    MS,
    keep_for_readme,
    lab_page,
    run_all_cells,
)

pytestmark = [pytest.mark.engines, pytest.mark.browser]  # make test-browser

# Points drawn in a plotly figure: M/L commands of line traces plus marker paths.
POINTS_JS = """function points(el) {
  if (!el) { return 0; }
  let n = 0;
  for (const p of el.querySelectorAll('.scatterlayer path.js-line')) {
    n += ((p.getAttribute('d') || '').match(/[ML]/g) || []).length;
  }
  return n + el.querySelectorAll('.scatterlayer path.point').length;
}"""

# In the notebook: the training cell's plot points, its prompt, the sidebar and status bar.
NOTEBOOK_SAMPLER = """() => {
  __POINTS__
  window.__samples = [];
  setInterval(() => {
    const cell = [...document.querySelectorAll('.jp-CodeCell')]
      .find(c => c.textContent.includes('session.telemetry.step'));
    const pool = document.querySelector('.jp-Colossal-pool');
    window.__samples.push({
      points: points(cell && cell.querySelector('.js-plotly-plot')),
      prompt: cell ? cell.querySelector('.jp-InputPrompt').textContent : '',
      sidebar: pool ? pool.dataset.state : '',
      status: (document.querySelector('.jp-Colossal-status') || {}).textContent || ''
    });
  }, 200);
}""".replace("__POINTS__", POINTS_JS)

DASHBOARD_SAMPLER = """() => {
  window.__samples = [];
  setInterval(() => {
    const s = document.getElementById('status');
    window.__samples.push({points: +s.dataset.points, running: s.dataset.cellRunning});
  }, 200);
}"""


# no "Jupyter news" prompt over the README's pictures
QUIET = {"@jupyterlab/apputils-extension/notification": {"fetchNews": "false"}}


def test_quickstart_runs_in_jupyterlab_with_live_plots(tmp_path):
    with lab_page(tmp_path, "failure.png", QUIET) as (page, server):
        _run_quickstart(page, server)
        _compare_runs_in_light_and_dark(page, server)
        _move_tuner_controls(page, server)


def _run_quickstart(page, server) -> None:
    sidebar = run_all_cells(page, server, "00_quickstart.ipynb", NOTEBOOK_SAMPLER)

    pool = sidebar.locator(".jp-Colossal-pool[data-ranks='2']")
    pool.wait_for(timeout=120 * MS)
    assert "2 ranks" in pool.locator(".jp-Colossal-state").inner_text()
    assert pool.locator(".jp-Colossal-rank").count() == 2
    page.screenshot(path=str(ARTIFACTS / "1-pool-in-sidebar.png"))

    # the extension's dashboard page, open in a second tab for the rest of the run
    href = pool.locator(".jp-Colossal-dashboardLink").get_attribute("href")
    dash = page.context.new_page()
    dash.goto(href if href.startswith("http") else server.url + href)
    dash.wait_for_selector("#status[data-state]:not([data-state=''])", timeout=30 * MS)
    dash.evaluate(DASHBOARD_SAMPLER)

    cell = page.locator(".jp-CodeCell", has_text="session.telemetry.step")
    plot = cell.locator(".jp-OutputArea-output .js-plotly-plot").first
    plot.wait_for(timeout=180 * MS)
    # the picture shows the dashboard from its top, not wherever Run All scrolled to
    cell.evaluate("el => el.querySelector('.jp-OutputArea').scrollIntoView({block: 'start'})")
    page.screenshot(path=str(ARTIFACTS / "2-live-plot.png"))
    keep_for_readme(ARTIFACTS / "2-live-plot.png", "live-dashboard-in-notebook.png")

    # the whole notebook ends: the last cell (%colossal stop) has an execution count
    last_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").last
    page.wait_for_function("el => /\\[\\d+\\]/.test(el.textContent)",
                           arg=last_prompt.element_handle(), timeout=180 * MS)
    dash.screenshot(path=str(ARTIFACTS / "3-dashboard-page.png"))
    keep_for_readme(ARTIFACTS / "3-dashboard-page.png", "dashboard-page.png")
    errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
    assert errors.count() == 0, errors.first.inner_text()
    assert "loss went from" in page.locator(".jp-Notebook").inner_text()
    sidebar.locator(".jp-Colossal-pool[data-state='stopped']").wait_for(timeout=30 * MS)
    page.screenshot(path=str(ARTIFACTS / "4-notebook-done.png"))

    running = [s for s in page.evaluate("window.__samples") if "*" in s["prompt"]]
    drawn = sorted({s["points"] for s in running if s["points"] > 0})
    shown = [s["points"] for s in running]  # 200 ms apart: when the plot came, and moved
    assert len(drawn) >= 2, (f"the live plot did not gain points while the cell ran: {drawn}; "
                             f"{len(shown)} samples while [*], {shown.count(0)} before the "
                             f"plot showed")
    busy = [s for s in running if s["points"] > 0 and s["sidebar"] == "busy"]
    assert busy and any("Colossal: 2 ranks, busy" in s["status"] for s in busy), running[-3:]
    dash_running = sorted({s["points"] for s in dash.evaluate("window.__samples")
                           if s["running"] == "true" and s["points"] > 0})
    assert len(dash_running) >= 2, f"the dashboard page did not move: {dash_running}"
    print(f"while the cell ran: {len(drawn)} point counts in the notebook's plot, "
          f"{len(dash_running)} on the dashboard page")
    dash.close()


def _compare_runs_in_light_and_dark(page, server) -> None:
    """The sidebar's Start and Stop, two runs under two plans and ``workbench.compare``, and
    the lab's dark theme restyling the plots and the dashboard page (``browser_themes.py``)."""
    import time

    from browser_themes import check_compare_and_themes

    began = time.monotonic()
    check_compare_and_themes(page, server)
    print(f"start, two runs compared, light and dark: {time.monotonic() - began:.0f} s")


def _move_tuner_controls(page, server) -> None:
    """The plan tuner in the same lab: zero 0 -> 3 against the planner, a click on a
    candidate, no clipped label (``browser_tuner.py``)."""
    from browser_tuner import check_tuner

    check_tuner(page, server)
