"""``parallelize`` as ordered appliers, and the objectives ``train_step`` runs.

What is protected: the appliers run in the documented order; a plan some applier cannot run
is refused with every reason at once before any rank changes the model; a model is
parallelized once (a second call says what to do); ``parallelize_model`` needs no optimizer;
the loss computed outside the model (``next_token_loss``, what a pipeline's last stage runs)
equals the one HF computes inside it.
"""

from __future__ import annotations

import pytest
import torch

from helpers import models as dm
from helpers.distributed import context


def test_appliers_run_in_the_documented_order():
    from kernels_runtime.api import APPLIERS

    assert [name for name, _, _ in APPLIERS] == [
        "tensor", "sequence", "expert", "activation_checkpointing", "pipeline", "data",
        "offload"]


def _refusals(rank: int, world: int) -> dict:
    from kernels_runtime import PlanError, parallelize, parallelize_model

    out = {}
    # a spill directory in RAM is refused by the offload applier, the last, after the tensor
    # applier's check passed and before anything was applied
    plans = {"offload": "dp=4 zero=2 offload=auto device_mem=1MiB host_mem=0",
             "several": "tp=2 dp=2 zero=2 offload=static offload_params=1 host_mem=0"}
    for key, plan in plans.items():
        model = dm.make_model("gpt2")
        before = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
        try:
            parallelize_model(model, ctx=context(plan), spill_dir="/dev/shm/workbench-refused")
            out[key] = ("no error", True)
        except PlanError as err:
            after = {n: (p.data_ptr(), p.dtype) for n, p in model.named_parameters()}
            out[key] = (str(err), before == after and "parallel_state" not in model.__dict__)
    unreadable = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                       for _ in range(2)))
    try:
        parallelize_model(unreadable, ctx=context("tp=2 dp=2"))
    except PlanError as err:
        out["unreadable"] = str(err)
    model = parallelize_model(dm.make_model("gpt2"), ctx=context("dp=4 bf16"))
    out["state"] = (model.parallel_state.applied, next(model.parameters()).dtype)
    try:
        parallelize(model, torch.optim.AdamW(model.parameters()), ctx=context("dp=4"))
    except PlanError as err:
        out["twice"] = str(err)
    return out


@pytest.mark.slow  # 4 ranks
def test_refused_plans_leave_the_model_untouched(ranks):
    out = ranks(4).run(_refusals)[0]
    for key, words in {"offload": "host_mem=0", "several": "host_mem=0"}.items():
        message, untouched = out[key]
        assert words in message and "tmpfs" in message, message
        assert untouched, f"{key}: the model changed before the refusal"
    assert "cannot split Sequential" in out["unreadable"] and "write a policy" in out["unreadable"]
    assert out["state"] == (["data"], torch.bfloat16)
    assert "already parallelized" in out["twice"] and "freshly built model" in out["twice"]


def test_parallelize_takes_an_optimizer():
    from kernels_runtime import parallelize

    with pytest.raises(TypeError, match="parallelize_model"):
        parallelize(torch.nn.Linear(2, 2), None)


def test_the_loss_outside_the_model_equals_the_one_inside():
    from kernels_runtime import causal_lm_loss
    from kernels_runtime.api import next_token_loss

    model = dm.make_model("gpt2")
    ids = dm.global_batch(0)[0]
    labels = ids.clone()
    labels[:, :3] = -100  # ignored positions, e.g. a prompt
    inside = causal_lm_loss(model, (ids, labels))
    outside = next_token_loss(model, (ids, labels))
    assert torch.allclose(inside, outside, rtol=1e-6, atol=1e-7), (inside, outside)
    as_dict = next_token_loss(model, {"input_ids": ids, "labels": labels})
    assert torch.equal(as_dict, outside)


def test_the_replaced_module_table_folds_blocks():
    from kernels_runtime import Plan
    from kernels_runtime.api.parallelize import replaced_table

    replaced = [(f"transformer.h.{i}.attn.c_attn", "Conv1D -> ColumnParallelLinear (column)")
                for i in range(12)] + [("lm_head", "Linear -> ColumnParallelLinear (vocab)")]
    table = replaced_table(replaced, Plan.parse("tp=2").validate(2)).splitlines()
    assert table[0] == "parallelize (dp=1 tp=2): 13 modules replaced"
    assert table[1].split() == ["transformer.h.*.attn.c_attn", "Conv1D", "->",
                                "ColumnParallelLinear", "(column)", "x12"]
