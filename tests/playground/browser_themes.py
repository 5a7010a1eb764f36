"""Runs compared, and the lab's light and dark themes, in a real browser: what
``test_browser.py`` checks in its JupyterLab session once the quickstart has run (no lab of its
own: the lab's start is the expensive part).

What is protected, as the user sees it in Chromium:
- the sidebar's Start (for the notebook's kernel, whose pool the quickstart stopped) starts a
  2-rank pool, and its Stop stops it;
- two cells appended to the quickstart train the same model under two plans, then
  ``workbench.compare(-2, -1)`` (the session's last two kept runs) draws both in one figure,
  each plan in the legend;
- switching the lab to JupyterLab Dark (Settings > Theme, as a user does) restyles the shown
  workbench plots (the extension's CSS: their tick labels take the theme's font colour, with
  no kernel round trip), and the lab's dashboard page, opened from the sidebar's link in the
  light theme, follows the lab's theme setting to dark; back to light at the end.

Screenshots: ``artifacts/browser/7-*.png`` (compare, light and dark; the dashboard page in
dark), copied to ``docs/images/`` for the README.
"""

from __future__ import annotations

from helpers.browser import ARTIFACTS, MS, keep_for_readme

PLANS = ("dp=2", "dp=2 zero=1")
TRAIN_CELL = """%%colossal --plan "PLAN"
import torch
from torch import nn
from kernels_runtime.api import parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         ctx=ParallelContext.build(plan, comm), verbose=False)

def mse(m, batch):
    return nn.functional.mse_loss(m(batch[0]), batch[1])

for step in range(20):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    result = train_step(model, opt, [(x, x.sum(1, keepdim=True))], mse)
print(f"PLAN: loss {result.loss:.4f}")"""
COMPARE_CELL = "import workbench\n\nworkbench.compare(-2, -1)  # the last two runs"

# The compare plot's legend entries, and the fill of its first tick label and whether the
# extension tagged it (what the lab's theme restyles).
LOOK_JS = """() => {
  const cell = [...document.querySelectorAll('.jp-CodeCell')]
    .find(c => c.textContent.includes('workbench.compare'));
  const plot = cell && cell.querySelector('.js-plotly-plot');
  if (!plot) { return null; }
  const tick = plot.querySelector('.xtick text');
  return {legend: [...plot.querySelectorAll('.legendtext')].map(t => t.textContent),
          tagged: plot.dataset.colossalTheme || '',
          fill: tick ? getComputedStyle(tick).fill : ''};
}"""


def check_compare_and_themes(page, server) -> None:
    """In the quickstart notebook, once it has run (its pool stopped): cells added below it,
    as a user appends them; no page reload and no new kernel, which would cost seconds."""
    sidebar = page.locator("#colossal-workbench-sidebar")
    active = sidebar.locator(".jp-Colossal-active", has_text="00_quickstart.ipynb")
    # the sidebar's Start, for this notebook's kernel (its pool stopped by the last cell)
    active.locator("button[data-action='start']").click()
    started = sidebar.locator(".jp-Colossal-pool[data-state='running'][data-ranks='2']")
    started.wait_for(timeout=120 * MS)
    page.screenshot(path=str(ARTIFACTS / "5-started-from-sidebar.png"))
    keep_for_readme(ARTIFACTS / "5-started-from-sidebar.png", "sidebar.png")
    href = started.locator(".jp-Colossal-dashboardLink").get_attribute("href")
    assert href.endswith("?theme=light"), href  # the link carries the lab's theme

    for code in [TRAIN_CELL.replace("PLAN", p) for p in PLANS] + [COMPARE_CELL]:
        _append_and_run(page, code)
    page.wait_for_function(f"({LOOK_JS})() && ({LOOK_JS})().legend.length >= 2",
                           timeout=180 * MS)
    light = page.evaluate(LOOK_JS)
    plans = sorted(light["legend"], key=len)  # the plans as the runs kept them
    assert len(plans) == 2 and "zero" not in plans[0] and "zero" in plans[1], light
    assert all(p.startswith("dp=2") for p in plans), light
    assert light["tagged"] == "jp", "the extension did not tag the workbench plot"
    errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
    assert errors.count() == 0, errors.first.inner_text()
    dash = page.context.new_page()
    dash.goto(href if href.startswith("http") else server.url + href)
    dash.wait_for_selector("#status[data-state]:not([data-state=''])", timeout=30 * MS)
    assert dash.evaluate("document.documentElement.dataset.theme") == "light"
    _shoot(page, "7-compare-light.png", "compare-light.png")

    _choose_theme(page, "JupyterLab Dark", light="false")
    page.wait_for_function(f"({LOOK_JS})().fill !== {light['fill']!r}", timeout=30 * MS)
    dark = page.evaluate(LOOK_JS)
    assert dark["fill"] != light["fill"] and dark["legend"] == light["legend"], (light, dark)
    _shoot(page, "7-compare-dark.png", "compare-dark.png")
    # the dashboard page follows the lab's theme setting, and its plots take its colours
    dash.wait_for_function("document.documentElement.dataset.theme === 'dark'",
                           timeout=30 * MS)
    dash.wait_for_function("() => { const t = document.querySelector('#memory .xtick text');"
                           " return t && getComputedStyle(t).fill !== 'rgb(34, 34, 34)'; }",
                           timeout=30 * MS)
    dash.screenshot(path=str(ARTIFACTS / "7-dashboard-page-dark.png"))
    keep_for_readme(ARTIFACTS / "7-dashboard-page-dark.png", "dashboard-page-dark.png")
    dash.close()
    _choose_theme(page, "JupyterLab Light", light="true")
    print(f"compare: {light['legend']}; tick labels {light['fill']} (light), "
          f"{dark['fill']} (dark)")

    started.locator("button[data-action='stop']").click()
    sidebar.locator(".jp-Colossal-message", has_text="pool stopped").wait_for(timeout=60 * MS)
    assert sidebar.locator(".jp-Colossal-pool:not([data-state='stopped'])").count() == 0


def _append_and_run(page, code: str) -> None:
    """A new code cell at the end of the notebook holding ``code``, run (Shift+Enter); the
    text is inserted as typed text would be, without the editor's auto-closing brackets."""
    page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").last.click()
    page.keyboard.press("Escape")  # command mode
    page.keyboard.press("b")  # a new cell below it, then edit it
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")


def _choose_theme(page, theme: str, light: str) -> None:
    """Settings > Theme > ``theme``, as a user switches it; waits until the lab applied it."""
    page.click(".lm-MenuBar-itemLabel:text-is('Settings')")
    page.hover(".lm-Menu-itemLabel:text-is('Theme')")
    page.click(f".lm-Menu-itemLabel:text-is('{theme}')")
    page.wait_for_selector(f"body[data-jp-theme-light='{light}']", state="attached",
                           timeout=30 * MS)
    # the lab shows its splash screen while it loads a theme: the pictures are taken after it
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=30 * MS)
    page.wait_for_timeout(300)


def _shoot(page, name: str, readme: str) -> None:
    cell = page.locator(".jp-CodeCell", has_text="workbench.compare")
    cell.evaluate("el => el.scrollIntoView({block: 'center'})")
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / name))
    keep_for_readme(ARTIFACTS / name, readme)
