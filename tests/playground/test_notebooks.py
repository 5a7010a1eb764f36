"""Every notebook in notebooks/ runs top to bottom under nbclient on a 2-rank CPU pool."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from helpers.notebooks import run_notebook  # also keeps the executed copy for the docs
from helpers.reports import report_traces

pytestmark = pytest.mark.engines
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_quickstart_runs_and_shows_rank0_output():
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "00_quickstart.ipynb", timeout_s=300, echo=echo)
    text = echo.getvalue()
    assert "rank 0 of 2: [3.0, 3.0, 3.0]" in text  # the all-reduce cell, rank 0 only
    assert "rank 1 of 2" not in text
    assert "[rank 1] hello from rank 1" in text
    assert "step   0  loss" in text and "loss went from" in text  # pulled back and checked
    assert "trained 60 more steps" in text  # the live-dashboard cell (also test_browser.py)
    html = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
            if o["output_type"] == "display_data" and "text/html" in o.get("data", {})]
    assert len(html) == 1 and "<td>0</td>" in html[0]  # rank 0's table only
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


def test_pretrain_gpt_trains_checkpoints_and_reports(tmp_path, monkeypatch):
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    echo = io.StringIO()
    run_notebook(NOTEBOOKS / "01_pretrain_gpt.ipynb", timeout_s=600, echo=echo,
                 workdir=tmp_path)
    text = echo.getvalue()
    assert "plan: dp=2 zero_stage=2 precision=bf16" in text
    assert "loss" in text and "tokens/s over 2 ranks" in text
    assert "[rank 0] peak memory" in text and "[rank 1] peak memory" in text
    assert list((tmp_path / "checkpoints" / "gpt2-demo").glob("step-*/meta.json"))
    # the training run's dashboard, written as a standalone report holding its plot data
    assert "colossal dashboard: ranks [0, 1]" in text  # the live figure was shown
    traces = report_traces(tmp_path / "reports" / "pretrain_dashboard.html")
    assert traces["comm: dp"][1][-1] > 0
    assert all(y > 0 for y in traces["memory: host"][1]) and len(traces["memory: host"][1]) == 2
    for rank in (0, 1):
        tokens_per_s = traces[f"tokens/s: rank {rank}"][1]
        assert len(tokens_per_s) >= 2 and tokens_per_s[-1] > 0
    # the demo ends by generating through the inference engine from the trained weights
    generated = re.findall(r"^generated: '(.*)'$", text, re.M)
    assert len(generated) == 3 and all(len(g) >= 40 for g in generated), generated


def test_committed_notebooks_have_no_outputs():
    import nbformat

    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, path.name


def test_notebooks_import_only_from_public_faces():
    """A notebook imports our names from a package (its ``__init__``, the public face), never
    from a module inside one (``kernels_runtime.data.stdlib_qa``): what a notebook teaches is
    what a user may rely on."""
    import importlib.util
    import re

    import nbformat

    ours = re.compile(r"^\s*(?:from|import)\s+((?:workbench|kernels_runtime)(?:\.\w+)*)", re.M)
    inside = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            for name in ours.findall(cell.source) if cell.cell_type == "code" else []:
                spec = importlib.util.find_spec(name)
                if spec is None or spec.submodule_search_locations is None:
                    inside.append(f"{path.name}: {name}")
    assert not inside, inside


def test_checkpoint_and_resume_continues_the_losses_under_another_plan(tmp_path, monkeypatch):
    """03 asserts the resume itself (cells raise on a divergence); this checks that the
    crash, the reshard and the export really happened, not only that no cell raised."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "03_checkpoint_and_resume.ipynb", timeout_s=600, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    assert re.search(r"^\s+1\s+\d+\s+\S+\s+\d+\s+\d+\s+cpu\s+gloo\s+dead\b", text, re.M), text
    assert "colossal: 2 ranks on gloo restarted" in text
    assert "loaded step 15 saved under 'dp=2 zero_stage=2'; now 'dp=2 zero_stage=3'" in text
    assert text.count("matches the manifest") == 2
    rel = float(re.search(r"max relative difference: (\S+)", text).group(1))
    assert rel <= 1e-5
    assert re.search(r"max \|logits difference\|, ranks against from_pretrained: \S+", text)
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "gpt2-resume" / "latest").read_text().strip() == "step-00000030"
    assert {"config.json", "model.safetensors"} <= {
        p.name for p in (checkpoints / "gpt2-resume-hf").iterdir()}
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


