"""An engine's figures reach the rank's telemetry snapshot (what the dashboard's inference panel
draws): cumulative requests and tokens, the queue and the KV blocks, and generated tokens/s.
"""

from __future__ import annotations

from helpers import inference as inf
from helpers.distributed import process_comm


def _snapshots(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.inference import Engine, SamplingParams

    comm = process_comm()
    engine = Engine(inf.load("gpt2", path), "dp=1", comm=comm, verbose=False)
    seen = []
    for _ in engine.stream(inf.prompts((20, 40, 9)), SamplingParams(max_new_tokens=12)):
        block = comm.telemetry.snapshot()["inference"]
        seen.append((block["running"] + block["waiting"], block["blocks_used"]))
    snap = comm.telemetry.snapshot()
    comm.telemetry.pause()  # a new cell: no engine figures until an engine steps again
    return {"inference": snap["inference"], "throughput": snap["throughput"], "seen": seen,
            "after_pause": comm.telemetry.snapshot()["inference"]}


def test_engine_figures_reach_the_telemetry_snapshot(ranks, trained):
    out = ranks(1).run(_snapshots, trained["gpt2"])[0]
    block = out["inference"]
    assert block["requests"] == 3 and block["finished"] == 3
    assert block["generated_tokens"] == 36 and block["prompt_tokens"] == 69
    assert block["blocks_used"] == 0 and block["blocks_total"] > 0
    assert block["steps"] == 12 and block["kv_utilisation"] > 0.5
    assert max(q for q, _ in out["seen"]) == 3 and max(b for _, b in out["seen"]) >= 5
    assert out["throughput"]["tokens_per_s"] > 0
    assert out["after_pause"] is None


def _serve_back_to_back(rank: int, world: int, path: str) -> dict:
    """``serve`` on one rank with a scripted front end: request A, then, the moment the engine
    is idle, request B (a client's next request), then nothing for a whole wait, then stop."""
    from kernels_runtime.inference import Engine
    from kernels_runtime.inference.commands import Command
    from kernels_runtime.inference.service import serve

    comm = process_comm()
    engine = Engine(inf.load("gpt2", path), "dp=1", comm=comm, verbose=False)
    published: list[tuple[int, int, int]] = []  # (requests, running, blocks_used) per publish

    def record(snapshot: dict) -> None:
        block = snapshot.get("inference") or {}
        published.append((block.get("requests", 0), block.get("running", 0),
                          block.get("blocks_used", 0)))

    comm.telemetry.publisher.install(record)
    script = [[Command("completion", "a", "def f(x):", {"max_new_tokens": 6})],
              [Command("completion", "b", "import os", {"max_new_tokens": 6})], [],
              [Command("stop")]]
    idle_waits: list[float] = []

    def receive(timeout_s: float) -> list:
        if timeout_s == 0.0:  # the engine has work: nothing new this turn
            return []
        idle_waits.append(timeout_s)  # the engine is idle: the next scripted turn
        return script.pop(0)

    serve(engine, receive, lambda deltas: None)
    comm.telemetry.publisher.install(None)
    return {"published": published, "idle_waits": len(idle_waits)}


def test_serving_publishes_idle_figures_only_after_a_whole_idle_wait(ranks, trained):
    """Between two back-to-back requests the engine is idle for a moment; flushing that moment
    (which restarts the publisher's interval) would keep a busy replica's figures from the
    dashboard, so the idle figures go out only after a wait that brought nothing, and then
    with no block held. An abort that leaves the engine idle is covered by the same path."""
    out = ranks(1).run(_serve_back_to_back, trained["gpt2"])[0]
    published = out["published"]
    assert out["idle_waits"] == 4
    idle_between = [p for p in published if p[0] == 1 and p[1] == 0]  # A done, B not in yet
    assert not idle_between, published
    assert published[-1][:3] == (2, 0, 0), published  # the last figures: idle, no block held
