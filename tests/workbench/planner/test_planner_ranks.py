"""The cost model against the live runtime: memory it predicts is memory the runtime holds.

What is protected: for every ZeRO stage and precision, predicted parameter, gradient and
optimizer-state bytes per rank equal what ``BoostedOptimizer.memory_breakdown()`` measures on
2 real gloo ranks (within 2%); predicted activations equal what autograd saves for backward on
a real HF GPT-2; calibration on real ranks, spawned or in a notebook pool, yields a usable
profile with positive, finite rates.
"""

from __future__ import annotations

import math

import pytest

from kernels_runtime.memory.spill import MEMORY_FILESYSTEMS, mount_of, spill_root
from workbench.planner import ModelSpec, calibrate, calibrate_ranks, predict
from workbench.planner.hardware import from_measurements

from helpers.distributed import run_ranks
from helpers.models import local_microbatches, make_model

# fp16 stores what bf16 stores (2-byte parameters and gradients, fp32 masters)
COMBOS = [(zero, precision) for precision in ("fp32", "bf16") for zero in (0, 1, 2, 3)]
# dp_models' tiny GPT-2, described without importing transformers (the ranks stay light)
TINY_GPT2 = ModelSpec(hidden=32, layers=2, heads=4, vocab=64, seq=16, batch=4, positions=16,
                      model_type="gpt2", attention="sdpa", activation="gelu_new")


def _proxy_model():
    """A tiny torch-only GPT-like model (no transformers import in the ranks: faster)."""
    import torch

    from kernels_runtime.calibrate.proxy import ProxyLM

    torch.manual_seed(0)
    return ProxyLM(layers=2, h=32, vocab=64)


def _proxy_loss(model, batch):
    import torch

    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 64), y.reshape(-1))


def _memory_and_calibration(rank: int, world: int) -> dict:
    """Model-state bytes per (zero, precision) and this rank's calibration record (one spawn
    for both: starting ranks is most of the cost)."""
    import torch

    from kernels_runtime.api import parallelize, train_step
    from kernels_runtime.calibrate import measure
    from kernels_runtime.mesh.context import ParallelContext
    from workbench.planner.calibration import measure_kwargs

    base = ParallelContext.build(f"dp={world}")
    calibration = measure(**measure_kwargs(TINY_GPT2, ("fp32",), reps=1, window_s=0.002))
    memory = {}
    for zero, precision in COMBOS:
        model = _proxy_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, bopt = parallelize(model, opt, ctx=base.with_plan(
            f"dp={world} zero={zero} {precision}"))
        batches = local_microbatches(0, rank, world, 1)
        train_step(model, bopt, batches, _proxy_loss)  # optimizer states now exist
        bopt.backward(_proxy_loss(model, batches[0]))  # gradients too: the peak of model states
        bopt.finish_grad_sync()
        memory[(zero, precision)] = bopt.memory_breakdown()
    return {"memory": memory, "calibration": calibration}


# The tests on two_ranks are make test's (slow): its 2 ranks measure 8 plans and calibrate,
# ~5 s that make test-fast (3 min on 2 cores) cannot spare.
@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_memory_and_calibration, 2)


@pytest.mark.slow
def test_predicted_model_states_equal_memory_breakdown(two_ranks):
    world = 2
    psi = sum(p.numel() for p in _proxy_model().parameters())
    spec = ModelSpec(hidden=32, layers=2, heads=2, vocab=64, seq=16, batch=8, params=psi)
    for (zero, precision), measured in two_ranks[0]["memory"].items():
        predicted = predict(f"dp={world} zero={zero} {precision}", spec, "H100")
        mem = predicted.memory_by_category()
        for key, category in (("params", "params"), ("grads", "grads"),
                              ("optimizer", "optimizer")):
            assert mem[category] == pytest.approx(measured[key], rel=0.02), \
                (zero, precision, key, mem[category], measured[key])


@pytest.mark.parametrize("precision,ckpt", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_predicted_activations_equal_saved_tensors(precision: str, ckpt: bool):
    from kernels_runtime.memory.saved_activations import peak_saved_bytes
    from kernels_runtime.parallel.activation_checkpoint import apply_activation_checkpointing
    from kernels_runtime.policies import get_policy

    from helpers.models import DTYPES, hf_loss

    model = make_model("gpt2").to(DTYPES[precision])
    blocks = get_policy(model).blocks(model)
    if ckpt:
        apply_activation_checkpointing(blocks)
    batch = local_microbatches(0, 0, 1, 1)[0]
    measured = peak_saved_bytes(lambda: hf_loss(model, batch).backward(), blocks)
    plan = f"dp=1 {precision}" + (" ckpt" if ckpt else "")
    spec = ModelSpec.from_config(model.config, batch=len(batch[0]))
    predicted = predict(plan, spec, "H100").memory_by_category()
    assert predicted["activations"] == pytest.approx(measured, rel=0.05)


def _sane(profile) -> None:
    rates = [*profile.matmul_flops.values(), *profile.attention_flops.values(),
             *profile.activation_rate.values(), profile.adam_rate,
             *(link.bandwidth for link in profile.collectives.values())]
    assert rates and all(0 < r < 1e16 and math.isfinite(r) for r in rates), rates
    assert 1e8 < profile.matmul_flops["fp32"] < 1e16
    assert all(0 <= link.latency < 1.0 for link in profile.collectives.values())
    assert 0.0 <= profile.overlap <= 1.0 and profile.device_memory > 1e8


@pytest.mark.slow
def test_calibration_on_ranks_is_sane(two_ranks):
    profile = from_measurements([r["calibration"] for r in two_ranks])
    _sane(profile)
    assert set(profile.collectives) == {"all_reduce", "reduce_scatter", "all_gather"}
    assert set(profile.overhead) == {0, 1, 2, 3}
    # offload tiers: host<->device (here a host memcpy) and host memory rates; the disk's
    # where the spill root is a disk, and 0 (unknown) where it is in RAM (tmpfs)
    assert profile.pcie_bandwidth > 1e8 and profile.host_bandwidth > 1e8
    root = spill_root()
    if mount_of(root)[1] in MEMORY_FILESYSTEMS:
        assert profile.disk_read == 0 and profile.disk_write == 0, root
    else:  # any real disk moves more than 10 MB/s
        assert profile.disk_read > 1e7 and profile.disk_write > 1e7, (root, profile.disk_read,
                                                                      profile.disk_write)
    assert all(o.step >= 0 and o.micro >= 0 and o.layer >= 0 for o in profile.overhead.values())
    assert predict("dp=2 zero=2 mb=2", TINY_GPT2, profile).step_time > 0
    # the same benchmarks through calibrate_ranks, which spawns its own (here: one) rank
    single = calibrate_ranks(1, model=TINY_GPT2, dtypes=("fp32",), reps=1, window_s=0.002)
    _sane(single)
    assert single.collectives == {} and set(single.overhead) == {0}
    # the memory-bound rate at each micro-batch size a plan can give a rank (1, 4, ... the
    # batch): what one block keeps grows with the samples, every rate is a rate
    curve = single.activation_curve["fp32"]
    kept = [k for k, _ in curve]
    assert len(curve) >= 2 and kept == sorted(kept) and kept[0] > 0
    assert all(0 < r < 1e16 for _, r in curve)


@pytest.mark.engines
def test_calibration_on_a_pool_is_sane():
    from workbench import Pool

    with Pool(n=2) as pool:
        profile = calibrate(pool, model=TINY_GPT2, dtypes=("fp32",), reps=1,
                            window_s=0.002, overheads=False)
        _sane(profile)
        assert "x2" in profile.name and len(profile.collectives) == 3
