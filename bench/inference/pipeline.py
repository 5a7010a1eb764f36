"""The pipeline line of ``python -m bench inference``: pp=2 tokens/s with micro-batches in
flight on every stage (``kernels_runtime/inference/pipelined.py``) against the same engine with
its stages run one after another (``pipeline_overlap=False``), on the bench's workload.

Both engines are built once per rank process (``pp=2``, ``dp=ranks/2``, the spec's batch, step
budget and KV memory, prefix sharing off as in the throughput rounds) and reused over rounds.
Both run forwards of at most ``batch`` sequences and ``batch_tokens`` tokens; the overlapped one
keeps two such micro-batches in flight (so up to twice the sequences share the KV memory);
the rounds interleave the two sides, their order alternating. Every request's tokens must be
the same on both sides (asserted: greedy, so only a near-tie of the random weights, computed in
batches of another shape, could flip one; the count of differing requests is printed before the
assertion fails). Aim: overlapped / plain >= 1.3. ``--only pipeline`` runs this line alone.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.common.spread import spread

SIDES = ("overlapped", "plain")
_ENGINES: dict[tuple, Any] = {}


def _engine(spec: dict, world: int, overlap: bool) -> Any:
    from bench.inference.ranks import model
    from kernels_runtime.inference import Engine

    key = (tuple(sorted(spec.items())), overlap)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(model(spec), f"pp=2 dp={world // 2}", kv_mem=spec["kv_mem"],
                               max_num_seqs=spec["batch"],
                               max_batch_tokens=spec["batch_tokens"], prefix_sharing=False,
                               pipeline_overlap=overlap, verbose=False)
    return _ENGINES[key]


def pipeline_round(rank: int, world: int, spec: dict, side: str) -> dict:
    """One side's whole workload on the pp=2 engine: wall seconds and every request's tokens."""
    from bench.inference.ranks import _params, workload

    torch.set_num_threads(1)
    requests = workload(spec)
    engine = _engine(spec, world, side == "overlapped")
    steps = engine.totals["steps"]
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate([p for p, _ in requests], _params(requests))
    cpu = time.process_time() - cpu
    dist.barrier()
    return {"seconds": time.perf_counter() - start, "tokens": sum(n for _, n in requests),
            "ids": [o.token_ids for o in outs], "steps": engine.totals["steps"] - steps,
            "cpu": cpu}


def run(pool: Any, spec: dict, rounds: int) -> dict:
    if pool.world_size % 2:
        raise ValueError(f"the pipeline line runs pp=2: give an even number of ranks, not "
                         f"{pool.world_size}")
    out: dict = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in SIDES[r % 2:] + SIDES[:r % 2]:
            ranks = pool.run(pipeline_round, spec, side, timeout_s=1800)
            out[side].append(dict(ranks[0], cpu=[r["cpu"] for r in ranks]))
    return out


def report(out: dict, spec: dict) -> dict:
    rates = {side: [r["tokens"] / r["seconds"] for r in out[side]] for side in SIDES}
    ratio = [o / p for o, p in zip(rates["overlapped"], rates["plain"])]
    first, other = out["overlapped"][0]["ids"], out["plain"][0]["ids"]
    differ = sum(a != b for a, b in zip(first, other))
    print(f"pp=2 pipeline, {spec['requests']} requests, forwards of <= {spec['batch']} "
          f"sequences / {spec['batch_tokens']} tokens: overlapped (2 micro-batches in flight) "
          f"{spread(rates['overlapped'], digits=1)} tokens/s in "
          f"{out['overlapped'][0]['steps']} micro-batches; plain (stage after stage) "
          f"{spread(rates['plain'], digits=1)} tokens/s in {out['plain'][0]['steps']} steps")
    print(f"pp=2 overlapped / plain tokens/s: {statistics.median(ratio):.2f}x "
          f"({min(ratio):.2f}-{max(ratio):.2f}) over {len(ratio)} rounds (aim >= 1.3x); "
          f"tokens identical: {differ == 0} ({differ} of {len(first)} requests differ); "
          f"load average now {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for side in SIDES:  # both stages busy at once needs a free core each: see how busy they were
        busy = [statistics.median(r["cpu"][i] / r["seconds"] for r in out[side])
                for i in range(len(out[side][0]["cpu"]))]
        print(f"pp=2 {side}: CPU seconds / wall seconds per rank " +
              ", ".join(f"{b:.2f}" for b in busy))
    # a loaded machine gives the pair less than a core each (the fractions above sum to < 1
    # when it gave them under one core in all): then only CPU seconds tell what a free core
    # per stage would give; plain stages run in series (their CPU seconds add up), overlapped
    # ones side by side (the busier rank's) - an estimate, over-generous to plain (its two
    # ranks do their bookkeeping side by side) and blind to waits for messages
    estimate = [sum(p["cpu"]) / max(o["cpu"]) for o, p in zip(out["overlapped"], out["plain"])]
    print(f"pp=2 overlapped / plain, CPU-bound estimate for a free core per stage (not a "
          f"measurement): {spread(estimate, digits=2)}x")
    assert differ == 0, f"{differ} requests got other tokens with the pipeline overlapped"
    for side in SIDES:  # every round repeats the first's tokens
        assert all(r["ids"] == out[side][0]["ids"] for r in out[side]), side
    return {"pipeline": statistics.median(ratio)}
