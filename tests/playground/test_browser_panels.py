"""The dashboard's extra panels in a real browser: JupyterLab with our extension in Debian's
Chromium (Playwright), one notebook whose cells each bring a panel, run from the UI.

What is protected: a pipeline: while a ``%%colossal --plan "pp=2 mb=4"`` cell trains an
``nn.Sequential`` over two stages, the stage timeline (one row per pipeline rank, a bar per
forward and backward) is drawn both in the live plot under the cell and on the extension's
dashboard page, and the dashboard page's communication chart names the pipeline's
point-to-point traffic. Heterogeneous memory: while the next cell trains a tiny GPT-2 with its
whole model state offloaded to disk, the offload panel ("model state per tier") shows both
ranks with a non-zero disk tier, under the cell and on the dashboard page. Inference: while
the next cell's engine (two dp replicas of a tiny GPT-2) generates for 16 requests, the
dashboard page's inference panel shows both replicas' KV blocks in use, generated tokens/s and
requests waiting in the queue, and the panel under the cell draws the same series. Mixture of
experts: while the next cell trains a tiny Mixtral under ``ep=2`` (a fresh batch each step), the
expert-load heatmap (tokens per expert per MoE layer, summed over ranks) is drawn on the
dashboard page and its counts change from step to step there while the cell runs, and the
heatmap under the cell moves too. No cell ends in an error. Serving: the last cell serves
that engine (``%colossal serve``); while clients call it (threads in the test, over HTTP), the
sidebar shows the endpoint under its pool with the address the cell printed, requests/s,
requests in flight and KV blocks in use, and after the clients stop exactly the requests they
made; the dashboard page shows the endpoint's
line and panel and the serving ranks' inference panel; and the endpoint's figure under the
serve cell keeps moving while no cell runs (widget updates sent from the kernel's display
thread reach the browser after their cell ended). The sidebar's Stop then drains the endpoint
and stops the pool, and the endpoint leaves the sidebar and the page.
The pipeline cell's training curves (loss per step) gain points while it runs, under the cell
and on the dashboard page, and end holding every step.
Screenshots go to ``artifacts/browser/`` (7 to 18; the notebook's once the cells are done).

One JupyterLab, one notebook and one pool for both tests, as the budget of ``make test`` wants
(the ``panels`` fixture runs the notebook; each test keeps within its own time); each verdict
is judged inside the pages by samplers (setInterval, 200 ms) that record what the plots hold
next to whether the cell was running (in the notebook: its last line not yet printed; on the
page: its status).
"""

from __future__ import annotations

import pytest

from helpers.browser import (
    ARTIFACTS,
    MS,
    lab_session,
    reporting,
    run_all_cells,
    wait_for_plot,
    write_notebook,
)

pytestmark = [pytest.mark.engines, pytest.mark.browser]  # make test-browser

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

INFERENCE_CELL = """%%colossal --plan "dp=2" --dashboard
import time
import torch
import transformers
from kernels_runtime.data import ByteTokenizer
from kernels_runtime.inference import Engine, SamplingParams

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0,
    eos_token_id=0))
# 24 blocks of 8 tokens per replica: 4 requests preempt; a tokenizer, to be served in text
engine = Engine(model, plan, comm=comm, kv_mem="96KiB", block_size=8, max_num_seqs=4,
                tokenizer=ByteTokenizer(), verbose=False)
prompts = [[1 + (i * 7 + j) % 60 for j in range(5 + 3 * i)] for i in range(16)]
outs = engine.generate(prompts, SamplingParams(max_new_tokens=60, ignore_eos=True),
                       on_step=lambda changed: time.sleep(0.05))  # paced, so the plots move
errors = [o.error for o in outs if o.error]
print(f"generated {sum(len(o.token_ids) for o in outs)} tokens for {len(outs)} requests",
      errors or "")
"""

# A few seconds of expert-parallel training: a tiny Mixtral (4 experts, top-2, 2 MoE layers), each
# rank a fresh batch every step, so the tokens per expert change from step to step.
EXPERT_CELL = """%%colossal --plan "ep=2" --dashboard
import time
import torch
import transformers
from kernels_runtime.api import parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
    max_position_embeddings=16, initializer_range=0.2, output_router_logits=True))
model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         ctx=ParallelContext.build(plan, comm), verbose=False)
for step in range(30):  # paced, so the heatmap has time to move
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step + 99 * rank))
    result = train_step(model, opt, [(ids, ids)])
    time.sleep(0.2)
print(f"experts trained {step + 1} steps, loss {result.loss:.4f}")
"""

