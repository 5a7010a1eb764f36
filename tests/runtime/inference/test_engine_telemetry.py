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
