"""Checkpoint formats: what earlier releases wrote still loads, and weights load without an
optimizer.

What is protected: a format-1 checkpoint (flat row-major ranges, written by the runtime before
n-D shards; ``tests/data/checkpoint_v1``, ``dp=2 zero=2 bf16`` at step 3) resumes under its
plan with the losses the writing run went on to record, and loads under another plan with its
fp32 masters intact; a model-only checkpoint (``save_model``) of a ``dp=2 zero=2`` training run
loads without any optimizer into ``dp=2 zero=3`` and ``dp=1`` models and into a plain model in
this process, each giving the trained model's outputs, and into a training run whose optimizer
then starts afresh.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers.distributed import context

V1 = Path(__file__).resolve().parents[2] / "data" / "checkpoint_v1"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _v1_masters() -> dict[str, torch.Tensor]:
    """The fp32 masters as format 1 stored them, assembled here from the files directly."""
    step_dir = V1 / "step-00000003"
    meta = json.loads((step_dir / "meta.json").read_text())
    out = {n: torch.empty(v["shape"]).reshape(-1) for n, v in meta["params"].items()}
    for file, entry in meta["files"].items():
        with safe_open(str(step_dir / file), framework="pt") as f:
            for s in entry["segments"]:
                out[s["name"]][s["start"]:s["end"]] = f.get_tensor(
                    f"{s['name']}|{s['start']}|master")
    return {n: t.reshape(meta["params"][n]["shape"]) for n, t in out.items()}


def _resume_v1(rank: int, world: int, directory: str, plan: str, steps: int) -> dict:
    from kernels_runtime import load, parallelize

    expected = json.loads((V1 / "expected.json").read_text())
    ctx = context(plan)
    model = _mlp()
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=expected["lr"],
                                                      weight_decay=expected["weight_decay"]),
                             ctx=ctx, max_grad_norm=expected["max_grad_norm"])
    info = load(directory, model, opt)
    masters = {p.shard.name: (p.shard, p.values["param"].clone()) for p in opt.pieces(False)}
    losses = []
    for step in range(info["step"], info["step"] + steps):
        x, y = _batch(step, ctx.dp_rank if world > 1 else 0)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        t = loss.detach().reshape(1).clone()
        ctx.comm.all_reduce(t, group=ctx.dp_group)
        losses.append(t.item() / ctx.dp_size)
    return {"info": info, "losses": losses, "masters": masters,
            "steps": opt.steps_taken}


@pytest.fixture(scope="module")
def v1_copy(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("v1") / "checkpoint"
    shutil.copytree(V1, target)
    return target


def test_a_format_1_checkpoint_resumes_with_the_recorded_losses(ranks, v1_copy):
    expected = json.loads((V1 / "expected.json").read_text())
    steps = len(expected["losses_after_step_3"])
    results = ranks(2).run(_resume_v1, str(v1_copy), expected["plan"], steps)
    for result in results:
        assert result["info"]["step"] == 3 and result["info"]["extra"] == {
            "note": "written by format 1"}
        assert result["steps"] == 3 + steps  # the step counter came back too
        for got, want in zip(result["losses"], expected["losses_after_step_3"]):
            assert abs(got - want) <= 1e-6 * abs(want), (result["losses"], expected)


def test_a_format_1_checkpoint_loads_under_another_plan(ranks, v1_copy):
    masters = _v1_masters()
    result = ranks(1).run(_resume_v1, str(v1_copy), "dp=1", 1)[0]
    assert set(result["masters"]) == set(masters)
    for name, (shard, value) in result["masters"].items():
        assert shard.offsets == (0,) * len(shard.shape)  # dp=1 zero=0: whole tensors
        assert torch.equal(value, masters[name]), name


# ---- model-only checkpoints ---------------------------------------------------------------
def _train_and_save_weights(rank: int, world: int, directory: str) -> dict:
    from kernels_runtime import parallelize, save_model, train_step

    from helpers import models as dm

    ctx = context("dp=2 zero=2")
    model = dm.make_model("gpt2")
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=dm.LR), ctx=ctx)
    for step in range(3):
        train_step(model, opt, dm.local_microbatches(step, ctx.dp_rank, 2, 1), dm.hf_loss)
    save_model(directory, model, step=3, extra={"what": "weights"})
    with torch.no_grad():
        logits = model(input_ids=dm.global_batch(0)[0]).logits
    return {"logits": logits, "params": dm.full_parameters(model)}


def _load_weights(rank: int, world: int, directory: str, plan: str) -> dict:
    from kernels_runtime import load, load_model, parallelize, parallelize_model

    from helpers import models as dm

    model = parallelize_model(dm.make_model("gpt2"), ctx=context(plan))
    info = load_model(directory, model)
    with torch.no_grad():
        logits = model(input_ids=dm.global_batch(0)[0]).logits
    trained = dm.make_model("gpt2")
    trained, opt = parallelize(trained, torch.optim.AdamW(trained.parameters(), lr=dm.LR),
                               ctx=context(plan))
    load(directory, trained, opt)  # weights only: the optimizer starts afresh
    return {"info": info, "logits": logits, "state": dict(opt.inner.state),
            "params": dm.full_parameters(trained)}


@pytest.fixture(scope="module")
def weights(ranks, tmp_path_factory) -> tuple[str, dict]:
    directory = str(tmp_path_factory.mktemp("weights") / "gpt2")
    return directory, ranks(2).run(_train_and_save_weights, directory)[0]


@pytest.mark.parametrize("world, plan", [(2, "dp=2 zero=3"), (1, "dp=1")])
def test_a_model_checkpoint_loads_without_an_optimizer(ranks, weights, world, plan):
    directory, trained = weights
    for result in ranks(world).run(_load_weights, directory, plan):
        assert result["info"]["extra"] == {"what": "weights"} and result["info"]["step"] == 3
        torch.testing.assert_close(result["logits"], trained["logits"], rtol=1e-6, atol=1e-6)
        assert not result["state"]
        for name, value in trained["params"].items():
            assert torch.equal(result["params"][name], value), name


def test_a_model_checkpoint_loads_into_a_plain_model_in_one_process(weights):
    from kernels_runtime import load_model

    from helpers import models as dm

    directory, trained = weights
    model = dm.make_model("gpt2")
    load_model(directory, model)
    with torch.no_grad():
        logits = model(input_ids=dm.global_batch(0)[0]).logits
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-6, atol=1e-6)


def test_save_model_of_a_plain_model_says_what_to_do(tmp_path):
    from kernels_runtime import CheckpointError, save_model

    with pytest.raises(CheckpointError, match="parallelize_model"):
        save_model(tmp_path, _mlp())