# Serves the engine above; the test calls it. No API key: the test process reads none of the
# lab's files (the key's default is tests/workbench/serving/test_serving.py's).
SERVE_CELL = """from workbench.serving.server import free_port

PORT = free_port()
%colossal serve engine --port {PORT} --no-api-key"""

# Sampled in both pages: the stage timeline's bars (the plot titled "pipeline stages" under the
# pipeline cell; the page's #stages) and the offload panel's disk bars, from the data plotly.js
# keeps on the plot (the plot titled "model state per tier" under its cell; the page's #offload),
# and the inference panel's KV bars per replica, tokens/s and waiting requests (the plot
# titled "inference engine"; the page's #inference). A cell is found by text of its first line:
# a cell's editor holds only the lines it has drawn, and a cell out of view draws few.
PANELS_JS = """
  const bars = plot => plot ? plot.querySelectorAll('.barlayer .point').length : 0;
  const disk = plot => {
    const t = plot && (plot.data || []).find(t => t.name === 'model state: disk');
    return t ? {ranks: [...t.x], disk: [...t.y]} : {ranks: [], disk: []};
  };
  const most = (plot, name) => {
    const t = plot && (plot.data || []).find(t => t.name === name);
    return t && t.y.length ? Math.max(...t.y) : 0;
  };
  const losses = plot => {
    const t = plot && (plot.data || []).find(t => t.name === 'curves: loss');
    return t ? t.x.length : 0;
  };
  const heat = plot => {  // the expert-load heatmap's counts, as text: they change per step
    const t = plot && (plot.data || []).find(t => t.name === 'expert load: tokens');
    return t ? JSON.stringify(t.z) : '';
  };
  const kv = plot => {
    const t = plot && (plot.data || []).find(t => t.name === 'KV blocks: used (unshared)');
    return {replicas: t ? [...t.x] : [], used: t ? [...t.y] : [],
            tokens: most(plot, 'generated tokens/s: all replicas'),
            waiting: most(plot, 'queue: waiting')};
  };
"""
RESETS_JS = """
  window.__curves = [];
  window.__stages = [];
  window.__offload = [];
  window.__inference = [];
  window.__experts = [];"""
PANELS_SAMPLER = """() => {__PANELS__
  const cellOf = text => [...document.querySelectorAll('.jp-CodeCell')]
    .find(c => c.textContent.includes(text));
  const titled = (cell, title) => cell && [...cell.querySelectorAll('.js-plotly-plot')]
    .find(p => (p.querySelector('.gtitle') || {}).textContent?.startsWith(title));
  // A cell runs, as far as the notebook has drawn it, until its last line is printed: outputs
  // and widget updates arrive in order on one channel, while the prompt's number comes on
  // another and runs ahead of them when the browser lags behind a busy kernel.
  const output = cell => cell ? (cell.querySelector('.jp-OutputArea') || {}).textContent || ''
    : '';
  const prompt = cell => (cell.querySelector('.jp-InputPrompt') || {}).textContent || '';
  // until every cell has run, the view follows the cell being drawn (the last with outputs),
  // where its panels join, as a user's would: the notebook draws only the cells in view
  const follow = () => {
    const cells = [...document.querySelectorAll('.jp-CodeCell')];
    if (!cells.some(c => prompt(c).includes('*'))) { return; }
    const cell = cells.filter(c => c.querySelector('.jp-OutputArea-output')).pop();
    const box = cell && cell.getBoundingClientRect();
    if (box && (box.bottom > window.innerHeight || box.bottom < 100)) {
      cell.scrollIntoView({block: 'end'});
    }
  };
  setInterval(() => {
    follow();
    const pipeline = cellOf('pp=2 mb=4'), offload = cellOf('offload=static');
    const inference = cellOf('"dp=2" --dashboard');
    window.__stages.push({bars: bars(titled(pipeline, 'pipeline stages')),
                          running: !output(pipeline).includes('pipeline trained')});
    window.__curves.push({losses: losses(titled(pipeline, 'training curves')),
                          running: !output(pipeline).includes('pipeline trained')});
    window.__offload.push({...disk(titled(offload, 'model state per tier')),
                           running: !output(offload).includes('offloaded ')});
    window.__inference.push({...kv(titled(inference, 'inference engine')),
                             running: !output(inference).includes('generated ')});
    const experts = cellOf('"ep=2" --dashboard');
    window.__experts.push({z: heat(titled(experts, 'expert load')),
                           running: !output(experts).includes('experts trained')});
  }, 200);
}""".replace("__PANELS__", PANELS_JS + RESETS_JS)
PAGE_PANELS_SAMPLER = """() => {__PANELS__
  const shown = id => document.getElementById(id).hidden ? null : document.getElementById(id);
  setInterval(() => {
    const running = document.getElementById('status').dataset.cellRunning === 'true';
    window.__stages.push({bars: bars(shown('stages')), running});
    window.__curves.push({losses: losses(shown('curves')), running});
    window.__offload.push({...disk(shown('offload')), running});
    window.__inference.push({...kv(shown('inference')), running});
    window.__experts.push({z: heat(shown('expert-load')), running});
  }, 200);
}""".replace("__PANELS__", PANELS_JS + RESETS_JS)
SHOWN_WHILE_RUNNING = """id => {
  const el = document.getElementById(id);
  return !el.hidden && el.querySelectorAll('.barlayer .point').length > 0
    && document.getElementById('status').dataset.cellRunning === 'true';
}"""