def test_plan_tuning_recommends_measures_and_sets_the_default(tmp_path):
    import re

    echo = io.StringIO()
    run_notebook(NOTEBOOKS / "02_plan_tuning.ipynb", timeout_s=600, echo=echo, workdir=tmp_path)
    text = echo.getvalue()
    assert "calibrated cpu x2 (gloo)" in text
    assert re.search(r"^1\. dp=2 zero=\d", text, re.M)  # the recommendation, explained
    # the invalid plan showed Plan.validate's words and Measure did nothing
    assert "dp*tp*pp*sp = 4*1*1*1 = 4 but the pool has 2 ranks" in text
    assert "Not measured: the plan is invalid" in text
    measured = re.findall(r"measured +(\d+\.\d) ms; memory predicted +(\S+) MiB, measured "
                          r"+(\S+) MiB", text)
    assert len(measured) == 4 and all(float(t) > 0 for t, _, _ in measured)
    assert "this cell runs under: dp=2" in text  # Use this plan reached a later cell
    assert "8 ranks of H100 SXM" in text


def test_tensor_parallel_notebook_splits_llama_and_reports_comm_per_axis(tmp_path, monkeypatch):
    """04 on 4 ranks: each plan ran with its replaced-module table and a falling loss, the
    per-step collectives are the ones its markdown explains (1D: block all-reduces in tp;
    split_gather: all-gathers and reduce-scatters; ring: sends around sp), every plan computes
    the same losses, and each run's saved dashboard shows traffic on the axes it uses."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "4")  # the 4-rank plans, whatever memory CI has
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "04_tensor_parallel.ipynb", timeout_s=300, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    assert "4 ranks (WORKBENCH_RANKS=4): every plan runs as written" in text
    assert "colossal: 4 ranks on gloo ready" in text
    parts = re.split(r"^plan: (.+)$", text, flags=re.M)  # [before, plan, its output, ...]
    sections = dict(zip(parts[1::2], parts[2::2]))
    assert list(sections) == ["dp=1 tp=4", "dp=2 tp=2", "dp=2 tp=2 sp_mode=split_gather",
                              "dp=2 sp=2 sp_mode=ring"]
    assert text.count("colossal dashboard: ranks [0, 1, 2, 3]") == 4  # each run's live figure

    def row(section: str, module: str, becomes: str) -> bool:
        return re.search(rf"^  {re.escape(module)}\s+{re.escape(becomes)}\s+x2$", section,
                         re.M) is not None

    def per_step(section: str) -> dict[tuple[str, str], tuple[float, float]]:
        """(group, op) -> (calls, KiB) of one step on rank 0, from the cell's table."""
        found = re.findall(r"^  (\w+)\s+(\w+)\s+(\S+) calls\s+(\S+) KiB(.*)$", section, re.M)
        return {(g, op): (float(c), 0.0 if note else float(k)) for g, op, c, k, note in found}

    tp4, dp_tp, split, ring = sections.values()
    for section in (tp4, dp_tp, split):
        assert row(section, "model.layers.*.self_attn.q_proj",
                   "Linear -> ColumnParallelLinear (column)")
        assert row(section, "model.layers.*.mlp.up_proj", "Linear -> ColumnParallelLinear (column)")
        assert row(section, "model.layers.*.self_attn.o_proj", "Linear -> RowParallelLinear (row)")
        assert row(section, "model.layers.*.mlp.down_proj", "Linear -> RowParallelLinear (row)")
    assert row(tp4, "model.layers.*.self_attn.k_proj", "Linear -> ReplicatedHeadsLinear "
               "(key/value heads replicated)")  # 2 kv heads over tp=4
    assert row(dp_tp, "model.layers.*.self_attn.k_proj", "Linear -> ColumnParallelLinear (column)")
    assert row(split, "model.layers.*.input_layernorm",
               "-> PartialGradModule (sequence shards: gradient summed over tp)")
    assert row(ring, "model.layers.*.self_attn", "attention -> ring attention over sp=2")
    # the counts the markdown explains: 2 + 2 all-reduces per block (2 blocks) and 6 more,
    # 4 more again for replicated key/value weights; split_gather turns the block ones into
    # all-gathers and reduce-scatters; ring sends K/V over sp and never touches tp
    assert per_step(tp4)[("tp", "all_reduce")][0] == 18
    assert per_step(tp4)[("dp", "all_reduce")][1] == 0  # a one-rank group, marked as such
    assert per_step(dp_tp)[("tp", "all_reduce")][0] == 14
    assert per_step(dp_tp)[("dp", "all_reduce")][1] > 0
    assert per_step(split)[("tp", "all_gather")][0] >= 8
    assert per_step(split)[("tp", "reduce_scatter")][0] >= 8
    assert per_step(split)[("tp", "all_reduce")][0] < 14
    assert per_step(ring)[("sp", "send")][1] > 0 and per_step(ring)[("sp", "recv")][1] > 0
    assert not any(group == "tp" for group, _ in per_step(ring))
    # the loss went down under every plan, and every plan computed the same losses
    learned = re.findall(r"^(.+): loss (\S+) -> (\S+)$", text, re.M)
    assert [plan for plan, _, _ in learned] == ["tp=4", "dp=2 tp=2", "tp=2 sp_mode=split_gather",
                                                "sp=2 sp_mode=ring"]
    assert all(float(last) < 0.8 * float(first) for _, first, last in learned)
    rel = [float(r) for r in re.findall(r"max relative difference from tp=4: (\S+)", text)]
    assert len(rel) == 4 and max(rel) <= 1e-4
    # each run's dashboard report: bytes per axis, cumulative since the ranks started
    reports = {name: report_traces(tmp_path / "reports" / f"tensor_parallel_{name}.html")
               for name in ("1d", "dp_tp", "split_gather", "ring")}

    def grew(name: str, axis: str) -> float:
        y = reports[name][f"comm: {axis}"][1]
        return y[-1] - y[0]

    assert reports["1d"]["comm: tp"][1][-1] > 0 and grew("1d", "tp") > 0
    assert grew("dp_tp", "tp") > 0 and grew("dp_tp", "dp") > 0
    assert reports["dp_tp"]["comm: dp"][1][-1] > reports["1d"]["comm: dp"][1][-1]
    assert grew("split_gather", "tp") > 0
    # ring attention passes K/V point to point: the dotted p2p line of sp, no tp traffic
    p2p = reports["ring"]["p2p: sp"][1]
    assert p2p[-1] - p2p[0] > 0 and grew("ring", "tp") == 0
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


