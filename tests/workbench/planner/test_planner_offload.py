"""The cost model's offload terms: bytes per tier, bytes moved per step, and ``recommend``.

What is protected: for a tiny GPT-2 (Psi = 28,032: token embedding 2,048, positions 512, two
blocks of 12,704, final norm 64), device/host/disk bytes of static and auto plans equal the
chunk table of ``workbench/planner/offload.py`` by hand; bytes moved per step between tiers and
their seconds at the profile's PCIe/disk rates equal the hand count; ``recommend`` proposes
offload only when no plan fits without it, and what it proposes validates and fits; and on a
real 1-rank run with everything offloaded the runtime's own accounts (``memory_breakdown``,
``tier_bytes``, ``TierStore.moved``) equal the prediction exactly and a "Measure" trial of an
offload plan runs.
"""

from __future__ import annotations

import dataclasses

import pytest

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.planner import PROFILES, ModelSpec, NoPlanFitsError, predict, recommend
from workbench.planner.hardware import HOST_ADAM_BYTES_PER_ELEMENT
from workbench.planner.offload import Layout, layout

from helpers.distributed import run_ranks

TINY = ModelSpec(hidden=32, layers=2, heads=4, vocab=64, seq=16, batch=16, positions=16,
                 model_type="gpt2", attention="sdpa", activation="gelu_new")
PSI, TOKEN, BLOCK = 28032, 2048, 12704
ALL = "offload=static offload_params=1 offload_grads=1 offload_optim=1"
GPT_1B = dict(hidden=2048, layers=24, heads=16, vocab=50257, seq=2048, batch=8)


def _tiers(p) -> dict[str, dict[str, float]]:
    return {t: p.memory_by_category(t) for t in ("device", "host", "disk")}


def test_static_everything_on_the_host_by_hand():
    # zero 2, fp32, one rank: param 4, grad 4, master 4 + AdamW states 8 bytes per parameter
    m = _tiers(predict(f"dp=1 zero=2 {ALL}", TINY, "H100"))
    assert (m["host"]["params"], m["host"]["grads"], m["host"]["optimizer"]) == (
        4 * PSI, 4 * PSI, 12 * PSI)
    assert m["device"]["params"] == m["device"]["grads"] == m["device"]["optimizer"] == 0
    # working set, at the last block's backward: the block gathered whole (4 B), its fp32
    # gradient buffer (at one rank it becomes the gradient shard on its way to the host), the
    # block before it gathered for its own backward, and the tied token embedding held until
    # the very end
    assert m["device"]["buffers"] == 3 * 4 * BLOCK + 4 * TOKEN
    # zero 3 in fp32: the parameter shard is the master (no separate 4 B)
    m3 = _tiers(predict(f"dp=1 zero=3 {ALL}", TINY, "H100"))
    assert m3["host"]["optimizer"] == 8 * PSI and m3["host"]["params"] == 4 * PSI


def test_static_host_budget_then_disk_by_hand():
    # the host budget holds exactly the parameters (4 Psi; chunks of host_mem/16 bytes split
    # every unit evenly here), so the masters go to disk and their AdamW states with them
    plan = f"dp=1 zero=2 offload=static offload_params=1 offload_optim=1 host_mem={4 * PSI}"
    m = _tiers(predict(plan, TINY, "H100"))
    assert m["host"]["params"] == 4 * PSI and m["host"]["optimizer"] == 0
    assert m["disk"]["optimizer"] == 4 * PSI + 8 * PSI
    assert m["device"]["grads"] == 4 * PSI and m["device"]["params"] == 0
    # zero 3 bf16 over 2 ranks: param 2/2, grad 4/2, master 4/2, states 8/2 bytes per parameter
    m3 = _tiers(predict(f"dp=2 zero=3 bf16 {ALL}", TINY, "H100"))
    assert (m3["host"]["params"], m3["host"]["grads"], m3["host"]["optimizer"]) == (
        PSI, 2 * PSI, 6 * PSI)
    # half the optimizer states: the first chunks in execution order until half the bytes
    half = _tiers(predict("dp=1 zero=2 offload=static offload_optim=0.5", TINY, "H100"))
    off = (TOKEN + 512 + BLOCK) * 12  # token embedding, positions, block 0: 15,264 >= 14,016
    assert half["host"]["optimizer"] == off and half["device"]["optimizer"] == 12 * PSI - off