HEATMAP_WHILE_RUNNING = """() => {
  const el = document.getElementById('expert-load');
  return !el.hidden && (el.data || []).some(t => t.type === 'heatmap')
    && document.getElementById('status').dataset.cellRunning === 'true';
}"""


# The page's inference panel has drawn a few seconds of generation (polled every 0.5 s), so its
# screenshot shows the lines moving; or the cell has ended, and the samplers judge.
GENERATED_FOR_A_WHILE = """() => {
  const t = (document.getElementById('inference').data || [])
    .find(t => t.name === 'generated tokens/s: all replicas');
  return (t && t.x.length >= 8)
    || document.getElementById('status').dataset.cellRunning !== 'true';
}"""


def _on_disk_while_running(samples: list[dict]) -> list[dict]:
    """Samples taken while the cell ran that show both ranks with model state on disk."""
    return [s for s in samples if s["running"] and s["ranks"] == ["rank 0", "rank 1"]
            and all(n > 0 for n in s["disk"])]


def _generating(samples: list[dict], while_running: bool = True) -> list[dict]:
    """Samples that show both replicas' KV blocks, tokens generated and requests kept waiting
    (the series so far); ``while_running``: taken while the cell ran, with KV blocks in use."""
    return [s for s in samples if s["replicas"] == ["replica 0", "replica 1"]
            and s["tokens"] > 0 and s["waiting"] > 0
            and (not while_running or (s["running"] and any(n > 0 for n in s["used"])))]


# No news pop-up over the screenshots. (JupyterLab's default windowing stays: it skips drawing
# the cells out of view, so the notebook's sampler keeps the running cell in view; drawing
# every cell kept a loaded machine's browser minutes behind the kernel.)
SETTINGS = {"@jupyterlab/apputils-extension/notification": {"fetchNews": "false"}}


def _wait_for_heatmap(page, cell_text: str, screenshot: str) -> None:
    """The expert-load heatmap under the cell holding ``cell_text`` holds its counts; scrolled
    to and saved as ``screenshot`` (``wait_for_plot``'s steps, for a plot without bars)."""
    cell = page.locator(".jp-CodeCell", has_text=cell_text)
    cell.evaluate("el => el.scrollIntoView({block: 'end'})")
    plot = cell.locator(".js-plotly-plot", has=page.locator(".gtitle", has_text="expert load"))
    plot.wait_for(state="attached", timeout=60 * MS)
    plot.evaluate("""el => new Promise((done, fail) => {
      const t0 = Date.now();
      const check = () => {
        if ((el.data || []).some(t => t.type === 'heatmap' && t.z && t.z.length)) { done(); }
        else if (Date.now() - t0 > 30000) { fail(new Error('no heatmap counts drawn')); }
        else { setTimeout(check, 200); }
      };
      check();
    })""")
    plot.evaluate("el => el.scrollIntoView({block: 'center'})")
    page.wait_for_timeout(500)  # the cells that came into view are laid out
    page.screenshot(path=str(ARTIFACTS / screenshot))


