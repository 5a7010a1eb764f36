"""The dashboard's inference panel: what it plots is what the engines counted, once per replica.

What is protected: from real ``Telemetry`` snapshots of four ranks serving as two dp replicas of
two tp ranks each (every rank of a replica publishing its replica's figures, as the engine's
ranks do), the panel's generated tokens/s is the sum of one rank's ``tokens_per_s`` per replica,
its queue (running, waiting, swapped) the sum over replicas at every point, not over ranks,
and its KV bars each replica's blocks used by one request, shared and free, stacked to its
``blocks_total``; the title gives the latest totals, utilisation, preemptions and prefix hits.
Blocks without a replica stand for their own; a cell whose engines never stepped (telemetry
forgot the block at its start) has no panel; the lab file's bound keeps the last points. A shown
dashboard gains the panel as a new figure, and the report holds it.

With real engines (a 2-rank pool): a paced ``engine.generate`` under tp=2 (one replica over
both ranks) makes the panel join the shown dashboard while it runs, its figures equal to what
``Engine.stats()`` says on the ranks, counted once; ``RemoteEngine.generate`` on dp=2 replicas
(the notebook's handle) leaves a history whose panel has both replicas' KV bars and sums the
tokens both generated.
"""

from __future__ import annotations

import pytest
from ipyparallel import interactive

import workbench
from kernels_runtime.telemetry import TELEMETRY_KEY, Telemetry
from workbench.cells.execution import run_cell
from workbench.magics import active_pool
from workbench.ui.dashboard import Dashboard, RunHistory
from workbench.ui.dashboard.figures import build_inference_figure, trace_data
from workbench.ui.dashboard.inference import inference_traces, replicas

from helpers.reports import report_traces

TOTAL = 64  # KV blocks per replica
QUEUES = ("running", "waiting", "swapped")


def _stats(replica: int | None, leader: bool | None, poll: int) -> dict:
    """An engine's figures (the keys of ``Engine.stats``) for a replica at a poll: replica 1
    runs fewer requests and shares none of its blocks."""
    running, shared = (4, 6) if replica == 0 else (2, 0)
    used = 10 + 5 * poll + 3 * (replica or 0)
    block = {"running": running, "waiting": 8 - poll, "swapped": poll % 2,
             "blocks_total": TOTAL, "blocks_used": used, "blocks_free": TOTAL - used,
             "blocks_shared": shared, "blocks_cached": shared, "block_size": 16,
             "kv_tokens": 16 * used - 5, "kv_bytes": 1 << 20, "preemptions": poll + 10 * (
                 replica or 0), "prefix_hit_blocks": 2 * poll if shared else 0,
             "kv_utilisation": 0.8 + 0.05 * (replica or 0), "weights": None, "steps": poll,
             "prompt_tokens": 100, "generated_tokens": 10 * poll, "requests": 12,
             "finished": poll, "errors": 0, "aborted": 0}
    if replica is not None:
        block.update(replica=replica, leader=leader)
    return block


class Ranks:
    """Real ``Telemetry`` of ranks serving ``replicas`` (rank -> (replica, leader)) on a fake
    clock: each poll, every rank steps like its replica, 0.1 s per step."""

    def __init__(self, replicas: dict[int, tuple[int | None, bool | None]]) -> None:
        self.now = [0.0]
        self.replicas = replicas
        self.tels = {r: Telemetry(clock=lambda: self.now[0]) for r in replicas}
        for tel in self.tels.values():
            tel.tick()  # the first tick after a pause only starts the clock
        self.polls = 0

    def poll(self, steps: int = 2) -> dict[int, dict]:
        self.polls += 1
        for _ in range(steps):
            self.now[0] += 0.1
            for rank, tel in self.tels.items():
                replica, leader = self.replicas[rank]
                tel.record_inference(_stats(replica, leader, self.polls))
                tel.tick(tokens=3 if replica == 0 else 2)  # generated tokens of the step
        return {r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": self.polls}}
                for r, tel in self.tels.items()}


DP2_TP2 = {0: (0, True), 1: (0, False), 2: (1, True), 3: (1, False)}