def test_grid_notebook_on_four_ranks_runs_1d_and_2d_and_says_why_2p5d_is_left_out(
        tmp_path, monkeypatch):
    """05 on 4 ranks, as a machine with room for 4 (make test; the full size, 8 ranks, is in
    make test-full): 1D and 2D train to the same first-step loss, and 2.5D is left out with
    the number of ranks it needs."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "4")
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "05_tensor_2d_2p5d.ipynb", timeout_s=300, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    assert "4 ranks (WORKBENCH_RANKS=4; 8 ranks need 5 GiB): 1D and 2D run, 2.5D (2 grids of " \
           "2 x 2) is left out" in text
    assert "2.5d  dp=4  (skipped: needs 8 ranks, the pool has 4)" in text
    assert "2.5d: skipped (needs 8 ranks, the pool has 4)" in text
    learned = re.findall(r"^(.+): loss (\S+) -> (\S+), test accuracy (\S+)%$", text, re.M)
    assert [plan for plan, *_ in learned] == ["tp=4", "tp=4 tp_mode=2d"]
    for _, first, last, accuracy in learned:
        assert float(last) < 0.8 * float(first) and float(accuracy) > 30
    first_step = [float(r) for r in re.findall(
        r"first-step loss relative difference from tp=4: (\S+)", text)]
    assert len(first_step) == 1 and first_step[0] <= 1e-4
    assert (tmp_path / "reports" / "tensor_grid_2d.html").exists()
    assert not (tmp_path / "reports" / "tensor_grid_2p5d.html").exists()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


@pytest.mark.full  # the notebook at its full size: 8 ranks
def test_grid_notebook_trains_a_vit_under_1d_2d_and_2p5d_with_traffic_on_the_grid_axes(
        tmp_path, monkeypatch):
    """05 on 8 ranks: the ViT on the digits trains under 1D, 2D (SUMMA) and 2.5D, the grid runs
    move their bytes on the grid's axes (activation blocks along rows, weight blocks down
    columns, weight gradients over the depth) where 1D moves them in tp, each rank holds the
    activation block its markdown says, every plan computes the same losses, the held-out
    accuracy beats chance, and each run's saved dashboard shows the same axes growing."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "8")  # every plan, whatever memory CI has
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "05_tensor_2d_2p5d.ipynb", timeout_s=300, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    assert "8 ranks (WORKBENCH_RANKS=8): every plan runs" in text
    assert "colossal: 8 ranks on gloo ready" in text
    parts = re.split(r"^plan: (.+)$", text, flags=re.M)  # [before, plan, its output, ...]
    sections = dict(zip(parts[1::2], parts[2::2]))
    assert list(sections) == ["dp=2 tp=4", "dp=2 tp=4 tp_mode=2d",
                              "dp=1 tp=8 tp_mode=2.5d tp_depth=2"]
    assert text.count("colossal dashboard: ranks [0, 1, 2, 3, 4, 5, 6, 7]") == 3

    def totals(section: str) -> dict[str, float]:
        """group -> KiB one step handed to it on rank 0, from the cell's table."""
        return {g: float(k) for g, k in re.findall(r"^  (\w+)\s+total\s+(\S+) KiB$", section,
                                                   re.M)}

    def activation(section: str) -> str:
        return re.search(r"activation entering block 0 on this rank \(batch, seq, hidden\): "
                         r"(\(.+\))", section).group(1)

    one_d, two_d, two_and_half_d = sections.values()
    assert totals(one_d)["tp"] > 0 and not {"tp_row", "tp_col", "tp_dep"} & set(totals(one_d))
    assert totals(two_d)["tp_row"] > 0 and totals(two_d)["tp_col"] > 0
    assert "tp" not in totals(two_d) and "tp_dep" not in totals(two_d)
    assert all(totals(two_and_half_d)[g] > 0 for g in ("tp_row", "tp_col", "tp_dep"))
    assert "dp" not in totals(two_and_half_d)  # the depth does what dp did for 2D
    # 1D hands over fewer bytes on this tiny model, as the closing markdown explains
    assert sum(totals(one_d).values()) < sum(totals(two_d).values())
    assert re.search(r"^  tp_row\s+broadcast\s+48\.0 calls", two_d, re.M)
    # memory: 1D keeps the whole activation of its rows, the grid 1/q^2 of it, 2.5D 1/(d q^2)
    assert activation(one_d) == "(64, 5, 64)"  # 128 images over dp=2
    assert activation(two_d) == activation(two_and_half_d) == "(32, 5, 32)"
    # the loss went down under every plan, the held-out accuracy is above chance (10%)
    learned = re.findall(r"^(.+): loss (\S+) -> (\S+), test accuracy (\S+)%$", text, re.M)
    assert [plan for plan, *_ in learned] == ["dp=2 tp=4", "dp=2 tp=4 tp_mode=2d",
                                              "tp=8 tp_mode=2.5d tp_depth=2"]
    for _, first, last, accuracy in learned:
        assert float(last) < 0.8 * float(first) and float(accuracy) > 30
    first_step = [float(r) for r in re.findall(
        r"first-step loss relative difference from dp=2 tp=4: (\S+)", text)]
    assert len(first_step) == 2 and max(first_step) <= 1e-4
    # each run's dashboard report: bytes per axis, cumulative since the ranks started
    reports = {name: report_traces(tmp_path / "reports" / f"tensor_grid_{name}.html")
               for name in ("1d", "2d", "2p5d")}

    def grew(name: str, axis: str) -> float:
        y = reports[name].get(f"comm: {axis}", ([], [0]))[1]
        return y[-1] - y[0]

    assert grew("1d", "tp") > 0 and grew("1d", "tp_row") == 0
    assert grew("2d", "tp_row") > 0 and grew("2d", "tp_col") > 0 and grew("2d", "tp_dep") == 0
    assert grew("2p5d", "tp_row") > 0 and grew("2p5d", "tp_col") > 0
    assert grew("2p5d", "tp_dep") > 0
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