def _drawn(samples: list[dict]) -> str:
    """What the samples saw of the panel while the cell ran, for a failure's message."""
    running = [s for s in samples if s["running"]]
    drawn = [s for s in running if s["replicas"]]
    return f"{len(running)} samples while running, {len(drawn)} with the panel: {drawn[-5:]}"


@pytest.fixture(scope="module")
def panels(tmp_path_factory):
    """The lab running the notebook (Run All Cells): its pool in the sidebar, and the pool's
    dashboard page open in a second tab with its sampler going; the notebook's sampler starts
    with the run."""
    with lab_session(tmp_path_factory.mktemp("panels"), SETTINGS) as lab:
        with reporting(lab, "failure-pipeline.png"):
            write_notebook(lab.server, "pipeline_check.ipynb", [
                "%load_ext workbench\n%colossal start -n 2", PIPELINE_CELL, OFFLOAD_CELL,
                INFERENCE_CELL, EXPERT_CELL, SERVE_CELL])
            lab.sidebar = run_all_cells(lab.page, lab.server, "pipeline_check.ipynb",
                                        PANELS_SAMPLER)
            pool = lab.sidebar.locator(".jp-Colossal-pool[data-ranks='2']")
            pool.wait_for(timeout=120 * MS)
            href = pool.locator(".jp-Colossal-dashboardLink").get_attribute("href")
            lab.dash = lab.page.context.new_page()
            lab.dash.goto(href if href.startswith("http") else lab.server.url + href)
            lab.dash.wait_for_selector("#status[data-state]:not([data-state=''])",
                                       timeout=30 * MS)
            lab.dash.evaluate(PAGE_PANELS_SAMPLER)
        yield lab


