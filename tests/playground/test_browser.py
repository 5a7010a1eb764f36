"""The playground in a real browser: JupyterLab (``workbench lab``) with our extension, driven
through Debian's Chromium by Playwright, the way a user clicks through it.

What is protected: the quickstart notebook runs top to bottom from the UI ("Run All Cells"),
the Colossal sidebar and status bar show the 2-rank pool (busy while a cell runs), the live
plot under the training cell gains points while that cell is still running, the extension's
dashboard page gains points while it runs too, no cell ends in an error, and the sidebar's
Start (for the notebook's kernel, with no pool running) and Stop buttons work. Then the plan
tuner widget: choosing values in its dropdowns in the browser (browser-to-kernel widget
events) re-predicts the plan, and an impossible choice shows ``Plan.validate``'s words. And a
pipeline: while a ``%%colossal --plan "pp=2 mb=4"`` cell trains an ``nn.Sequential`` over two
stages, the stage timeline (one row per pipeline rank, a bar per forward and backward) is drawn
both in the live plot under the cell and on the extension's dashboard page, and the dashboard
page's communication chart names the pipeline's point-to-point traffic. And, in the same
session, heterogeneous memory: while the next cell trains a tiny GPT-2 with its whole model
state offloaded to disk, the offload panel ("model state per tier") shows both ranks with a
non-zero disk tier, under the cell and on the dashboard page.
Screenshots go to ``artifacts/browser/``.

"While running" is judged inside the page: a sampler (setInterval, 200 ms) records the plot's
point count next to the cell's prompt ("[*]" while executing) and the sidebar's state, so the
verdict does not depend on how fast Playwright's round trips are on a loaded 2-core machine.

Chromium comes from apt (``.ci/run`` installs it); Playwright's own browser download is not
used. Without /usr/bin/chromium the test skips, unless WORKBENCH_REQUIRE_BROWSER is set (CI),
where a missing browser is a failure.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.jupyter import start_lab, stop_lab

pytestmark = pytest.mark.engines
CHROMIUM = Path(os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-dev-shm-usage"]
MS = 1000

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


def _require_browser() -> None:
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


@contextlib.contextmanager
def _lab_page(tmp_path: Path, failure: str) -> Iterator[tuple]:
    """(page, server): JupyterLab on a copy of the notebooks, in Chromium. On a failure the
    page is saved as ``failure`` and the browser console and the server log join the error."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    server = start_lab(tmp_path, copy_notebooks=True)
    console: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
            context = browser.new_context(viewport={"width": 1500, "height": 950})
            page = context.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            try:
                yield page, server
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / failure))
                raise
            finally:
                browser.close()
    except BaseException as err:
        raise AssertionError(
            f"{err}\n--- browser console ---\n" + "\n".join(console[-30:])
            + f"\n--- workbench lab log ---\n{server.log_tail(30)}") from err
    finally:
        stop_lab(server)


def test_quickstart_runs_in_jupyterlab_with_live_plots(tmp_path):
    with _lab_page(tmp_path, "failure.png") as (page, server):
        _run_quickstart(page, server)
        _move_tuner_controls(page, server)


def _run_all_cells(page, server, notebook: str, sampler: str):
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


def _run_quickstart(page, server) -> None:
    sidebar = _run_all_cells(page, server, "00_quickstart.ipynb", NOTEBOOK_SAMPLER)

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
    cell.locator(".jp-OutputArea-output .js-plotly-plot").first.wait_for(timeout=180 * MS)
    page.screenshot(path=str(ARTIFACTS / "2-live-plot.png"))

    # the whole notebook ends: the last cell (%colossal stop) has an execution count
    last_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").last
    page.wait_for_function("el => /\\[\\d+\\]/.test(el.textContent)",
                           arg=last_prompt.element_handle(), timeout=180 * MS)
    dash.screenshot(path=str(ARTIFACTS / "3-dashboard-page.png"))
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
    import nbformat
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(TUNER_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, server.root / "tuner_check.ipynb")
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


