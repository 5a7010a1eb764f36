"""What the two speculation lines of ``python -m bench inference`` (``speculation.py``,
prompt lookup; ``draft_speculation.py``, a draft model) share: one engine per rank process, a
timed greedy pass with the drafts counted over replicas, the rounds alternating which side goes
first, and the on / off figures behind each printed line.

Kept in one place so the two lines measure the same way: a figure of one is comparable with the
other's only while the timing, the counting and the token check cannot drift apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_ENGINE: dict[str, Any] = {}


def rank_engine(name: str, folder: str, build: Callable[[Any], Any]) -> Any:
    """This rank process's engine ``name`` (one per line), built once by ``build(model)`` on
    the model in ``folder`` and reused by every round (loading it each round would dwarf what
    is measured)."""
    torch.set_num_threads(1)
    if name not in _ENGINE:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()  # one bar per rank process, in the bench's table
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        _ENGINE[name] = build(model)
    return _ENGINE[name]


def release(rank: int, world: int) -> None:
    """Drop this rank's engines (their weights, KV caches and any draft)."""
    import gc

    _ENGINE.clear()
    gc.collect()


def timed_generate(engine: Any, requests: list[list[int]], params: Any,
                   draft_seconds: bool = False) -> dict:
    """``engine.generate`` between barriers: wall seconds (the same on every rank), generated
    tokens, the tokens themselves (gathered from every replica) and the drafts drafted and
    accepted, summed over replicas; with ``draft_seconds``, also the seconds spent drafting
    (summed over replicas, divided by the world: a mean per rank)."""
    before = engine.stats()
    drafting = engine.speculation.seconds if draft_seconds else 0.0
    dist.barrier()
    start = time.perf_counter()
    outs = engine.generate(requests, params)  # gathered from every replica
    dist.barrier()
    seconds = time.perf_counter() - start
    after = engine.stats()
    counts = [after[k] - before[k] for k in ("spec_drafted_tokens", "spec_accepted_tokens")]
    if draft_seconds:
        summed = torch.tensor(counts + [engine.speculation.seconds - drafting],
                              dtype=torch.float64)
    else:
        summed = torch.tensor(counts)
    dist.all_reduce(summed)  # each rank is a replica of its own
    out = {"seconds": seconds, "tokens": [o.token_ids for o in outs],
           "generated": sum(len(o.token_ids) for o in outs),
           "drafted": int(summed[0]), "accepted": int(summed[1])}
    if draft_seconds:
        out["draft_seconds"] = float(summed[2]) / dist.get_world_size()
    return out


def run_rounds(pool: Any, one_round: Callable, side_arg: Callable[[str], Any], spec: dict,
               rounds: int, folder: str | None) -> dict:
    """``rounds`` of ``one_round(rank, world, folder, spec, side_arg(side))`` on each side,
    alternating which side goes first, on the model in ``folder`` (None: the model cache's,
    converted on first use); ``{"skipped": why}`` when the model is not to be had. The engines
    are released after, so the model's memory is back before the other lines measure."""
    from workbench.models.smollm2 import smollm2_instruct

    try:
        folder = folder or str(smollm2_instruct())
    except Exception as err:  # noqa: BLE001 - no model: the line says why, the rest runs
        return {"skipped": f"{type(err).__name__}: {err}"}
    out: dict[str, list] = {"on": [], "off": []}
    for r in range(rounds):
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            out[side].append(pool.run(one_round, folder, spec, side_arg(side),
                                      timeout_s=1800)[0])
    pool.run(release)
    return out


def on_off_figures(out: dict, line: str, where: str) -> dict:
    """Check every round gave the greedy tokens of the first "off" round (else ``line`` changed
    them: a bug in ``where``); the tokens/s of each side, the rounds' on / off ratios and the
    acceptance rate (accepted over drafted, all "on" rounds)."""
    on, off = out["on"], out["off"]
    for a in on + off:
        if a["tokens"] != off[0]["tokens"]:
            raise AssertionError(f"{line} changed the greedy tokens: a bug in {where}")
    rate = {side: [r["generated"] / r["seconds"] for r in out[side]] for side in ("on", "off")}
    ratio = [a / b for a, b in zip(rate["on"], rate["off"])]
    drafted = sum(r["drafted"] for r in on)
    accepted = sum(r["accepted"] for r in on) / drafted if drafted else 0.0
    return {"rate": rate, "ratio": ratio, "median": statistics.median(ratio),
            "acceptance": accepted}