def test_panel_counts_each_replica_once() -> None:
    ranks, history = Ranks(DP2_TP2), RunHistory([0, 1, 2, 3])
    history.ingest({r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": 0}}
                    for r, tel in ranks.tels.items()})
    assert build_inference_figure(history, widget=False) is None  # no engine step yet
    published = [ranks.poll() for _ in range(4)]
    for data in published:
        history.ingest(data)
    fig = build_inference_figure(history, widget=False)
    data = trace_data(fig)

    assert [t.name for t in fig.data] == list(data)  # unique names, each with its prefix
    assert all(n.startswith(("generated tokens/s: ", "queue: ", "KV blocks: ")) for n in data)
    assert data["generated tokens/s: replica 0"][1] == pytest.approx([30.0] * 4)  # 3 per 0.1 s
    assert data["generated tokens/s: replica 1"][1] == pytest.approx([20.0] * 4)
    rates = [[data[TELEMETRY_KEY]["throughput"]["tokens_per_s"] for data in poll.values()]
             for poll in published]
    assert data["generated tokens/s: all replicas"][1] == pytest.approx(
        [rank[0] + rank[2] for rank in rates])  # the leaders' (ranks 0 and 2), not all four
    times = data["queue: running"][0]
    assert times == history.times()[1:] and len(times) == 4
    for name in QUEUES:  # summed over the replicas, at every point
        assert data[f"queue: {name}"][1] == [_stats(0, True, p)[name] + _stats(1, True, p)[name]
                                             for p in (1, 2, 3, 4)], name
    assert data["queue: running"][1] == [6] * 4  # 4 + 2, where summing ranks would say 12

    replicas = ["replica 0", "replica 1"]
    last = [_stats(0, True, 4), _stats(1, True, 4)]
    assert data["KV blocks: used (unshared)"] == (
        replicas, [b["blocks_used"] - b["blocks_shared"] for b in last])
    assert data["KV blocks: shared"] == (replicas, [6, 0])
    assert data["KV blocks: free"] == (replicas, [b["blocks_free"] for b in last])
    stacked = [sum(data[f"KV blocks: {k}"][1][i] for k in ("used (unshared)", "shared", "free"))
               for i in range(2)]
    assert stacked == [TOTAL, TOTAL]
    bars = {t.name: t for t in fig.data}["KV blocks: shared"]
    assert [list(c) for c in bars.customdata] == [[30, 64, "80%", 4, 8, 475],
                                                  [33, 64, "85%", 14, 0, 523]]
    assert fig.layout.title.text == (
        f"inference engine · {rates[-1][0] + rates[-1][2]:,.0f} generated tokens/s · 6 running, "
        "8 waiting, 0 swapped (2 replicas)<br>KV 63/128 blocks used (6 shared), 82% utilised · "
        "18 preemptions · 8 prefix-hit blocks")

    bounded = inference_traces(history, last=2)  # the pool-state file keeps its last points
    assert bounded["queue: waiting"]["x"] == times[-2:]
    assert bounded["queue: waiting"]["y"] == data["queue: waiting"][1][-2:]
    assert bounded["generated tokens/s: all replicas"]["y"] == pytest.approx(
        data["generated tokens/s: all replicas"][1][-2:])


def test_a_replica_is_its_leader_else_its_lowest_rank() -> None:
    a, b = {"replica": 0, "leader": False, "running": 1}, {"replica": 0, "leader": True}
    assert replicas({0: a, 1: b, 2: None}) == {"replica 0": (1, b)}
    assert replicas({0: a, 3: dict(a)}) == {"replica 0": (0, a)}  # the leader not yet seen
    alone = {"running": 2}  # no replica field: a replica of its own
    assert list(replicas({10: alone, 2: alone, 0: {"replica": 1}})) == [
        "rank 2", "rank 10", "replica 1"]


def test_blocks_without_a_replica_stand_alone_and_a_cell_without_steps_has_no_panel() -> None:
    ranks, history = Ranks({0: (None, None), 1: (None, None)}), RunHistory([0, 1])
    history.ingest(ranks.poll())
    data = trace_data(build_inference_figure(history, widget=False))
    assert data["KV blocks: free"][0] == ["rank 0", "rank 1"]
    assert data["queue: running"][1] == [4]  # _stats(None, ...) runs 4 on each: 2 ranks, 1 each
    assert set(data) >= {"generated tokens/s: rank 0", "generated tokens/s: rank 1"}

    for tel in ranks.tels.values():
        tel.pause()  # a new cell: telemetry forgets the engine's figures
    later = RunHistory([0, 1])
    later.ingest({r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": 9}}
                  for r, tel in ranks.tels.items()})
    assert later.has_data and later.inferences() == {}
    assert inference_traces(later) == {} and build_inference_figure(later) is None


def test_a_shown_dashboard_gains_the_panel_and_the_report_holds_it(tmp_path) -> None:
    ranks, history = Ranks(DP2_TP2), RunHistory([0, 1, 2, 3], label="engine.generate")
    history.ingest({r: {TELEMETRY_KEY: {**tel.snapshot(), "seq": 0}}
                    for r, tel in ranks.tels.items()})
    view = Dashboard(history)
    assert view.widget.children == (view.figure,)  # shown before any engine step
    for _ in range(3):
        history.ingest(ranks.poll())
        view.refresh()
    assert view.widget.children == (view.figure, view.inference_figure)
    assert trace_data(view.inference_figure) == trace_data(
        build_inference_figure(history, widget=False))  # updated in place: the same data
    assert view.inference_figure.layout.title.text.startswith("inference engine · ")
    report = view.to_html(tmp_path / "inference.html").read_text()
    assert report.count("Plotly.newPlot") == 2 and "queue: waiting" in report


