"""The playground in a real browser: JupyterLab (``workbench lab``) with our extension, driven
through Debian's Chromium by Playwright, the way a user clicks through it.

What is protected: the quickstart notebook runs top to bottom from the UI ("Run All Cells"),
the Colossal sidebar and status bar show the 2-rank pool (busy while a cell runs), the live
plot under the training cell gains points while that cell is still running, the extension's
dashboard page gains points while it runs too, no cell ends in an error, and the sidebar's
Start (for the notebook's kernel, with no pool running) and Stop buttons work. Then the plan
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
    write_notebook,
)

pytestmark = pytest.mark.engines

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

    # the sidebar's buttons: Start for the notebook's kernel (no pool running), then Stop
    sidebar.locator(".jp-Colossal-active button[data-action='start']").click()
    started = sidebar.locator(".jp-Colossal-pool[data-state='running'][data-ranks='2']")
    started.wait_for(timeout=120 * MS)
    page.screenshot(path=str(ARTIFACTS / "5-started-from-sidebar.png"))
    keep_for_readme(ARTIFACTS / "5-started-from-sidebar.png", "sidebar.png")
    started.locator("button[data-action='stop']").click()
    sidebar.locator(".jp-Colossal-message", has_text="pool stopped").wait_for(timeout=60 * MS)
    assert sidebar.locator(".jp-Colossal-pool:not([data-state='stopped'])").count() == 0

    running = [s for s in page.evaluate("window.__samples") if "*" in s["prompt"]]
    drawn = sorted({s["points"] for s in running if s["points"] > 0})
    assert len(drawn) >= 2, f"the live plot did not gain points while the cell ran: {drawn}"
    busy = [s for s in running if s["points"] > 0 and s["sidebar"] == "busy"]
    assert busy and any("Colossal: 2 ranks, busy" in s["status"] for s in busy), running[-3:]
    dash_running = sorted({s["points"] for s in dash.evaluate("window.__samples")
                           if s["running"] == "true" and s["points"] > 0})
    assert len(dash_running) >= 2, f"the dashboard page did not move: {dash_running}"
    print(f"while the cell ran: {len(drawn)} point counts in the notebook's plot, "
          f"{len(dash_running)} on the dashboard page")


TUNER_CELL = """import workbench

tuner = workbench.tune({"hidden": 64, "layers": 2, "heads": 2, "vocab": 256, "seq": 64,
                        "batch": 4, "model_type": "gpt2"}, world_size=2, hardware="H100")
tuner"""


def _move_tuner_controls(page, server) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    write_notebook(server, "tuner_check.ipynb", [TUNER_CELL])
    page.goto(f"{server.url}/lab/tree/tuner_check.ipynb?token={server.token}")
    cell = page.locator(".jp-CodeCell", has_text="workbench.tune").first
    cell.wait_for(timeout=90 * MS)
    prediction = page.locator(".widget-html", has_text="per rank").first
    # The restored workspace also reopens the quickstart, and a run request sent while this
    # notebook's new kernel is still connecting can be dropped: run the cell itself (Shift+Enter
    # in its editor) and repeat until its widget shows; running it twice is harmless.
    for _ in range(4):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        try:
            prediction.wait_for(timeout=30 * MS)
            break
        except PlaywrightTimeout:
            continue
    else:
        raise AssertionError("the tuner cell never showed its widget")
    assert "dp=2 zero=0 fp32" in prediction.inner_text()

    def choose(label: str, value: str) -> None:
        page.locator(f".widget-dropdown:has(label:text-is('{label}')) select").select_option(
            label=value)

    choose("ZeRO stage", "3")  # the kernel re-predicts: the pane names the new plan
    page.locator(".widget-html", has_text="dp=2 zero=3 fp32").first.wait_for(timeout=30 * MS)
    choose("data parallel (dp)", "4")  # impossible on 2 ranks
    error = page.locator(".workbench-plan-error")
    error.wait_for(timeout=30 * MS)
    assert error.inner_text() == ("dp*tp*pp*sp = 4*1*1*1 = 4 but the pool has 2 ranks; make "
                                  "the product 2, or write dp=auto")
    page.screenshot(path=str(ARTIFACTS / "6-tuner-invalid-plan.png"))
    keep_for_readme(ARTIFACTS / "6-tuner-invalid-plan.png", "tuner.png")
