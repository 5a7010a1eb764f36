"""The plan tuner in a real browser: what ``test_browser.py`` checks in its JupyterLab session
once the quickstart has run (no lab of its own: the lab's start is the expensive part).

What is protected, each as the user sees it in Chromium:
- moving ``ZeRO stage`` from 0 to 3 in the dropdown changes the memory bars drawn in the page
  (the plotly div's own data) by exactly what ``workbench.planner.predict`` says for the two
  plans, computed here in the test process, and the model state's change is the ZeRO formula
  (``memory.runtime_model_state_bytes``);
- an impossible choice shows ``Plan.validate``'s words;
- ``Recommend`` draws every candidate with the Pareto front, and a real mouse click on a
  candidate point (hover, then click, at the pixel plotly's own axes put it) moves every
  control to that plan: a synthetic ``plotly_click`` event would skip the FigureWidget's
  browser-to-kernel path that a user's click takes;
- no label in the tuner is clipped at the lab's default width: every label and button's
  ``scrollWidth`` fits its box, and the plots' titles and notes stay inside their plots.

Screenshots: ``artifacts/browser/6-tuner-*.png``; the candidates one is the README's tuner.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from helpers.browser import ARTIFACTS, MS, keep_for_readme, write_notebook

MODEL = {"hidden": 64, "layers": 2, "heads": 2, "vocab": 256, "seq": 64, "batch": 4,
         "model_type": "gpt2"}
TUNER_CELL = """import workbench

tuner = workbench.tune({"hidden": 64, "layers": 2, "heads": 2, "vocab": 256, "seq": 64,
                        "batch": 4, "model_type": "gpt2"}, world_size=2, hardware="H100",
                       memory_budget=4 * 2**20)