def test_pipeline_notebook_runs_every_schedule_and_measures_the_bubble(tmp_path, monkeypatch):
    """06 on 4 ranks: GPT-2 under gpipe, 1f1b, interleaved and zbv at pp=4 learns, every
    schedule computes the same losses, each prints its measured bubble next to the formula and
    the replay of its measured action times (replayed: gpipe = 1f1b, interleaved below them,
    zbv lowest), and each run's dashboard report has the stage timeline."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "4")
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "06_pipeline.ipynb", timeout_s=300, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    assert "4 ranks (WORKBENCH_RANKS=4): four pipeline stages, as written" in text
    plans = re.findall(r"^plan: (.+)$", text, re.M)
    assert plans == ["dp=1 pp=4 microbatches=8 pp_schedule=gpipe", "dp=1 pp=4 microbatches=8",
                     "dp=1 pp=4 microbatches=8 pp_schedule=interleaved pp_chunks=2",
                     "dp=1 pp=4 microbatches=8 pp_schedule=zbv"]
    learned = re.findall(r"^pp=4 mb=8 .+: loss (\S+) -> (\S+)$", text, re.M)
    assert len(learned) == 4 and all(float(b) < 0.8 * float(a) for a, b in learned)
    bubbles = {name: (float(m), float(r), f) for name, m, r, f in re.findall(
        r"^(\w+): bubble measured (\S+) \(stages .+\), replayed (\S+), formula (.+)$", text,
        re.M)}
    assert bubbles["gpipe"][2] == bubbles["1f1b"][2] == f"{3 / 11:.3f}"
    assert bubbles["interleaved"][2] == f"{3 / 19:.3f}"
    assert bubbles["zbv"][1] < bubbles["1f1b"][1] and bubbles["interleaved"][1] < \
        bubbles["1f1b"][1]
    assert all(0 < measured < 1 for measured, _, _ in bubbles.values())
    rel = [float(r) for r in re.findall(r"max relative difference from 1f1b: (\S+)", text)]
    assert len(rel) == 4 and max(rel) <= 1e-5
    for name in ("gpipe", "1f1b", "interleaved", "zbv"):  # each report has the stage figure
        html = (tmp_path / "reports" / f"pipeline_{name}.html").read_text()
        assert html.count("Plotly.newPlot(") == 3, name  # the main figure, curves, stages
        assert '"curves: loss"' in html, name
        assert '"stage: F (forward)"' in html and '"stage: B (backward)"' in html, name
        assert ('"stage: W (weight grads)"' in html) == (name == "zbv"), name
        assert '"p2p: pp"' in html, name
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


def test_heterogeneous_memory_trains_beyond_the_device_budget(tmp_path, monkeypatch):
    """07 on 2 ranks: a GPT-2 with about 3 times more model state per rank than the automatic
    run's device budget (activations included) trains under zero=3 without offload, with static
    offload to host and disk and with automatic placement; every offloading step evicted and
    moved state, the device stayed within its budget, host and disk hold state at the end, the
    three runs compute the same losses, and a budget below one step's working set names each
    tier's minimum."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "2")
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "07_heterogeneous_memory.ipynb", timeout_s=600, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    assert "2 ranks (WORKBENCH_RANKS=2): every plan runs as written, at dp=2" in text
    parts = re.split(r"^plan: (.+)$", text, flags=re.M)  # [before, plan, its output, ...]
    sections = dict(zip(parts[1::2], parts[2::2]))
    reference, static, auto = sections.values()
    assert list(sections) == [
        "dp=2 zero_stage=3",
        "dp=2 zero_stage=3 offload=static host_mem=1MiB offload_params=1 offload_grads=1 "
        "offload_optim=1",
        "dp=2 zero_stage=3 offload=auto device_mem=3MiB host_mem=3MiB"]
    state = float(re.search(r"Adam states \S+ MiB = (\S+) MiB", reference).group(1))
    ratio = float(re.search(r"3\.00 MiB per rank, (\S+)x smaller than the model state",
                            reference).group(1))
    assert ratio >= 3 and state >= 3 * 3.0

    def placement(section: str) -> list[tuple[int, float, float]]:
        """(evictions, MiB moved, device peak MiB) of each step line of a run."""
        return [(int(e), float(m), float(p)) for e, m, p in re.findall(
            r"^step +\d+  loss \S+  evictions +(\d+)  moved +(\S+) MiB  waited +\S+ ms  "
            r"device peak (\S+) MiB$", section, re.M)]

    def tiers(section: str) -> list[dict[str, float]]:
        return [{"device": float(d), "host": float(h), "disk": float(k)} for d, h, k in
                re.findall(r"^  rank \d: device +(\S+) MiB  host +(\S+) MiB  disk +(\S+) MiB$",
                           section, re.M)]

    assert not placement(reference)
    for section in (static, auto):
        steps = placement(section)
        assert len(steps) == 8 and all(e > 0 and m > 0 for e, m, _ in steps), steps
        assert len(tiers(section)) == 2
        assert all(t["host"] > 0 and t["disk"] > 0 for t in tiers(section)), tiers(section)
    # within device_mem=3MiB, activations included, once the first step measured them
    assert all(peak <= 3.0 for _, _, peak in placement(auto)[1:])
    assert all(t["device"] <= 3.0 for t in tiers(auto))
    per_step = re.search(r"^evictions per step: \[(.+)\]$", auto, re.M).group(1)
    assert all(int(e) > 0 for e in per_step.split(","))
    assert re.search(r"^moved per step, mean over the run: .*host->disk \S+ MiB", auto, re.M)
    assert float(re.search(r"spill folder of rank 0: \S+, (\S+) MiB of files", static)
                 .group(1)) > 0
    rel = dict(re.findall(r"^(\w+): max relative difference from the reference: (\S+)$", text,
                          re.M))
    assert list(rel) == ["reference", "static", "auto"]
    assert all(float(r) <= 1e-6 for r in rel.values()), rel
    # the budget error, before the first step: each tier's given budget and its minimum
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    error = re.search(r"^BudgetError: .+$", text, re.M).group(0)
    found = re.findall(r"(device|host)_mem=(\S+) (\w+) < (\S+) (\w+)", error)
    assert [tier for tier, *_ in found] == ["device", "host"], error
    for _, given, unit, least, least_unit in found:
        assert float(given) * units[unit] < float(least) * units[least_unit], error
    assert "at least the minimum" in error
    for name in ("reference", "static", "auto"):  # each run's dashboard, written as a report
        assert (tmp_path / "reports" / f"heterogeneous_{name}.html").is_file(), name
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