def test_auto_keeps_state_under_device_mem_and_spills_beyond_host_mem():
    budget, host = 256 * 2**10, 64 * 2**10
    p = predict(f"dp=1 zero=2 offload=auto device_mem={budget} host_mem={host}", TINY, "H100")
    lay = layout(p.setting)
    f = lay.fractions["params"]
    assert 0 < f < 1 and lay.device_need() <= budget
    assert Layout(p.setting, dict.fromkeys(lay.fractions, f - 1 / 64)).device_need() > budget
    tiers = p.peak_by_tier()
    state = 16 * PSI  # 4 + 4 + 8 bytes per parameter on some tier (fp32 at one rank under
    # auto: the parameters are the master)
    assert tiers["host"] <= host
    assert sum(p.memory_by_category(t)[c] for t in ("device", "host", "disk")
               for c in ("params", "grads", "optimizer")) == state
    # below the runtime's floor, a block's parameters and gradient buffer (8 B each): refused
    with pytest.raises(PlanError, match="give at least device_mem=99.2 KiB"):
        predict("dp=1 zero=2 offload=auto device_mem=64KiB", TINY, "H100")


def test_bytes_moved_per_step_and_their_seconds():
    # forward fetches every unit (the tied embedding twice), backward once; each goes home;
    # gradients go to the host; publishing the update brings each whole parameter back
    p = predict(f"dp=1 zero=2 {ALL}", TINY, "H100")
    fwd, bwd, grads, publish = 4 * (PSI + TOKEN), 4 * PSI, 4 * PSI, 4 * PSI
    assert p.moved_bytes() == {("host", "device"): fwd + bwd + publish,
                               ("device", "host"): fwd + bwd + publish + grads}
    hw = PROFILES["H100"]
    train = next(t for t in p.time if t.name.startswith("offload: parameter"))
    assert train.seconds == pytest.approx((2 * (fwd + bwd) + grads) / hw.pcie_bandwidth)
    step = next(t for t in p.time if t.name.startswith("offload: host Adam"))
    assert step.seconds == pytest.approx(PSI * HOST_ADAM_BYTES_PER_ELEMENT / hw.host_bandwidth
                                         + 2 * publish / hw.pcie_bandwidth)
    # two micro-batches: parameters twice; a gradient comes back to add the second one
    p2 = predict(f"dp=1 zero=2 mb=2 {ALL}", TINY, "H100").moved_bytes()
    assert p2[("host", "device")] == 2 * (fwd + bwd) + grads + publish
    # disk: masters and states read and written once per step
    d = predict("dp=1 zero=2 offload=static offload_optim=1 host_mem=0", TINY, "H100")
    links = layout(d.setting).link_bytes()
    assert links["disk_read"] == links["disk_write"] == 12 * PSI
    # everything on disk: a parameter is read for its backward only (the deferred step's
    # publish feeds the forward) and written once, after the step; gradients once each way
    e = layout(predict("dp=1 zero=2 offload=static offload_params=1 offload_grads=1 "
                       "offload_optim=1 host_mem=0", TINY, "H100").setting).link_bytes()
    assert e["disk_read"] == 4 * (PSI + TOKEN) + 4 * PSI + 12 * PSI
    assert e["disk_write"] == 4 * PSI + 4 * PSI + 12 * PSI
    assert d.step_time > predict("dp=1 zero=2 offload=static offload_optim=1", TINY,
                                 "H100").step_time
    # a profile without disk rates refuses what needs them
    with pytest.raises(PlanError, match="no rate for .disk_read, disk_write"):
        predict("dp=1 zero=2 offload=static offload_optim=1 host_mem=0", TINY,
                dataclasses.replace(hw, disk_read=0.0, disk_write=0.0))


def test_recommend_offloads_only_when_nothing_fits():
    rec = recommend(GPT_1B, 1, 20e9, hardware="A100")  # no plan fits one A100 at 20 GB
    assert rec.ranked and all(p.plan.offload != "none" for p in rec.ranked)
    assert all(p.peak_bytes <= 20e9 for p in rec.ranked)
    assert all(p.plan.offload == "none" and p.peak_bytes > 20e9 for p in rec.over_budget)
    for p in rec.ranked[:5]:
        again = Plan.parse(p.plan.to_string()).validate(1, p.setting.spec.plan_config())
        assert predict(again, GPT_1B | {"batch": None, "global_batch": 8}, "A100",
                       1).peak_bytes == pytest.approx(p.peak_bytes)
    text = rec.explain()
    assert "without offload" in text and "offload: host" in text
    fits = recommend(GPT_1B, 8, 40e9, hardware="A100")
    assert all(p.plan.offload == "none" for p in fits.ranked + fits.over_budget)
    with pytest.raises(NoPlanFitsError, match="with or without offload"):
        recommend(GPT_1B, 1, 1e9, hardware="A100")  # activations alone do not fit