tuner"""  # the model is MODEL; a budget near the plans' memory spreads the candidates out
MEMORY_TITLE = "predicted memory per rank"
CANDIDATES_TITLE = "candidate plans"

# The bars of the plot under the tuner whose title starts with ``title``: {trace name: y}
# (from plotly's full data, where a binary-encoded array is already decoded), and whether they
# are the ``expected`` ones yet (the title and the bars arrive as separate edits).
BARS_JS = """([title, expected]) => {
  const plot = [...document.querySelectorAll('.jp-CodeCell .js-plotly-plot')].find(el =>
    el._fullLayout && (el._fullLayout.title.text || '').startsWith(title));
  if (!plot) { return {bars: null, done: false}; }
  const bars = {};
  for (const t of plot._fullData) { bars[t.name] = Array.from(t.y); }
  const near = (a, b) => Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b));
  const done = Object.entries(expected).every(([name, ys]) =>
    bars[name] && ys.every((y, i) => near(bars[name][i], y)));
  return {bars, done};
}"""

# Candidate points a click can hit unambiguously: page pixel of each point of the candidate
# traces (plotly's axes: c2p works on log axes too), keeping those with no other plan's point
# within 12 px, not already recommended or selected, inside the plot area.
POINTS_JS = """(plot) => {
  const L = plot._fullLayout, xa = L.xaxis, ya = L.yaxis, box = plot.getBoundingClientRect();
  const mark = name => ((plot._fullData.find(t => t.name === name) || {}).customdata || [])[0];
  const taken = [mark('recommended'), mark('selected')];
  const pts = [];
  for (const t of plot._fullData) {
    if (!t.name.startsWith('candidates')) { continue; }
    for (let i = 0; i < t.x.length; i++) {
      pts.push({plan: t.customdata[i], front: false,
                x: box.left + xa._offset + xa.c2p(t.x[i]),
                y: box.top + ya._offset + ya.c2p(t.y[i])});
    }
  }
  const front = new Set((plot._fullData.find(t => t.name === 'Pareto front') || {}).customdata);
  const x0 = box.left + xa._offset, y0 = box.top + ya._offset;
  const inside = p => p.x > x0 + 5 && p.x < x0 + xa._length - 5
    && p.y > y0 + 5 && p.y < y0 + ya._length - 5;
  return pts.filter(p => !taken.includes(p.plan) && inside(p) && pts.every(q =>
    q.plan === p.plan || Math.hypot(q.x - p.x, q.y - p.y) > 12))
    .map(p => ({...p, front: front.has(p.plan)}));
}"""

# What each control shows: {label: the menu's shown text, or the checkbox's state}.
SHOWN_JS = """(cell) => {
  const shown = {};
  for (const d of cell.querySelectorAll('.widget-dropdown')) {
    const s = d.querySelector('select');
    shown[d.querySelector('label').textContent] = s.selectedIndex < 0 ? '' :
      s.options[s.selectedIndex].text;
  }
  for (const c of cell.querySelectorAll('.widget-checkbox')) {
    shown[c.querySelector('.widget-label-basic').textContent.trim()] =
      c.querySelector('input').checked;
  }
  return shown;
}"""

# Every label and button whose text does not fit its box, and every plot title or note that
# runs outside its plot; with the number of labels looked at.
CLIPPED_JS = """(cell) => {
  const clipped = [];
  const labels = cell.querySelectorAll('.widget-label, .widget-label-basic, label, '
                                       + 'button.widget-button');
  for (const el of labels) {
    if (el.offsetParent !== null && el.scrollWidth > el.clientWidth) {
      clipped.push(`${el.textContent.trim()}: ${el.scrollWidth} > ${el.clientWidth} px`);
    }
  }
  let texts = 0;
  for (const plot of cell.querySelectorAll('.js-plotly-plot')) {
    if (plot.offsetParent === null) { continue; }
    const box = plot.getBoundingClientRect();
    for (const t of plot.querySelectorAll('.gtitle, .annotation-text, .g-xtitle, .g-ytitle')) {
      const r = t.getBoundingClientRect();
      texts += 1;
      if (r.left < box.left - 1 || r.right > box.right + 1) {
        clipped.push(`plot text "${t.textContent}" runs outside its plot`);
      }
    }
  }
  return {clipped, labels: labels.length, texts};
}"""


def check_tuner(page, server) -> None:
    """The whole tuner check (module docstring), in the lab ``test_browser`` already runs."""
    start = time.monotonic()
    cell = _open_tuner(page, server)
    opened = time.monotonic()
    _check_zero_moves_the_bars(page, cell)
    _check_nothing_clipped(cell, "zero=3")
    page.screenshot(path=str(ARTIFACTS / "6-tuner-zero3.png"))

    _choose(page, "data parallel (dp)", "4")  # impossible on 2 ranks
    error = page.locator(".workbench-plan-error")
    error.wait_for(timeout=30 * MS)
    assert error.inner_text() == ("dp*tp*pp*sp = 4*1*1*1 = 4 but the pool has 2 ranks; make "
                                  "the product 2, or write dp=auto")
    page.screenshot(path=str(ARTIFACTS / "6-tuner-invalid-plan.png"))

    drawn = time.monotonic()
    _check_a_click_selects_a_candidate(page, cell)
    _check_nothing_clipped(cell, "candidates drawn")
    print(f"tuner check: {opened - start:.1f} s to show the widget, {drawn - opened:.1f} s "
          f"for zero 0 -> 3 and the invalid plan, {time.monotonic() - drawn:.1f} s for "
          "Recommend and the click")


def _open_tuner(page, server):
    """Open a notebook of ``TUNER_CELL`` and run it until its widget shows; the cell."""
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
    return cell


def _choose(page, label: str, value: str) -> None:
    page.locator(f".widget-dropdown:has(label:text-is('{label}')) select").select_option(
        label=value)


def _bars(page, expected: dict[str, list[float]]) -> dict[str, list[float]]:
    """The memory plot's bars once they are ``expected`` (the kernel has redrawn them), else
    (after 30 s) as they are, for the caller's assertion to show."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(f"() => ({BARS_JS})({_js([MEMORY_TITLE, expected])}).done",
                               timeout=30 * MS)
    drawn = page.evaluate(BARS_JS, [MEMORY_TITLE, expected])["bars"]
    assert drawn is not None, f"no memory plot under the tuner: {_plots(page)}"
    return drawn


def _check_zero_moves_the_bars(page, cell) -> None:
    from workbench.planner import predict
    from workbench.planner.cost_model import plan_label
    from workbench.planner.memory import runtime_model_state_bytes
    from workbench.planner.setting import CATEGORIES, TIERS
    from workbench.tuner import Tuner
    from workbench.tuner.figures import MIB

    # the planner's own numbers for the workload the kernel's tuner predicts (same call)
    spec = Tuner(MODEL, world_size=2, hardware="H100").spec
    zero0, zero3 = (predict(f"dp=2 zero={z}", spec, "H100", world_size=2) for z in (0, 3))
    assert plan_label(zero3.plan) == "dp=2 zero=3 fp32"
    want = [{f"{tier}: {c}": [p.memory_by_category(tier)[c] / MIB] * 2
             for tier in TIERS for c in CATEGORIES} for p in (zero0, zero3)]
    before = _bars(page, want[0])
    _choose(page, "ZeRO stage", "3")  # the kernel re-predicts and redraws
    page.locator(".widget-html", has_text="dp=2 zero=3 fp32").first.wait_for(timeout=30 * MS)
    after = _bars(page, want[1])

    for name in want[0]:  # each rank's bar is predict's number, before and after
        was, now = want[0][name][0], want[1][name][0]
        assert before[name] == pytest.approx([was, was], rel=1e-9), (name, before[name], was)
        assert after[name] == pytest.approx([now, now], rel=1e-9), (name, after[name], now)
        for rank in range(2):  # so the drawn change is the predicted change
            assert after[name][rank] - before[name][rank] == pytest.approx(
                now - was, rel=1e-9, abs=1e-12), (name, rank)
    # ... and the model state's change is ZeRO's: each of params (4 B), grads (4 B) and
    # Adam's two fp32 states (8 B) per parameter halved over the 2 data ranks
    psi = zero0.setting.psi_local
    shards = zip(runtime_model_state_bytes(psi, 2, 0, "fp32"),
                 runtime_model_state_bytes(psi, 2, 3, "fp32"))
    for c, (was, now), per_param in zip(("params", "grads", "optimizer"), shards, (4, 4, 8)):
        assert (was, now) == (psi * per_param, psi * per_param / 2), c
        drawn = after[f"device: {c}"][0] - before[f"device: {c}"][0]
        assert drawn == pytest.approx((now - was) / MIB, rel=1e-9), c
    print(f"zero 0 -> 3: device bars {sum(b[0] for n, b in before.items() if 'device' in n):.4f}"
          f" -> {sum(b[0] for n, b in after.items() if 'device' in n):.4f} MiB per rank")