def test_stage_timeline_offload_and_inference_panels_while_their_cells_run(panels):
    with reporting(panels, "failure-pipeline.png"):
        page, dash = panels.page, panels.dash
        # The page shows the running (or last) cell only, so each panel is caught there while
        # its cell runs; the notebook keeps every cell's figures, so its screenshots can wait.
        dash.wait_for_function(SHOWN_WHILE_RUNNING, arg="stages", timeout=180 * MS)
        dash.screenshot(path=str(ARTIFACTS / "7-stage-timeline-dashboard-page.png"),
                        full_page=True)
        dash.locator("#curves").screenshot(path=str(ARTIFACTS / "15-curves-dashboard-page.png"))
        dash.locator("#comm .legendtext", has_text="pp p2p (sent)").wait_for(timeout=10 * MS)
        dash.wait_for_function(SHOWN_WHILE_RUNNING, arg="offload", timeout=180 * MS)
        dash.screenshot(path=str(ARTIFACTS / "9-offload-dashboard-page.png"), full_page=True)
        dash.wait_for_function(SHOWN_WHILE_RUNNING, arg="inference", timeout=180 * MS)
        dash.wait_for_function(GENERATED_FOR_A_WHILE, timeout=30 * MS)
        dash.screenshot(path=str(ARTIFACTS / "11-inference-dashboard-page.png"), full_page=True)
        dash.wait_for_function(HEATMAP_WHILE_RUNNING, timeout=180 * MS)
        dash.wait_for_timeout(2000)  # a few steps' worth of the heatmap moving
        dash.screenshot(path=str(ARTIFACTS / "17-expert-load-dashboard-page.png"),
                        full_page=True)

        last_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").last
        page.wait_for_function("el => /\\[\\d+\\]/.test(el.textContent)",
                               arg=last_prompt.element_handle(), timeout=180 * MS)
        wait_for_plot(page, "pp=2 mb=4", "pipeline stages", "8-stage-timeline-notebook.png")
        curves = page.locator(".jp-CodeCell", has_text="pp=2 mb=4").locator(
            ".js-plotly-plot", has=page.locator(".gtitle", has_text="training curves"))
        curves.evaluate("el => el.scrollIntoView({block: 'center'})")
        # the figure under the ended cell holds every training step
        curves.evaluate("""el => new Promise((done, fail) => {
          const t0 = Date.now();
          const check = () => {
            const t = (el.data || []).find(t => t.name === 'curves: loss');
            if (t && t.x.length === 60) { done(); } else if (Date.now() - t0 > 30000) {
              fail(new Error('curves: loss holds ' + (t ? t.x.length : 0) + ' steps, not 60'));
            } else { setTimeout(check, 200); }
          };
          check();
        })""")
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "16-curves-notebook.png"))
        wait_for_plot(page, "offload=static", "model state per tier",
                      "10-offload-notebook.png")
        wait_for_plot(page, '"dp=2" --dashboard', "inference engine",
                      "12-inference-notebook.png")
        _wait_for_heatmap(page, '"ep=2" --dashboard', "18-expert-load-notebook.png")
        errors = page.locator("[data-mime-type='application/vnd.jupyter.error']")
        assert errors.count() == 0, errors.first.inner_text()
        # the text of every cell, shown or not (JupyterLab skips rendering cells out of view)
        text = page.locator(".jp-Notebook").text_content()
        assert "pipeline trained 60 steps" in text and "offloaded 80 steps" in text
        assert "generated 960 tokens for 16 requests" in text
        assert "experts trained 30 steps" in text

        notebook = [s for s in page.evaluate("window.__stages") if s["running"]]
        drawn = [s["bars"] for s in notebook if s["bars"] > 0]
        # 2 ranks x (4 forwards + 4 backwards), plus the idle bars of the receive waits
        assert drawn and max(drawn) >= 16, f"no stage timeline under the running cell: {drawn}"
        on_page = [s["bars"] for s in dash.evaluate("window.__stages")
                   if s["running"] and s["bars"] > 0]
        assert on_page and max(on_page) >= 16, f"no stage timeline on the page: {on_page}"
        print(f"while the pipeline cell ran: {len(drawn)} samples with the stage timeline in "
              f"the notebook, {len(on_page)} on the dashboard page")

        # the curves panel (loss per training step) is drawn under the cell while it trains
        # (and holds all 60 steps after, checked above) and gains points on the page
        samples = page.evaluate("window.__curves")
        notebook = sorted({s["losses"] for s in samples if s["running"] and s["losses"] > 0})
        assert notebook, f"no curves panel under the running cell: {samples[-5:]}"
        on_page = sorted({s["losses"] for s in dash.evaluate("window.__curves")
                          if s["running"] and s["losses"] > 0})
        assert len(on_page) >= 2, f"the page's curves panel did not gain points: {on_page}"
        print(f"while the pipeline cell ran: loss curve point counts {notebook[:3]}..."
              f"{notebook[-1:]} in the notebook, {len(on_page)} counts on the dashboard page")

        notebook = _on_disk_while_running(page.evaluate("window.__offload"))
        assert notebook, "no offload panel with both ranks on disk under the running cell"
        on_page = _on_disk_while_running(dash.evaluate("window.__offload"))
        assert on_page, "no offload panel with both ranks on disk on the dashboard page"
        print(f"while the offloading cell ran: {len(notebook)} samples with both ranks' disk "
              f"tier in the notebook, {len(on_page)} on the dashboard page")

        samples = page.evaluate("window.__inference")
        # the notebook draws a new figure's plot when the browser gets to it, which on a loaded
        # machine can be after the cell (the panel's joining while the cell runs is
        # tests/workbench/ui/test_dashboard_inference.py's): its series must be there
        notebook = _generating(samples, while_running=False)
        assert notebook, f"no inference panel of both replicas under the cell: {_drawn(samples)}"
        samples = dash.evaluate("window.__inference")
        on_page = _generating(samples)
        assert on_page, ("no inference panel with both replicas generating on the dashboard "
                         f"page: {_drawn(samples)}")
        print(f"while the engine generated: {len(on_page)} samples with both replicas' KV "
              f"blocks in use on the dashboard page; the notebook drew the panel in "
              f"{len(notebook)} samples, {len(_generating(notebook))} while the cell ran")

        # the heatmap changes while the cell trains: on the page (polled every 0.5 s) at least
        # two different step's counts while the cell ran; under the cell, at least two in all
        # (the notebook may draw a new figure after a busy kernel's cell ended, as above)
        on_page = {s["z"] for s in dash.evaluate("window.__experts") if s["running"] and s["z"]}
        assert len(on_page) >= 2, f"the page's heatmap did not move: {sorted(on_page)[:2]}"
        samples = page.evaluate("window.__experts")
        notebook = {s["z"] for s in samples if s["z"]}
        running = {s["z"] for s in samples if s["z"] and s["running"]}
        assert len(notebook) >= 2, f"the heatmap under the cell did not move: {notebook}"
        print(f"while the expert-parallel cell ran: {len(on_page)} different heatmaps on the "
              f"dashboard page; under the cell {len(notebook)}, {len(running)} while it ran")