PIPELINE_CELL = """%%colossal --plan "pp=2 mb=4" --dashboard
import time
import torch
from torch import nn
from kernels_runtime.api import parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 2))
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         ctx=ParallelContext.build(plan, comm), verbose=False)

def mse(m, batch):
    return nn.functional.mse_loss(m(batch[0]), batch[1])

for step in range(60):  # paced, so the plots have time to move
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    result = train_step(model, opt, list(zip(x.chunk(4), y.chunk(4))), mse)
    time.sleep(0.25)
print(f"pipeline trained {step + 1} steps, loss {result.loss:.4f}")"""

OFFLOAD_CELL = """%%colossal --plan "OFFLOAD_PLAN" --dashboard
import time
import torch
import transformers
from kernels_runtime.api import parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0))
model, opt = parallelize(model, torch.optim.AdamW(model.parameters()),
                         ctx=ParallelContext.build(plan, comm), verbose=False)
for step in range(80):  # paced, so the plots have time to move
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step + rank))
    result = train_step(model, opt, [(ids, ids)])
    time.sleep(0.2)
print(f"offloaded {step + 1} steps, {opt.sync.tier_bytes()['disk']} bytes on disk")
""".replace("OFFLOAD_PLAN", "dp=2 zero=2 offload=static offload_params=1 offload_grads=1 "
            "offload_optim=1 host_mem=0")  # all model state on disk between steps

# Sampled in both pages: the stage timeline's bars (the plot titled "pipeline stages" under the
# pipeline cell; the page's #stages) and the offload panel's disk bars, from the data plotly.js
# keeps on the plot (the plot titled "model state per tier" under its cell; the page's #offload).
PANELS_JS = """
  const bars = plot => plot ? plot.querySelectorAll('.barlayer .point').length : 0;
  const disk = plot => {
    const t = plot && (plot.data || []).find(t => t.name === 'model state: disk');
    return t ? {ranks: [...t.x], disk: [...t.y]} : {ranks: [], disk: []};
  };
  window.__stages = [];
  window.__offload = [];"""
PANELS_SAMPLER = """() => {__PANELS__
  const cellOf = text => [...document.querySelectorAll('.jp-CodeCell')]
    .find(c => c.textContent.includes(text));
  const titled = (cell, title) => cell && [...cell.querySelectorAll('.js-plotly-plot')]
    .find(p => (p.querySelector('.gtitle') || {}).textContent?.startsWith(title));
  const prompt = cell => cell ? cell.querySelector('.jp-InputPrompt').textContent : '';
  setInterval(() => {
    const pipeline = cellOf('pp=2 mb=4'), offload = cellOf('offload=static');
    window.__stages.push({bars: bars(titled(pipeline, 'pipeline stages')),
                          prompt: prompt(pipeline)});
    window.__offload.push({...disk(titled(offload, 'model state per tier')),
                           running: prompt(offload).includes('*')});
  }, 200);
}""".replace("__PANELS__", PANELS_JS)
PAGE_PANELS_SAMPLER = """() => {__PANELS__
  const shown = id => document.getElementById(id).hidden ? null : document.getElementById(id);
  setInterval(() => {
    const running = document.getElementById('status').dataset.cellRunning === 'true';
    window.__stages.push({bars: bars(shown('stages')), running});
    window.__offload.push({...disk(shown('offload')), running});
  }, 200);
}""".replace("__PANELS__", PANELS_JS)
SHOWN_WHILE_RUNNING = """id => {
  const el = document.getElementById(id);
  return !el.hidden && el.querySelectorAll('.barlayer .point').length > 0
    && document.getElementById('status').dataset.cellRunning === 'true';
}"""


def _on_disk_while_running(samples: list[dict]) -> list[dict]:
    """Samples taken while the cell ran that show both ranks with model state on disk."""
    return [s for s in samples if s["running"] and s["ranks"] == ["rank 0", "rank 1"]
            and all(n > 0 for n in s["disk"])]