# ---- real engines ------------------------------------------------------------------------
PROMPTS = [[1 + (i * 7 + j) % 60 for j in range(5 + 3 * i)] for i in range(8)]  # 5..26 tokens
NEW = 40
ENGINE = f"""
import time
import torch
import transformers
from kernels_runtime.inference import Engine, SamplingParams

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=128, bos_token_id=0,
    eos_token_id=0))
engine = Engine(model, plan, comm=comm, kv_mem="48KiB", block_size=8, max_num_seqs=4,
                verbose=False)
prompts = {PROMPTS!r}
params = SamplingParams(max_new_tokens={NEW}, ignore_eos=True)
"""


@interactive
def _engine_figures() -> tuple[dict, dict]:
    g = globals()
    return g["session"].telemetry.last_published, g["engine"].stats()


def _run_shown(shell, code: str):
    from workbench.ui.dashboard import LiveDashboard

    live = LiveDashboard([0, 1], mode="on", display=lambda view: None)
    shown: list[int] = []

    def sink(data: dict, final: bool) -> None:
        live(data, final)
        if not final:
            shown.append(len(live.view.widget.children))

    live.start()
    run_cell(active_pool(shell), code, stream=lambda *a: None, display=lambda *a: None,
             data_sink=sink)
    return live, shown


@pytest.mark.engines
def test_inference_panel_joins_while_an_engine_generates(shell, tmp_path) -> None:
    shell.run_cell_magic("colossal", '--plan "tp=2" --no-dashboard', ENGINE)
    live, shown = _run_shown(shell, "outs = engine.generate(prompts, params, "
                                    "on_step=lambda changed: time.sleep(0.03))")
    assert 2 in shown, f"the inference panel never joined the shown dashboard: {shown}"
    assert live.view.widget.children == (live.view.figure, live.view.inference_figure)

    figures = active_pool(shell).view([0, 1]).apply_sync(_engine_figures)
    for rank, (published, stats) in enumerate(figures):
        assert live.history.latest[rank] == published  # the final flush reached the notebook
        assert published["inference"] == stats  # what the engine says, as published
        assert stats["replica"] == 0 and stats["leader"] == (rank == 0)
        assert stats["generated_tokens"] == 8 * NEW and stats["finished"] == 8
    stats = figures[0][1]
    data = trace_data(live.view.inference_figure)
    assert data["KV blocks: free"] == (["replica 0"], [stats["blocks_free"]])  # one bar
    assert "generated tokens/s: replica 0" not in data  # one replica: the total alone
    tokens = data["generated tokens/s: all replicas"][1]
    assert max(tokens) > 0 and tokens[-1] == figures[0][0]["throughput"]["tokens_per_s"]
    waiting = data["queue: waiting"][1]
    assert max(waiting) > 0 and waiting[-1] == 0  # 8 requests queued for 4 seats, all served
    assert max(data["queue: running"][1]) <= 4  # max_num_seqs of the one replica, not 8
    assert f"{stats['preemptions']:,} preemptions" in live.view.inference_figure.layout.title.text
    report = workbench.show_dashboard(live.history).to_html(tmp_path / "engine.html")
    assert report_traces(report) == trace_data(live.view.figure)  # the main figure first


@pytest.mark.engines
def test_remote_engine_leaves_the_panel_of_both_replicas(shell) -> None:
    from kernels_runtime.inference import SamplingParams
    from workbench.inference import RemoteEngine

    shell.run_cell_magic("colossal", '--plan "dp=2" --no-dashboard', ENGINE)
    llm = RemoteEngine("engine")
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True),
                        show=False, dashboard="off")
    assert [len(o.token_ids) for o in outs] == [NEW] * 8
    figures = active_pool(shell).view([0, 1]).apply_sync(_engine_figures)
    assert [s["replica"] for _, s in figures] == [0, 1]
    assert all(s["leader"] for _, s in figures)
    data = trace_data(workbench.show_dashboard(llm.last_run).inference_figure)
    assert data["KV blocks: used (unshared)"][0] == ["replica 0", "replica 1"]
    assert data["KV blocks: free"][1] == [s["blocks_free"] for _, s in figures]
    assert data["generated tokens/s: all replicas"][1][-1] == pytest.approx(sum(
        p["throughput"]["tokens_per_s"] for p, _ in figures))