# While the endpoint serves, in the notebook: the endpoint figure under the serve cell (its
# requests/s points and highest value), whether any cell runs, and the sidebar's endpoint.
SERVING_SAMPLER = """() => {__PANELS__
  window.__serving = [];
  setInterval(() => {
    const cell = [...document.querySelectorAll('.jp-CodeCell')]
      .find(c => c.textContent.includes('%colossal serve engine'));
    const plot = cell && [...cell.querySelectorAll('.js-plotly-plot')]
      .find(p => (p.querySelector('.gtitle') || {}).textContent?.startsWith('endpoint engine'));
    const t = plot && (plot.data || []).find(t => t.name === 'endpoint: requests/s');
    const e = document.querySelector('.jp-Colossal-endpoint');
    window.__serving.push({
      at: Date.now(), points: t ? t.x.length : 0, most: most(plot, 'endpoint: requests/s'),
      running: [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
        .some(p => p.textContent.includes('*')),
      sidebar: e ? {status: e.dataset.status, url: e.dataset.url, requests: +e.dataset.requests,
                    perS: +e.dataset.requestsPerS, inFlight: +e.dataset.inFlight,
                    kvUsed: +e.dataset.kvUsed} : null});
  }, 200);
}""".replace("__PANELS__", PANELS_JS)
# On the dashboard page: the endpoint's line and panel, and the serving ranks' inference panel.
PAGE_SERVING_SAMPLER = """() => {__PANELS__
  window.__serving = [];
  setInterval(() => {
    const panel = document.getElementById('endpoint');
    const line = document.getElementById('endpoint-line');
    window.__serving.push({
      shown: !panel.hidden && !line.hidden, status: line.dataset.status, line: line.textContent,
      perS: most(panel, 'endpoint: requests/s'), inFlight: most(panel, 'endpoint: in flight'),
      ...kv(document.getElementById('inference'))});
  }, 200);
}""".replace("__PANELS__", PANELS_JS)
# Seen by both samplers while the clients call: the sidebar with requests/s and in flight, and
# with KV blocks in use; the notebook's endpoint figure with 10 more points since the serve cell
# ended (no cell running); the page's endpoint panel with requests/s and in flight, and each
# replica's KV blocks in use. Each is a state the page reaches and the samplers see at 5 Hz; none
# needs all of them in one 200 ms sample (a replica between two requests holds no block).
SEEN_SERVING = """([since, page]) => {
  const s = window.__serving.slice(since);
  const ok = s.filter(x => !x.running && x.most > 0);
  const side = s.filter(x => x.sidebar && x.sidebar.status === 'serving');
  return page ? s.some(x => x.shown && x.status === 'serving' && x.perS > 0 && x.inFlight > 0)
                && [0, 1].every(i => s.some(x => x.replicas.length === 2 && x.used[i] > 0))
    : ok.length > 0 && ok[ok.length - 1].points >= ok[0].points + 10
      && side.some(x => x.sidebar.perS > 0 && x.sidebar.inFlight > 0)
      && side.some(x => x.sidebar.kvUsed > 0);
}"""

# For a failure's message: how far the notebook's sampler got towards SEEN_SERVING.
SERVING_SEEN_SO_FAR = """() => {
  const s = window.__serving, ok = s.filter(x => !x.running && x.most > 0);
  const side = s.filter(x => x.sidebar && x.sidebar.status === 'serving');
  return {samples: s.length, seconds: s.length ? (s[s.length - 1].at - s[0].at) / 1000 : 0,
          idle: ok.length, points: ok.length ? [ok[0].points, ok[ok.length - 1].points] : null,
          sidebarServing: side.length,
          sidebarBusy: side.filter(x => x.sidebar.perS > 0 && x.sidebar.inFlight > 0).length,
          sidebarKv: side.filter(x => x.sidebar.kvUsed > 0).length,
          changes: s.filter((x, i) => i && (x.points !== s[i - 1].points
            || JSON.stringify(x.sidebar) !== JSON.stringify(s[i - 1].sidebar))).length,
          last: s.slice(-3)};
}"""


