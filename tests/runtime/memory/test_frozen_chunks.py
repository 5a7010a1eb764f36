"""A frozen base under offload is streamed block by block, and holds weights only.

What is protected (``memory/frozen_chunks.py``): on one gloo rank, the LLaMA conformance family
with LoRA adapters under ``dp=1 zero=2 offload=static offload_params=1 host_mem=0`` (the base
on disk) gathers a unit's frozen chunks for its forward and again for its backward and releases
them after, so at no moment are two blocks' frozen weights on the device; a frozen chunk never
gets a gradient buffer, a reduction, a master or optimizer state, and no frozen parameter
gets ``.grad``. The two-rank parity against single-process peft is
``tests/conformance/test_lora_offload.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

PLAN = "dp=1 zero=2 offload=static offload_params=1 host_mem=0"


def _stream_on_rank(rank: int, world: int, spill_dir: str) -> dict:
    from conformance.families import FAMILIES, pieces_of
    from conformance.lora import with_lora

    from kernels_runtime import parallelize, train_step

    from helpers.distributed import context

    family = FAMILIES["llama"]
    model = with_lora(family, family.build())
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=family.lr,
                                                    momentum=0.9),
                             ctx=context(PLAN), verbose=False, spill_dir=spill_dir)
    sync = opt.sync
    block_units = {u for u, unit in enumerate(sync.units) if ".layers." in unit.path}
    frozen_blocks = {c.index: c.unit for c in sync.chunks if c.frozen and c.unit in block_units}
    most, reduced = [0], []
    gather, reduce = sync.gather, sync.reducer.reduce

    def watched_gather(i: int) -> None:  # how many blocks' frozen weights are on the device
        gather(i)
        most[0] = max(most[0], len({frozen_blocks[j] for j in sync._gathered
                                    if j in frozen_blocks}))

    def watched_reduce(i: int) -> None:
        reduced.append(sync.chunks[i].frozen)
        reduce(i)

    sync.gather, sync.reducer.reduce = watched_gather, watched_reduce
    losses = [train_step(model, opt, pieces_of(family, s, 1, 1)[0]).loss for s in range(2)]
    frozen = [c.index for c in sync.chunks if c.frozen]
    return {"losses": losses, "most_blocks": most[0], "blocks": len(block_units),
            "frozen_reduced": any(reduced), "reductions": len(reduced),
            "frozen_tiers": {sync.param[i].tier.label for i in frozen},
            "frozen_extras": [i for i in frozen if sync.grad[i] is not None or sync.states[i]
                              or sync.master[i] is not sync.param[i]],
            "frozen_grads": [n for n, p in model.named_parameters()
                             if not p.requires_grad and p.grad is not None],
            "gathered_after": sorted(sync._gathered)}


@pytest.mark.full  # 8 s on this loaded 2-core VM: over the slow tier's 5 s
def test_frozen_base_streams_one_block_at_a_time(ranks, tmp_path: Path):
    from kernels_runtime.memory.spill import MEMORY_FILESYSTEMS, mount_of

    spill = tmp_path if mount_of(tmp_path)[1] not in MEMORY_FILESYSTEMS else Path("/var/tmp")
    r = ranks(1).run(_stream_on_rank, str(spill), timeout_s=300)[0]
    assert r["blocks"] == 2 and r["most_blocks"] == 1, r
    assert not r["frozen_reduced"] and r["reductions"] > 0, r
    assert r["frozen_tiers"] == {"disk"} and not r["frozen_extras"], r
    assert not r["frozen_grads"] and not r["gathered_after"], r
    assert r["losses"][1] < r["losses"][0], r["losses"]