def _check_a_click_selects_a_candidate(page, cell) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    from kernels_runtime.mesh.plan import Plan
    from workbench.planner.cost_model import plan_label
    from workbench.tuner.controls import LABELS, choices

    page.locator("button.widget-button", has_text="Recommend").click()
    plot = cell.locator(".js-plotly-plot", has=page.locator(".gtitle",
                                                            has_text=CANDIDATES_TITLE))
    try:
        plot.wait_for(state="attached", timeout=60 * MS)
    except PlaywrightTimeout:
        raise AssertionError(f"Recommend drew no candidates: {_plots(page)}") from None
    plot.evaluate("el => el.scrollIntoView({block: 'center'})")
    page.wait_for_function(
        "el => el._fullData && el._fullData.some(t => t.name === 'Pareto front' && t.x.length)",
        arg=plot.element_handle(), timeout=30 * MS)
    page.wait_for_timeout(300)  # laid out after the scroll
    page.screenshot(path=str(ARTIFACTS / "6-tuner-candidates.png"))
    keep_for_readme(ARTIFACTS / "6-tuner-candidates.png", "tuner.png")

    # JupyterLab lays out cells as they come into view and may scroll under the pointer:
    # a click that did not select (no "selected" line) is tried again, from a fresh position
    clicks = 0
    for _ in range(3):
        clicks += 1
        plot.evaluate("el => el.scrollIntoView({block: 'center'})")
        page.wait_for_timeout(500)
        points = plot.evaluate(POINTS_JS)
        assert points, "no candidate point stands clear of the others to be clicked"
        point = next((p for p in points if p["front"]), points[0])  # a Pareto point if any
        wanted = Plan.parse(point["plan"])
        page.mouse.move(point["x"], point["y"])  # plotly clicks the point it hovers
        page.wait_for_timeout(200)
        page.mouse.click(point["x"], point["y"])
        try:
            page.locator(".widget-html", has_text=f"selected {plan_label(wanted)}").first \
                .wait_for(timeout=20 * MS)
            break
        except PlaywrightTimeout:
            continue
    else:
        raise AssertionError(f"three clicks on candidate points selected nothing: {points}")

    menus = choices(2)
    expected = {}
    for name, value in wanted.as_dict().items():
        if name == "activation_checkpointing":
            expected[LABELS[name]] = bool(value)
        else:
            expected[LABELS[name]] = next((label for label, v in menus[name] if v == value),
                                          str(value))
    with contextlib.suppress(PlaywrightTimeout):  # the controls' edits arrive one by one
        page.wait_for_function(f"cell => {{ const s = ({SHOWN_JS})(cell); "
                               f"return Object.entries({_js(expected)}).every(([k, v]) => "
                               f"s[k] === v); }}", arg=cell.element_handle(), timeout=30 * MS)
    shown = cell.evaluate(SHOWN_JS)
    wrong = {k: (shown.get(k), v) for k, v in expected.items() if shown.get(k) != v}
    assert not wrong, f"controls (shown, expected) not moved to {wanted.to_string()}: {wrong}"
    print(f"clicked {plan_label(wanted)} ({'on' if point['front'] else 'off'} the Pareto front)"
          f" among {len(points)} clear points (click {clicks}): every control moved to it")
    cell.evaluate("el => el.scrollIntoView({block: 'start'})")  # the controls, moved
    page.screenshot(path=str(ARTIFACTS / "6-tuner-selected.png"))


def _check_nothing_clipped(cell, when: str) -> None:
    result = cell.evaluate(CLIPPED_JS)
    assert result["labels"] >= 21, result  # 20 plan fields and the hardware, at least
    assert not result["clipped"], f"clipped with {when}: {result['clipped']}"


def _plots(page) -> list:
    """(title, traces, shown) of every plotly plot in the page, for a failure's message."""
    return page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(el => "
                         "[(el._fullLayout || {title: {}}).title.text, (el.data || []).length, "
                         "el.offsetParent !== null])")


def _js(value) -> str:
    import json

    return json.dumps(value)