def test_inference_notebook_streams_batches_shares_and_splits(tmp_path, monkeypatch):
    """08 on 2 ranks: a GPT-2 trained in the notebook serves requests from an engine built on
    the ranks (tp=2): streamed text, seeded sampling that repeats, a stop string, 48 requests
    continuously batched with the cache handed back, a shared system prompt's blocks reused,
    a cache too small for the batch (preempting) giving the same tokens, per-request errors,
    and the same greedy tokens under pp=2."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "2")
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "08_inference.ipynb", timeout_s=300, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    assert "2 ranks (WORKBENCH_RANKS=2): the engine runs under tp=2, then under pp=2" in text
    assert re.search(r"^engine under tp=2: \d+ KV blocks of 16 tokens", text, re.M)
    streamed = re.findall(r"^\[([012])\] '.*'  \[length\]$", text, re.M)  # the text display
    assert sorted(set(streamed)) == ["0", "1", "2"], text
    assert re.search(r"^stop at '.{3}': '.*' \(stop\)$", text, re.M)
    assert re.search(r"^48 requests, \d+ tokens generated$", text, re.M)
    assert "blocks in use now 0 of" in text
    shared = int(re.search(r"instead of computed: (\d+)$", text, re.M).group(1))
    assert shared >= 80, shared
    assert re.search(r"^\d+ blocks, [1-9]\d* preemptions; same tokens as the large cache: True$",
                     text, re.M)
    assert text.count(" error: ") == 3 and "the prompt is empty" in text
    assert "under pp=2: same greedy tokens as under tp=2: True" in text
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


def test_serving_notebook_serves_the_openai_client_and_drains(tmp_path, monkeypatch):
    """09 on 2 ranks: an engine built on the ranks is served; the official client gets a
    completion, the same text streamed, a chat answer and 16 concurrent streams; a wrong key,
    unsupported parameters and a too-long prompt get their errors; /metrics counts; a cell
    while serving is refused; the endpoint's dashboard is shown under the serve cell and
    --status counts what was answered and refused; --stop drains."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "2")
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "09_serving.ipynb", timeout_s=300, echo=echo,
                      workdir=tmp_path)
    text = echo.getvalue()
    url = re.search(r"^colossal: serving engine at (\S+) \(model 'engine', 2 replicas\); API "
                    r"key in (\S+) ", text, re.M)
    assert url, text
    assert "wb-" not in text  # the key itself is never printed
    assert re.search(r"^completion: '.+' \(length, 32 tokens\)$", text, re.M)
    assert re.search(r"^streamed in \d+ events: '.+'$", text, re.M)
    assert re.search(r"^16 answers, \d+ characters", text, re.M)
    for what, status in (("wrong key", 401), ("n=2", 400), ("logprobs", 400),
                         ("too long", 400)):
        assert re.search(rf"^{what}: HTTP {status}: ", text, re.M), what
    assert 'workbench_requests_total{route="/v1/completions",status="200"} 18.0' in text
    assert f"%%colossal while serving: the pool is serving engine at {url.group(1)}" in text
    assert f"colossal: stopped serving engine at {url.group(1)}" in text
    # the dashboard shown under the serve cell (its text line), and --status after the calls:
    # 20 answered (models, completion, stream, chat, 16 streams), 4 refused (key, n, logprobs,
    # too long), none in flight
    assert f"colossal endpoint engine at {url.group(1)}: serving, 0.0 requests/s" in text
    assert re.search(rf"^colossal: endpoint engine at {re.escape(url.group(1))}: serving, "
                     r"[\d.]+ requests/s, 0 in flight; engines \(2 replicas\): \d+ running, "
                     r"\d+ waiting, KV blocks \d+ of \d+ \(\d+%\) · 24 requests, 4 failed$",
                     text, re.M), text
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


