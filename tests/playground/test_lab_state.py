"""Pool-state files and the ``workbench lab`` command line, without a server.

What is protected: a pool started outside a kernel writes nothing unless asked; with
publishing on, the file follows the pool through start, a cell (busy, telemetry, idle), stop
and removal; a pipeline cell's file carries the stage timeline as the very traces the
notebook's figure draws, and the pipeline's point-to-point bytes apart from its collectives;
an offloading cell's file carries the offload panel (model state per tier per rank, bytes
moved per step) as the notebook's traces, and a cell without offload none; a generating
cell's file carries the inference panel (tokens/s, the queue, KV blocks) as the notebook's
traces, each replica counted once, and none before an engine stepped; while an endpoint
serves, the file carries its block (address, state, rates, queue, KV blocks, its panel) and
the serving ranks' telemetry as the running cell, rate-limited, and neither once it stopped;
a file of a dead
process is never listed and gets deleted; a malformed pool id cannot name a file; the server
extension module does not import torch; ``workbench lab`` builds the JupyterLab command the
README promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from workbench.ui.lab import state
from workbench.ui.lab.state import PoolStateFile, read_pool, read_pools


@pytest.fixture
def runtime(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "workbench"


def _snapshot(seq: int, steps: int) -> dict:
    return {"colossal_telemetry": {
        "seq": seq, "time": 1000.0 + seq, "steps": steps,
        "seconds": {"step": 1.0, "compute": 0.5, "comm": 0.25, "waiting": 0.25},
        "throughput": {"tokens_per_s": 100.0 * steps},
        "memory": {"device_allocated": 0, "host_rss": 123 << 20, "disk_spill": 7},
        "comm_by_axis": {"world": {"bytes": 64 * steps}},
    }}


def test_outside_a_kernel_nothing_is_written(runtime):
    published = PoolStateFile()
    assert published.kernel_id is None and not published.enabled
    published.update("starting")
    assert not runtime.exists()


def test_file_follows_the_pool_through_a_cell(runtime):
    f = PoolStateFile(enabled=True, min_interval_s=0.0)
    f.update("running", world_size=2, ranks=[
        state.rank_row({"host": "h", "pid": 1, "device": "cpu", "backend": "gloo",
                        "memory": {"host_rss": 5}}, r, 10 + r, "idle") for r in (0, 1)])
    [doc] = read_pools()
    assert doc["id"] == f.pool_id and doc["pid"] == os.getpid() and doc["state"] == "running"
    assert doc["ranks"][1]["memory"] == {"device": 0, "host": 5, "disk": 0}

    f.cell_started("train()", [0, 1])
    assert read_pool(f.pool_id)["state"] == "busy"
    for seq in (1, 2, 3):
        f.cell_data({0: _snapshot(seq, seq), 1: _snapshot(seq, seq)})
    doc = read_pool(f.pool_id)
    cell = doc["cell"]
    assert cell["running"] and cell["points"] == 3 and cell["series"]["t"] == sorted(
        cell["series"]["t"])
    assert cell["series"]["tokens_per_s"]["1"] == [100.0, 200.0, 300.0]
    assert cell["series"]["comm_bytes"]["world"] == [128, 256, 384]
    assert {r["state"] for r in doc["ranks"]} == {"busy"}
    assert doc["ranks"][0]["memory"] == {"device": 0, "host": 123 << 20, "disk": 7}

    f.cell_data({0: _snapshot(4, 4), 1: _snapshot(4, 4)}, final=True)
    f.cell_finished()
    doc = read_pool(f.pool_id)
    assert doc["state"] == "running" and not doc["cell"]["running"]
    assert {r["state"] for r in doc["ranks"]} == {"idle"}

    f.update("stopped", ranks=[])
    assert read_pool(f.pool_id)["state"] == "stopped"
    f.remove()
    assert read_pools() == []


def _pipeline_snapshot(rank: int) -> dict:
    from kernels_runtime.telemetry import compact_timeline

    events = [{"kind": kind, "chunk": 0, "mb": mb, "stage": rank, "start": 0.01 * i,
               "end": 0.01 * i + 0.008, "wait": 0.002 * rank}
              for i, (kind, mb) in enumerate((k, mb) for k in "FB" for mb in range(4))]
    snap = _snapshot(2, 2)["colossal_telemetry"]
    snap.update(comm_by_axis={"pp": {"bytes": 1004}}, p2p_by_axis={"pp": {
        "sent": 500, "received": 500}}, pipeline=compact_timeline({
            "schedule": "1f1b", "stage": rank, "stages": 2, "chunks": 1, "microbatches": 4,
            "step_seconds": 0.09, "waited_seconds": 0.016 * rank, "bubble": 0.18 * rank,
            "p2p_bytes": 500, "events": events}, step=1))
    return {"colossal_telemetry": snap}


def test_a_pipeline_cell_carries_its_stage_timeline(runtime):
    from workbench.ui.dashboard.figures import build_stage_figure

    f = PoolStateFile(enabled=True, min_interval_s=0.0)
    f.update("running")
    f.cell_started("pipeline", [0, 1])
    f.cell_data({0: _snapshot(1, 1), 1: _snapshot(1, 1)})
    assert read_pool(f.pool_id)["cell"]["stages"] is None  # no pipeline yet: no panel
    assert read_pool(f.pool_id)["cell"]["offload"] is None  # and no offload ever
    f.cell_data({r: _pipeline_snapshot(r) for r in (0, 1)}, final=True)
    cell = read_pool(f.pool_id)["cell"]
    stages = cell["stages"]
    assert stages["title"].endswith("bubble: rank 0 0%, rank 1 18%")
    assert stages["yaxis"]["categoryarray"] == ["rank 0 · stage 0", "rank 1 · stage 1"]
    figure = build_stage_figure(f.history, widget=False)
    drawn = {t.name: (list(t.y), list(t.base), list(t.text)) for t in figure.data}
    assert {t["name"]: (t["y"], t["base"], t["text"]) for t in stages["traces"]} == drawn
    assert cell["series"]["p2p_bytes"] == {"pp": [0, 1000]}  # sent, summed over ranks
    assert cell["series"]["comm_bytes"]["pp"] == [0, 8]  # the collectives alone
    assert cell["latest"]["1"]["p2p_bytes"] == {"pp": 500}


def test_an_offloading_cell_carries_its_offload_panel(runtime):
    from kernels_runtime.telemetry import Telemetry
    from workbench.ui.dashboard.figures import build_offload_figure

    tels = [Telemetry(), Telemetry()]
    f = PoolStateFile(enabled=True, min_interval_s=0.0)
    f.update("running")
    f.cell_started("offload", [0, 1])
    f.cell_data({r: _snapshot(1, 1) for r in (0, 1)})
    cell = read_pool(f.pool_id)["cell"]
    assert cell["offload"] is None and cell["latest"]["0"]["offload_tiers"] is None
    for seq in (2, 3, 4):
        published = {}
        for rank, tel in enumerate(tels):
            tel.record_offload({"device": 0, "host": 10 * rank, "disk": 4096 + seq},
                               {"host->disk": 512 * seq, "disk->host": 512}, 3, 0.002)
            snap = {**_snapshot(seq, seq)["colossal_telemetry"], "offload": tel.offload}
            published[rank] = {"colossal_telemetry": snap}
        f.cell_data(published, final=seq == 4)
    cell = read_pool(f.pool_id)["cell"]
    offload = cell["offload"]
    assert offload["title"].startswith("model state per tier · 5.0 KiB moved last step")
    assert offload["layout"]["yaxis3"]["overlaying"] == "y2"
    figure = build_offload_figure(f.history, widget=False)  # what the notebook draws
    drawn = {t.name: (list(t.x), list(t.y)) for t in figure.data}
    assert {t["name"]: (t["x"], t["y"]) for t in offload["traces"]} == drawn
    assert drawn["model state: disk"] == (["rank 0", "rank 1"], [4100, 4100])
    assert drawn["moved: host->disk"][1] == [2 * 512 * 2, 2 * 512 * 3, 2 * 512 * 4]
    assert cell["latest"]["1"]["offload_tiers"] == {"device": 0, "host": 10, "disk": 4100}
    assert cell["stages"] is None  # no pipeline in this cell


def _inference_snapshot(seq: int, rank: int) -> dict:
    """One rank of a tp=2 engine (one replica over ranks 0 and 1) after ``seq`` polls."""
    snap = _snapshot(seq, seq)["colossal_telemetry"]
    snap["inference"] = {"replica": 0, "leader": rank == 0, "running": 3, "waiting": 9 - seq,
                         "swapped": 0, "blocks_total": 40, "blocks_used": 10 + seq,
                         "blocks_free": 30 - seq, "blocks_shared": 4, "block_size": 16,
                         "kv_tokens": 150, "preemptions": seq, "prefix_hit_blocks": 6,
                         "kv_utilisation": 0.75, "steps": 10 * seq, "generated_tokens": 30 * seq}
    return {"colossal_telemetry": snap}


def test_an_inference_cell_carries_its_inference_panel(runtime):
    from workbench.ui.dashboard.figures import build_inference_figure

    f = PoolStateFile(enabled=True, min_interval_s=0.0)
    f.update("running")
    f.cell_started("engine.generate", [0, 1])
    f.cell_data({r: _snapshot(1, 1) for r in (0, 1)})  # published before the first step
    cell = read_pool(f.pool_id)["cell"]
    assert cell["inference"] is None and cell["latest"]["0"]["inference"] is None
    for seq in (2, 3, 4):
        f.cell_data({r: _inference_snapshot(seq, r) for r in (0, 1)}, final=seq == 4)
    cell = read_pool(f.pool_id)["cell"]
    panel = cell["inference"]
    assert panel["title"] == (
        "inference engine · 400 generated tokens/s · 3 running, 5 waiting, 0 swapped (1 "
        "replica)<br>KV 14/40 blocks used (4 shared), 75% utilised · 4 preemptions · 6 "
        "prefix-hit blocks")  # rank 0 alone stands for the replica: nothing counted twice
    assert panel["layout"]["xaxis3"]["anchor"] == "y3" and panel["layout"]["barmode"] == "stack"
    figure = build_inference_figure(f.history, widget=False)  # what the notebook draws
    drawn = {t.name: (list(t.x), list(t.y)) for t in figure.data}
    assert {t["name"]: (t["x"], t["y"]) for t in panel["traces"]} == drawn
    assert drawn["queue: waiting"][1] == [7, 6, 5] and drawn["queue: running"][1] == [3] * 3
    assert drawn["KV blocks: free"] == (["replica 0"], [26])
    assert cell["latest"]["1"]["inference"]["blocks_used"] == 14
    assert cell["latest"]["1"]["inference"]["leader"] is False
    assert cell["offload"] is None and cell["stages"] is None


def test_a_serving_endpoint_writes_its_block_and_the_serving_ranks(runtime):
    from workbench.ui.dashboard import RunHistory
    from workbench.ui.dashboard.endpoint import EndpointHistory, EndpointSample

    f = PoolStateFile(enabled=True)
    f.update("running", world_size=2, ranks=[
        state.rank_row({"host": "h", "memory": {"host_rss": 5}}, r, 10 + r, "idle")
        for r in (0, 1)])
    assert read_pool(f.pool_id)["endpoint"] is None  # nothing serves
    url = "http://127.0.0.1:8123/v1"
    history = RunHistory([0, 1], label=f"serving engine at {url}")
    endpoint = EndpointHistory(url, "engine", replicas=1)
    for seq in (2, 3, 4):
        f.min_interval_s = 0.0 if seq == 2 else 60.0  # the first sample is due at once
        history.ingest({r: _inference_snapshot(seq, r) for r in (0, 1)})
        endpoint.sample(EndpointSample(3 * seq, 0, 4, 3, 9 - seq, 10 + seq, 40))
        f.serving_data(history, endpoint)
    doc = read_pool(f.pool_id)  # written once: the others came within min_interval_s
    assert doc["state"] == "running" and {r["state"] for r in doc["ranks"]} == {"busy"}
    assert doc["endpoint"]["requests"] == 6 and doc["cell"]["points"] == 1
    assert doc["ranks"][0]["memory"]["host"] == 123 << 20  # from the serving ranks' snapshot
    assert doc["cell"]["label"] == f"serving engine at {url}" and doc["cell"]["running"]
    assert doc["cell"]["inference"]["traces"]  # the inference panel of the serving ranks

    f.min_interval_s = 0.0
    f.serving_data(history, endpoint)
    doc = read_pool(f.pool_id)
    block = doc["endpoint"]
    assert {k: block[k] for k in ("url", "status", "requests", "in_flight", "running",
                                  "waiting", "kv_used", "kv_total")} == {
        "url": url, "status": "serving", "requests": 12, "in_flight": 4, "running": 3,
        "waiting": 5, "kv_used": 14, "kv_total": 40}
    assert block["line"] == endpoint.line() and block["panel"]["title"].startswith(
        f"endpoint engine at {url}: serving, ")
    assert {t["name"] for t in block["panel"]["traces"]} >= {"endpoint: requests/s",
                                                           "endpoint: in flight"}
    assert doc["cell"]["points"] == 3

    f.min_interval_s = 60.0
    f.serving_data(history, endpoint, final=True)  # serving stopped: always written
    doc = read_pool(f.pool_id)
    assert doc["endpoint"] is None and not doc["cell"]["running"]
    assert {r["state"] for r in doc["ranks"]} == {"idle"}


def test_writes_during_a_cell_are_rate_limited(runtime):
    f = PoolStateFile(enabled=True, min_interval_s=60.0)
    f.update("running")
    f.cell_started("x", [0])
    for seq in range(1, 20):
        f.cell_data({0: _snapshot(seq, seq)})
    assert read_pool(f.pool_id)["cell"]["points"] == 0  # nothing since the forced write
    f.cell_data({0: _snapshot(20, 20)}, final=True)  # the end of a cell is always written
    assert read_pool(f.pool_id)["cell"]["points"] == 20


def test_files_of_dead_processes_are_dropped(runtime):
    f = PoolStateFile(enabled=True)
    f.update("running")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    doc = json.loads(f.path.read_text())
    doc.update(id="0000000000aa", pid=int(dead.stdout))
    stale = runtime / "pool-0000000000aa.json"
    stale.write_text(json.dumps(doc))
    assert read_pool("0000000000aa") is None
    assert [d["id"] for d in read_pools()] == [f.pool_id]
    assert not stale.exists()


def test_malformed_ids_name_no_file(runtime):
    runtime.mkdir(parents=True)
    (runtime / "pool-..json").write_text("{}")
    for bad in ("..", "../etc/passwd", "ABCDEF012345", "0123456789abc", ""):
        assert read_pool(bad) is None


def test_a_new_pool_replaces_the_ended_pools_of_its_process(runtime):
    old = PoolStateFile(enabled=True)
    old.update("failed", error="PoolError: boom")
    new = PoolStateFile(enabled=True)
    new.update("starting")
    assert [d["id"] for d in read_pools()] == [new.pool_id]


def test_server_extension_does_not_import_torch():
    code = ("import sys, workbench.ui.lab.handlers, workbench.ui.lab.actions; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out


def test_lab_command_line():
    from workbench.cli import REPO_ROOT, lab_command

    args = Namespace(notebook_dir=None, port=9999, no_browser=True,
                     lab_args=["--IdentityProvider.token=t"])
    cmd = lab_command(args)
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={REPO_ROOT / 'notebooks'}" in cmd
    assert "--ServerApp.port=9999" in cmd and "--no-browser" in cmd
    assert ("--allow-root" in cmd) == (os.geteuid() == 0)
    assert cmd[-1] == "--IdentityProvider.token=t"
