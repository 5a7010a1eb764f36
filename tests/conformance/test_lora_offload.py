"""LoRA with its frozen base offloaded (host or disk) trains like single-process peft.

What is protected: under ``offload=static offload_params=1`` (and ``host_mem=0``: beyond a zero
host budget, the disk, in a spill folder on a real disk), the frozen base of a peft
``PeftModel`` is chunked and placed like parameters (``memory/frozen_chunks.py``), gathered
for each unit's forward and backward and released after. For the LLaMA conformance family and
the real SmolLM2 cut to two blocks, random rank-8 adapters trained three SGD steps on 2 gloo
ranks give single-process peft's losses (1e-5 relative) and first-step gradient of every
adapter parameter (1e-5 relative L2, from the pieces each rank writes); no frozen parameter
ever holds ``.grad``. From the store and placer: every frozen weight lives in a weights-only
chunk on the expected tier (host, or a spill file of exactly its bytes on disk), with no
gradient, master or optimizer state and no checkpoint piece, and ``memory_breakdown()`` equals
frozen weights (this rank's share) + adapters + adapter gradients + adapter states.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conformance import harness
from conformance.families import FAMILIES, pieces_of, smollm2_folder
from conformance.lora import with_lora

from helpers.disk import disk_folder

pytest.importorskip("peft")

STATIC = "offload=static offload_params=1"
CASES: list[tuple[str, str, str]] = [  # family, plan, where the frozen base lives
    ("llama", f"dp=2 zero=2 {STATIC}", "host"),
    ("llama", f"dp=2 zero=3 {STATIC}", "host"),  # this rank's shard of the base
    ("llama", f"dp=2 zero=2 {STATIC} host_mem=0", "disk"),
    ("llama", f"dp=2 zero=3 {STATIC} offload_grads=1 offload_optim=1 host_mem=0", "disk"),
    # automatic: the budgets hold one block's step, the rest of the base spills to disk
    ("llama", "dp=2 zero=2 offload=auto device_mem=1400000 host_mem=900000", "disk"),
    ("llama", "dp=2 zero=3 offload=auto device_mem=1500000 host_mem=400000", "disk"),
    ("smollm2", f"dp=2 zero=2 {STATIC}", "host"),
    ("smollm2", f"dp=2 zero=2 {STATIC} host_mem=0", "disk"),
]


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Iterator[Path]:
    """A folder on a real disk (the spill folder refuses tmpfs): ``helpers.disk``'s."""
    with disk_folder(tmp_path_factory.mktemp("lora-spill"), "lora-spill-") as folder:
        yield folder


def _placement(model: torch.nn.Module, opt) -> dict:
    """Where the frozen base is, read from the store and the placer."""
    sync = opt.sync
    sync.store.settle()  # write-behinds complete: the files are whole
    frozen = [c for c in sync.chunks if c.frozen]
    files = {p.name: p.stat().st_size for p in sync.spill_folder.iterdir()} \
        if sync.spill_folder else {}
    chunks = []
    for c in frozen:
        param = sync.param[c.index]
        chunks.append({"tier": param.tier.label, "home": sync.placer.home[param.key].label,
                       "nbytes": param.nbytes, "file": files.get(param.key),
                       "whole": param.numel == c.padded, "master_is_param":
                       sync.master[c.index] is param, "grad": sync.grad[c.index] is not None,
                       "states": len(sync.states[c.index]), "numel": c.numel})
    named = {n for c in frozen for n in c.names}
    want_frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    pieces = {p.shard.name for p in opt.pieces(saving=True)}
    trained = [c for c in sync.chunks if not c.frozen]
    adapter_bytes = sum(sync.param[c.index].nbytes for c in trained)
    grads = sum(sync.grad[c.index].nbytes for c in trained if sync.grad[c.index] is not None)
    states = sum(p.nbytes for c in trained for p in sync.states[c.index].values())
    masters = sum(sync.master[c.index].nbytes for c in trained
                  if sync.master[c.index] is not sync.param[c.index])
    return {"chunks": chunks, "covers": named == want_frozen and bool(named),
            "frozen_in_pieces": sorted(pieces & want_frozen),
            "breakdown": dict(opt.memory_breakdown()), "tiers": sync.tier_bytes(),
            "adapter_params": adapter_bytes,
            "adapter_grads": grads, "adapter_optimizer": states + masters}


def train_offloaded_on_rank(rank: int, world: int, family_name: str, plan: str,
                            spill_dir: str, smollm2: str | None) -> dict:
    """``harness.train_on_rank`` with a spill folder, plus the placement after the steps
    (and after one more backward, so adapter gradients exist in the breakdown)."""
    from kernels_runtime import parallelize, train_step

    from helpers.distributed import context

    if smollm2 is not None:
        smollm2_folder(Path(smollm2))
    family = FAMILIES[family_name]
    model = with_lora(family, family.build())
    frozen_numel = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    ctx = context(plan)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=family.lr,
                                                    momentum=harness.MOMENTUM),
                             ctx=ctx, verbose=False, spill_dir=spill_dir)
    losses, grads, frozen_grads = [], [], set()
    for step in range(harness.STEPS):
        mine = pieces_of(family, step, ctx.dp_size, ctx.plan.microbatches)[ctx.dp_rank]
        losses.append(train_step(model, opt, mine).loss)
        if step == 0:
            grads = [(p.shard.name, p.shard.offsets, p.shard.sizes,
                      p.values["momentum_buffer"].detach().float().clone())
                     for p in opt.pieces(saving=True) if "momentum_buffer" in p.values]
        frozen_grads |= {n for n, p in model.named_parameters()
                         if not p.requires_grad and p.grad is not None}
    batch = pieces_of(family, 0, ctx.dp_size, 1)[ctx.dp_rank][0]
    opt.backward(model(**batch).loss)
    opt.finish_grad_sync()
    frozen_grads |= {n for n, p in model.named_parameters()
                     if not p.requires_grad and p.grad is not None}
    placement = _placement(model, opt)
    placement["frozen_numel"] = frozen_numel  # released parameters are empty: counted before
    opt.zero_grad()
    return {"losses": losses, "grads": grads, "frozen_grads": sorted(frozen_grads),
            "placement": placement}