def test_stage_timeline_and_offload_panel_while_their_cells_run(tmp_path):
    import nbformat

    with _lab_page(tmp_path, "failure-pipeline.png") as (page, server):
        cells = ["%load_ext workbench\n%colossal start -n 2", PIPELINE_CELL, OFFLOAD_CELL,
                 "%colossal stop"]
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, server.root / "pipeline_check.ipynb")
        sidebar = _run_all_cells(page, server, "pipeline_check.ipynb", PANELS_SAMPLER)

        pool = sidebar.locator(".jp-Colossal-pool[data-ranks='2']")
        pool.wait_for(timeout=120 * MS)
        href = pool.locator(".jp-Colossal-dashboardLink").get_attribute("href")
        dash = page.context.new_page()
        dash.goto(href if href.startswith("http") else server.url + href)
        dash.wait_for_selector("#status[data-state]:not([data-state=''])", timeout=30 * MS)
        dash.evaluate(PAGE_PANELS_SAMPLER)
        dash.wait_for_function(SHOWN_WHILE_RUNNING, arg="stages", timeout=180 * MS)
        dash.screenshot(path=str(ARTIFACTS / "7-stage-timeline-dashboard-page.png"),
                        full_page=True)
        dash.locator("#comm .legendtext", has_text="pp p2p (sent)").wait_for(timeout=10 * MS)

        _wait_for_plot(page, "pp=2 mb=4", "pipeline stages", "8-stage-timeline-notebook.png")

        dash.wait_for_function(SHOWN_WHILE_RUNNING, arg="offload", timeout=180 * MS)
        dash.screenshot(path=str(ARTIFACTS / "9-offload-dashboard-page.png"), full_page=True)
        _wait_for_plot(page, "offload=static", "model state per tier",
                       "10-offload-notebook.png")

        last_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").last
        page.wait_for_function("el => /\\[\\d+\\]/.test(el.textContent)",
                               arg=last_prompt.element_handle(), timeout=180 * MS)
        errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
        assert errors.count() == 0, errors.first.inner_text()
        text = page.locator(".jp-Notebook").inner_text()
        assert "pipeline trained 60 steps" in text and "offloaded 80 steps" in text

        notebook = [s for s in page.evaluate("window.__stages") if "*" in s["prompt"]]
        drawn = [s["bars"] for s in notebook if s["bars"] > 0]
        # 2 ranks x (4 forwards + 4 backwards), plus the idle bars of the receive waits
        assert drawn and max(drawn) >= 16, f"no stage timeline under the running cell: {drawn}"
        on_page = [s["bars"] for s in dash.evaluate("window.__stages")
                   if s["running"] and s["bars"] > 0]
        assert on_page and max(on_page) >= 16, f"no stage timeline on the page: {on_page}"
        print(f"while the pipeline cell ran: {len(drawn)} samples with the stage timeline in "
              f"the notebook, {len(on_page)} on the dashboard page")

        notebook = _on_disk_while_running(page.evaluate("window.__offload"))
        assert notebook, "no offload panel with both ranks on disk under the running cell"
        on_page = _on_disk_while_running(dash.evaluate("window.__offload"))
        assert on_page, "no offload panel with both ranks on disk on the dashboard page"
        print(f"while the offloading cell ran: {len(notebook)} samples with both ranks' disk "
              f"tier in the notebook, {len(on_page)} on the dashboard page")


def _wait_for_plot(page, cell_text: str, title: str, screenshot: str) -> None:
    """The plot titled ``title`` under the cell holding ``cell_text`` has drawn bars."""
    cell = page.locator(".jp-CodeCell", has_text=cell_text)
    plot = cell.locator(".js-plotly-plot", has=page.locator(".gtitle", has_text=title))
    plot.locator(".barlayer .point").first.wait_for(state="attached", timeout=60 * MS)
    plot.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / screenshot))