def _call(url: str, stop, made: list) -> None:
    """A client: completions, one after another, until ``stop`` (or a refusal)."""
    import httpx

    while not stop.is_set():
        r = httpx.post(f"{url}/completions", timeout=60, json={
            "model": "engine", "prompt": f"def task_{len(made)}(", "max_tokens": 24,
            "temperature": 0})
        made.append(r.status_code)
        if r.status_code != 200:
            return


def test_a_serving_endpoint_in_the_sidebar_the_page_and_under_its_cell(panels):
    import re
    import threading

    with reporting(panels, "failure-serving.png"):
        page, dash, sidebar = panels.page, panels.dash, panels.sidebar
        cell = page.locator(".jp-CodeCell", has_text="%colossal serve engine")
        printed = cell.locator(".jp-OutputArea-output", has_text="colossal: serving engine at")
        printed.wait_for(timeout=240 * MS)  # the notebook ran up to its serve cell
        url = re.search(r"serving engine at (\S+) ", printed.inner_text()).group(1)
        endpoint = sidebar.locator(f".jp-Colossal-endpoint[data-url='{url}']")
        endpoint.wait_for(timeout=30 * MS)
        assert endpoint.get_attribute("data-status") == "serving"
        cell.evaluate("el => el.scrollIntoView({block: 'start'})")
        page.evaluate(SERVING_SAMPLER)
        dash.evaluate(PAGE_SERVING_SAMPLER)

        stop, made = threading.Event(), []
        clients = [threading.Thread(target=_call, args=(url, stop, made)) for _ in range(10)]
        for t in clients:
            t.start()
        try:
            try:
                dash.wait_for_function(SEEN_SERVING, arg=[0, True], timeout=90 * MS)
            except Exception as err:  # what the page's sampler saw last
                seen = dash.evaluate("window.__serving.slice(-4)")
                raise AssertionError(f"{err}: {seen}") from err
            dash.screenshot(path=str(ARTIFACTS / "13-serving-dashboard-page.png"),
                            full_page=True)
            try:
                # the notebook's figures are drawn by the kernel's display thread, which
                # shares the kernel's GIL with the endpoint's 10 busy clients: slower than the
                # page on a loaded 2-core machine
                page.wait_for_function(SEEN_SERVING, arg=[0, False], timeout=150 * MS)
            except Exception as err:  # what the notebook's sampler saw, summed up
                raise AssertionError(f"{err}: {page.evaluate(SERVING_SEEN_SO_FAR)}") from err
            seen = page.evaluate(SERVING_SEEN_SO_FAR)
            print("the notebook's sampler, when it had seen the endpoint serve:",
                  {k: v for k, v in seen.items() if k != "last"})
            page.screenshot(path=str(ARTIFACTS / "14-serving-notebook-and-sidebar.png"))
        finally:
            stop.set()
            for t in clients:
                t.join(60)
        assert made and set(made) == {200}, made
        # the sidebar shows what the server counted: exactly the requests the clients made
        sidebar.locator(f".jp-Colossal-endpoint[data-requests='{len(made)}']").wait_for(
            timeout=30 * MS)
        assert url in dash.locator("#endpoint-line").inner_text()

        pool = sidebar.locator(".jp-Colossal-pool[data-ranks='2']")
        pool.locator("button[data-action='stop']").click()  # drains the endpoint, then stops
        sidebar.locator(".jp-Colossal-message", has_text="pool stopped").wait_for(
            timeout=90 * MS)
        assert f"stopped serving engine at {url}" in sidebar.locator(
            ".jp-Colossal-message").inner_text()
        assert sidebar.locator(".jp-Colossal-endpoint").count() == 0
        dash.locator("#endpoint-line[hidden]").wait_for(state="attached", timeout=30 * MS)

        samples = page.evaluate("window.__serving")
        idle = [s for s in samples if not s["running"] and s["most"] > 0]
        print(f"while serving {len(made)} requests: the notebook's endpoint figure went from "
              f"{idle[0]['points']} to {idle[-1]['points']} points with no cell running; "
              f"{sum(1 for s in samples if s['sidebar'])} sidebar samples with the endpoint")