def _id(family: str, plan: str, where: str) -> str:
    zero = "zero3" if "zero=3" in plan else "zero2"
    return f"{family}-{zero}-{'auto' if 'auto' in plan else 'static'}-{where}"


@pytest.mark.full
@pytest.mark.parametrize("family, plan, where", CASES, ids=[_id(*c) for c in CASES])
def test_lora_with_offloaded_base_trains_like_single_process_peft(
        request, ranks, references, disk, family, plan, where):
    folder = str(request.getfixturevalue("smollm2_cut")) if family == "smollm2" else None
    results = ranks(2).run(train_offloaded_on_rank, family, plan, str(disk), folder,
                           timeout_s=600)
    cell = harness.Cell(f"{family}+lora", plan, 2)
    key = ("lora", family, *harness.batch_split(plan, 2))
    if key not in references:
        references[key] = harness.reference(FAMILIES[family], *key[2:], wrap=with_lora)
    ref = references[key]
    harness.compare(cell, ref, results).record()
    assert not cell.problems, "\n".join(cell.problems)
    assert {n for r in results for n, *_ in r["grads"]} == set(ref["grads"])
    assert not any(r["frozen_grads"] for r in results), [r["frozen_grads"] for r in results]
    zero3 = "zero=3" in plan
    for r in results:
        place = r["placement"]
        assert place["covers"], "not every frozen parameter is in a frozen chunk"
        assert not place["frozen_in_pieces"], place["frozen_in_pieces"]  # no checkpoint piece
        for c in place["chunks"]:
            assert not c["grad"] and c["states"] == 0 and c["master_is_param"], c
            assert c["whole"] != zero3, c  # zero 3: this rank's shard; zero 2: the chunk
            if "auto" in plan:  # wherever the budgets put it; a spilled chunk is a whole file
                assert c["tier"] != "disk" or c["file"] == c["nbytes"], c
                continue
            assert c["home"] == where, c
            if where == "disk":
                assert c["tier"] == "disk" and c["file"] == c["nbytes"], c
            else:
                assert c["tier"] == "host", c
        tiers = {c["tier"] for c in place["chunks"]}
        assert where in tiers, tiers
        on_tier = sum(c["nbytes"] for c in place["chunks"] if c["tier"] == where)
        assert place["tiers"][where] >= on_tier > 0, (place["tiers"], on_tier)  # accounted
        # model state = frozen weights (fp32, this rank's share) + adapters, their gradients
        # and their states (momentum, ZeRO 2/3: this rank's shard), within 5%
        frozen = place["frozen_numel"] * 4 / (2 if zero3 else 1)
        got = sum(place["breakdown"].values())
        want = frozen + place["adapter_params"] + place["adapter_grads"] \
            + place["adapter_optimizer"]
        assert abs(got - want) <= 0.05 * want, (got, want, place["breakdown"])
        frozen_held = sum(c["nbytes"] for c in place["chunks"])
        assert abs(frozen_held - frozen) <= 0.05 * frozen, (frozen_held, frozen)
        assert place["adapter_grads"] > 0 and place["adapter_optimizer"] > 0, place
    print(f"{family} {plan}: loss {cell.loss_rel:.2e}, grad {cell.grad_rel:.2e} ({cell.worst})")


def save_and_resume_on_rank(rank: int, world: int, plan: str, spill_dir: str,
                            directory: str) -> dict:
    """Two steps, ``save``; a fresh model under the same plan ``load``s it; both take the third
    step. The checkpoint's tensors are the adapters' alone (as without offload)."""
    from kernels_runtime import load, parallelize, save, train_step

    from helpers.distributed import context

    family = FAMILIES["llama"]
    ctx = context(plan)
    runs = []
    for resumed in (False, True):
        model = with_lora(family, family.build())
        model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=family.lr,
                                                        momentum=harness.MOMENTUM),
                                 ctx=ctx, verbose=False, spill_dir=spill_dir)
        if resumed:
            load(directory, model, opt)
        steps = range(2, 3) if resumed else range(3)
        losses = []
        for step in steps:
            mine = pieces_of(family, step, ctx.dp_size, 1)[ctx.dp_rank]
            losses.append(train_step(model, opt, mine).loss)
            if step == 1:
                save(directory, model, opt, step=2)
        runs.append(losses[-1])
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {"third": runs, "frozen": sorted(frozen)}


@pytest.mark.full
def test_an_offloaded_lora_checkpoint_holds_adapters_and_resumes(ranks, disk, tmp_path):
    from kernels_runtime.checkpoint.format import read_meta, resolve_step_dir

    plan = f"dp=2 zero=2 {STATIC} host_mem=0"
    results = ranks(2).run(save_and_resume_on_rank, plan, str(disk), str(tmp_path / "ckpt"),
                           timeout_s=600)
    for r in results:
        uninterrupted, resumed = r["third"]
        assert abs(resumed - uninterrupted) <= 1e-6 * abs(uninterrupted), r["third"]
    saved = set(read_meta(resolve_step_dir(tmp_path / "ckpt", None))["params"])
    assert saved and all(".lora_" in n for n in saved), sorted(saved)
    assert not saved & set(results[0]["frozen"])