# ---- against the runtime -------------------------------------------------------------------
def _measure(rank: int, world: int, plans: list[str]) -> dict:
    import torch

    from kernels_runtime import parallelize, train_step
    from kernels_runtime.calibrate.trial import run_trial

    from helpers import models as dm
    from helpers.distributed import context, process_comm

    out = {}
    for plan in plans:
        ctx = context(plan)
        model = dm.make_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=dm.LR)
        model, opt = parallelize(model, opt, ctx=ctx, verbose=False)
        # no write left behind at a reap: a fetch of a payload whose write has not completed
        # reuses its memory instead of reading it, which would make the reads depend on timing
        opt.sync.store.write_behind_bytes = 0
        # the third step is the steady state: states exist (a step deferred to the next
        # forward, the disk tier's, creates them in the second)
        for step in range(3):
            train_step(model, opt, dm.local_microbatches(step, 0, 1, 1), loss_fn=dm.hf_loss)
        last = dict(opt.sync.last_step)
        after_step = opt.sync.tier_bytes()
        opt.backward(dm.hf_loss(model, dm.local_microbatches(2, 0, 1, 1)[0]))
        opt.finish_grad_sync()
        out[plan] = {"breakdown": opt.memory_breakdown(), "after_step": after_step,
                     "moved": last["moved"], "device_peak": last["device_peak"]}
        opt.zero_grad()
    trial_plan = plans[0].replace("dp=1 ", "")
    shape = {k: v for k, v in dataclasses.asdict(TINY).items() if v is not None}
    out["trial"] = run_trial(trial_plan, shape, batch=4, steps=1, warmup=0, comm=process_comm())
    return out


DISK = f"dp=1 zero=2 {ALL} host_mem=0"


# The tests on the measured run are make test's (slow): the run starts a rank and trains three
# plans and a trial, ~5 s that make test-fast (3 min on 2 cores) cannot spare.
ON_A_RANK = pytest.mark.slow


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_ranks(_measure, 1, [f"dp=1 zero=2 {ALL}", f"dp=1 zero=3 {ALL}", DISK])[0]


# the runtime's tiny GPT-2 with the test models' batch (16 samples of 16 tokens on one rank)
RUN = dataclasses.replace(TINY, batch=16)


@ON_A_RANK
@pytest.mark.parametrize("zero", [2, 3])
def test_predicted_tiers_and_moves_equal_the_runtime_accounts(measured, zero):
    plan = f"dp=1 zero={zero} {ALL}"
    got, p = measured[plan], predict(plan, RUN, "H100")
    every = {c: sum(p.memory_by_category(t)[c] for t in ("device", "host", "disk"))
             for c in ("params", "grads", "optimizer")}
    assert every == {k: float(v) for k, v in got["breakdown"].items()}  # exact
    host = p.peak_by_tier()["host"] - p.memory_by_category("host")["grads"]  # freed by the step
    assert got["after_step"] == {"device": 0, "host": host, "disk": 0}
    assert {k: float(v) for k, v in got["moved"].items()} == p.moved_bytes()  # exact


@ON_A_RANK
def test_predicted_disk_traffic_equals_the_runtimes(measured):
    """Everything on disk: what the runtime read and wrote in a step (the last one's deferred
    steps inside it) is the prediction, byte for byte."""
    p = predict(DISK, RUN, "H100")
    assert {k: float(v) for k, v in measured[DISK]["moved"].items()} == p.moved_bytes()


@ON_A_RANK
@pytest.mark.parametrize("zero", [2, 3])
def test_predicted_device_peak_within_10_percent(measured, zero):
    plan = f"dp=1 zero={zero} {ALL}"
    p = predict(plan, RUN, "H100")
    device = p.peak_bytes - p.memory_by_category()["activations"]  # the runtime's account
    assert measured[plan]["device_peak"] == pytest.approx(device, rel=0.10)


@ON_A_RANK
def test_a_trial_of_an_offload_plan_runs_and_its_memory_is_predicted(measured):
    trial = measured["trial"]
    assert trial["step_s"] and trial["step_s"][0] > 0
    p = predict(f"dp=1 zero=2 {ALL}", dataclasses.replace(TINY, batch=4), "H100")
    got = sum(trial["memory"].values())
    assert got == pytest.approx(p.measurable_bytes, rel=0.05)