@pytest.mark.full  # a pool of its own, about a minute on a loaded machine
def test_moe_notebook_trains_under_ep_shows_expert_load_and_generates(tmp_path, monkeypatch):
    """11 on 2 ranks at reduced size (10 steps, unpaced): the planner's ep=2 prediction keeps
    less model state per rank than dp=2 and adds all-to-all bytes; the Mixtral trains under
    ep=2 (dp=2 carved into one ep group) with its live dashboard, the loss falls, and the
    expert load the heatmap draws counts every (token, choice) of the step once per block,
    summed over ranks (8 x 32 tokens x top-2); the 4-rank plans are left out, saying so;
    the exported checkpoint gives the ranks' logits and generates, and the inference engine
    under ep=2 (two experts of four per rank) gives HF generate's greedy tokens."""
    import re

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_RANKS", "2")
    echo = io.StringIO()
    nb = run_notebook(NOTEBOOKS / "11_moe.ipynb", timeout_s=300, echo=echo, workdir=tmp_path,
                      parameters={"STEPS": 10, "PACE_S": 0.0})
    text = echo.getvalue()
    assert ("ep=2 runs as one group; its two copies (dp=4 ep=2) and ep=4 need 4 ranks and are "
            "left out") in text
    predicted = {plan: (float(mib), float(kib)) for plan, mib, kib in re.findall(
        r"^(dp=2|ep=2): model state (\S+) MiB per rank, all-to-all (\S+) KiB per step$", text,
        re.M)}
    assert predicted["ep=2"][0] < predicted["dp=2"][0] and predicted["dp=2"][1] == 0
    assert predicted["ep=2"][1] > 0, predicted
    assert "plan: dp=2 ep=2" in text and "colossal dashboard: ranks [0, 1]" in text
    first, last = map(float, re.search(r"^ep=2: loss (\S+) -> (\S+)$", text, re.M).groups())
    assert last < 0.8 * first
    rows = re.findall(r"^  layer \d: \[([\d, ]+)\]$", text, re.M)
    assert len(rows) == 2 and all(sum(map(int, r.split(","))) == 8 * 32 * 2 for r in rows), rows
    assert "left out: ep=4 needs 4 ranks, the pool has 2" in text
    diff = float(re.search(r"ranks against from_pretrained: (\S+)$", text, re.M).group(1))
    assert diff <= 1e-5
    assert len(re.findall(r"^generated: '(?:def|import|class) .*'$", text, re.M)) == 3
    assert "rank 0: 2 of 4 experts per block" in text  # the engine split the experts
    assert "the engine's greedy tokens under ep=2 equal HF generate's" in text
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors
