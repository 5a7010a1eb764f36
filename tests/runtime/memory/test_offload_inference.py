"""Weights on host and disk for inference: ``parallelize_model`` (no optimizer) under an
offloading plan keeps only the weights, in chunks, gathered to the device unit by unit as the
forward needs them.

Tiny HF GPT-2 on 2 real gloo ranks, fp32, zero 3 (weights sharded over dp and offloaded):
logits of every position equal the plain model's within 1e-6 (relative to the largest), with
static placement on the host tier and on the disk tier and with automatic placement under a
device budget little larger than one block gathered, which evicts every forward; the disk
tier's files hold exactly the bytes it accounts, each weight written once (read back, it is
unchanged, so evicting it again writes nothing); and a device budget below one block's weights
is an error naming the minimum.
"""

from __future__ import annotations

import pytest
import torch

from helpers import models as dm
from helpers.distributed import context

TOL = 1e-6


def _weight_bytes() -> int:
    return sum(p.numel() for p in dm.make_model("gpt2").parameters()) * 4


def _logits(rank: int, world: int, plan: str, spill: str) -> dict:
    from kernels_runtime import eval_step, parallelize_model

    x, y = dm.local_microbatches(0, rank, world, 1)[0]
    reference = dm.make_model("gpt2").eval()
    with torch.no_grad():
        expected = reference(input_ids=x).logits
    model = parallelize_model(dm.make_model("gpt2").eval(), ctx=context(plan), spill_dir=spill,
                              verbose=False)
    sync = model.parallel_state.model_state
    evictions = []
    with torch.no_grad():
        for _ in range(3):  # repeated forwards: chunks come back from where they were evicted
            before = sync.store.evictions
            got = model(input_ids=x).logits
            evictions.append(sync.store.evictions - before)
    loss = eval_step(model, [(x, y)], loss_fn=dm.hf_loss)
    with torch.no_grad():
        ref_loss = dm.hf_loss(reference, (x, y))
    torch.distributed.all_reduce(ref_loss)
    folder = sync.spill_folder
    sync.store.settle()  # writes in flight complete
    files = sum(f.stat().st_size for f in folder.iterdir()) if folder else 0
    return {"rel": ((got - expected).abs().max() / expected.abs().max()).item(),
            "loss": (loss, ref_loss.item() / world), "evictions": evictions,
            "tiers": sync.tier_bytes(), "files": files, "file_bytes": sync.store.file_bytes,
            "written": sync.store.disk.bytes_written if folder and files else 0,
            "released": all(p.numel() == 0 for p in model.transformer.h[0].parameters())}


CASES = {
    "static-host": "dp=2 zero=3 offload=static offload_params=1",
    "static-disk": "dp=2 zero=3 offload=static offload_params=1 host_mem=0",
    # a block gathered whole (49.6 KiB) and little room beside it for the 54.8 KiB of shards
    "auto-disk": "dp=2 zero=3 offload=auto device_mem=64KiB host_mem=16KiB",
}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_weights_give_the_plain_models_logits(ranks, tmp_path, case):
    out = ranks(2).run(_logits, CASES[case], str(tmp_path), timeout_s=300)
    for rank, result in enumerate(out):
        print(f"{case} rank {rank}: logits rel {result['rel']:.1e}, evictions per forward "
              f"{result['evictions']}, tiers {result['tiers']}")
        assert result["rel"] <= TOL, f"{case}: logits differ by {result['rel']:.1e}"
        loss, ref = result["loss"]
        assert abs(loss - ref) <= TOL * abs(ref), (loss, ref)
        assert result["released"], "a block's weights stayed gathered after the forward"
        assert result["tiers"]["device"] == 0 or case.startswith("auto")
        # the folder holds what the store accounts for: the disk tier and copies of weights
        # read back (unchanged: evicting them again writes nothing), one file per chunk shard
        assert result["files"] == result["file_bytes"], result
        assert result["tiers"]["disk"] <= result["files"] <= _weight_bytes() // 2, result
        assert result["written"] == result["files"], "a weight was written more than once"
        if case != "static-host":
            assert result["tiers"]["disk"] > 0, f"{case}: nothing on disk"
        if case.startswith("auto"):
            assert all(e > 0 for e in result["evictions"]), result["evictions"]
            assert result["tiers"]["device"] <= 64 * 2**10


def _too_small(rank: int, world: int) -> str:
    from kernels_runtime import parallelize_model
    from kernels_runtime.memory.placement import BudgetError

    try:
        parallelize_model(dm.make_model("gpt2"), ctx=context("dp=2 zero=3 offload=auto "
                                                             "device_mem=8KiB"), verbose=False)
    except BudgetError as err:
        return str(err)
    return "no error"


def test_a_device_budget_below_one_blocks_weights_names_the_minimum(ranks):
    message = ranks(2).run(_too_small)[0]
    # one block of the tiny GPT-2: 12,704 fp32 weights gathered whole, no gradient buffer
    assert "device_mem=8.00 KiB < 49.6 KiB" in message, message
