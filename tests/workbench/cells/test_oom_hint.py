"""A rank out of memory gets an error that names the rank, the tier and the budget it measured,
and lists the plans the planner predicts would fit (``workbench/cells/oom_hint.py``).

The message builder is pure arithmetic over a model's config, so most cases run without a
pool; one cell on a real 2-rank pool checks the whole path: an allocation no host can hold on
rank 1, the model the cell built found in the rank's namespace, the plans in the notebook's
error."""

from __future__ import annotations

import pytest

from kernels_runtime.mesh.plan import Plan
from workbench.cells.oom_hint import budget_of, explain, hardware_of, memory_tier, model_facts
from workbench.errors import RankError, RankFailureError

# a GPT-2 of 2 layers as rank_facts sends it (HF config.to_dict(), the keys the planner reads)
GPT2 = {"name": "model", "type": "GPT2LMHeadModel", "params": 29_088,
        "config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                   "vocab_size": 97, "n_positions": 16, "activation_function": "gelu_new"}}


@pytest.mark.parametrize("ename, evalue, tier", [
    ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", "device"),
    ("MemoryError", "", "host"),
    ("RuntimeError", "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                     "allocate memory: you tried to allocate 4503599627370496 bytes.", "host"),
    ("RuntimeError", "not enough memory: you tried to allocate 8 GB", "host"),
    ("BudgetError", "the host budget of 1.0 GiB per rank cannot hold what this step needs",
     "host"),
    ("BudgetError", "the per-rank budgets cannot hold what one step needs at once "
                    "(device_mem=1 MiB < 4 MiB)", "device"),
    ("BudgetError", "the disk budget of 2 GiB per rank cannot hold it", "disk"),
    ("RuntimeError", "shapes cannot be multiplied", None),
    ("ValueError", "not enough memory", None),
])
def test_memory_errors_are_told_by_name_and_text_with_their_tier(ename, evalue, tier):
    assert memory_tier(ename, evalue) == tier


def _plan_lines(text: str) -> list[str]:
    return [line.split('--plan "', 1)[1].rstrip('"') for line in text.splitlines()
            if "%%colossal --plan" in line]


def test_the_hint_names_rank_tier_budget_and_up_to_three_plans_that_parse():
    text = explain(1, "host", 3 * 2**30, 2, GPT2, where="available memory of host a")
    first = text.splitlines()[0]
    assert first.startswith("Out of host memory on rank 1: it can hold 3 GiB per rank"), text
    assert "GPT2LMHeadModel `model`" in text and "assumed 1 sample of 16 tokens" in text, text
    plans = _plan_lines(text)
    assert 1 <= len(plans) <= 3, text
    for label in plans:  # each is a plan %%colossal accepts on these 2 ranks
        Plan.parse(label).validate(2)
    assert "workbench.recommend(model_config, world_size=2" in text


def test_without_a_known_model_the_hint_says_how_to_get_a_recommendation():
    text = explain(0, "device", 80e9, 2, None)
    assert text.startswith("Out of device memory on rank 0: it can hold 74.5 GiB per rank")
    assert "No model is known on this rank" in text and "workbench.recommend(" in text
    assert not _plan_lines(text)
    no_shape = dict(GPT2, type="Linear", name="lin", config=None)
    assert "has no config the planner reads" in explain(0, "host", 1e9, 2, no_shape)


def test_a_budget_nothing_fits_says_so_with_the_smallest_need():
    text = explain(0, "device", 1024, 2, GPT2)
    assert "No plan is predicted to fit" in text and "smallest need" in text, text
    assert not _plan_lines(text)


def test_bad_tier_is_refused_naming_the_tiers():
    with pytest.raises(ValueError, match="device, host, disk"):
        explain(0, "gpu", 1e9, 2, GPT2)


def test_budgets_per_rank_share_the_host_and_name_the_device_profile():
    facts = {"device": None, "device_name": None, "host": "a", "host_available": 8e9,
             "disk_free": 100e9}
    assert budget_of("host", facts, 2)[0] == 4e9
    assert budget_of("device", facts, 2)[0] == 4e9  # a CPU rank's device is its host
    assert budget_of("disk", facts, 4)[0] == 25e9
    gpu = dict(facts, device=80e9, device_name="NVIDIA H100 80GB HBM3")
    assert budget_of("device", gpu, 8)[0] == 80e9
    assert hardware_of(gpu["device_name"]) == "H100" and hardware_of(None) == "H100"
    assert hardware_of("NVIDIA H200") == "H200"


class ShapeConfig:
    """What the rank reads of a Hugging Face config: ``to_dict()`` (transformers itself takes
    seconds to import, and the engine test below uses a real one)."""

    def to_dict(self) -> dict:
        return dict(GPT2["config"])


def test_the_model_found_is_the_parallelized_one_else_the_largest_with_a_config():
    torch = pytest.importorskip("torch")
    inner = torch.nn.Linear(8, 8)
    inner.config = ShapeConfig()  # a module carrying a config, as HF models do
    wrapper = torch.nn.Sequential(inner, torch.nn.Linear(8, 8))  # Lightning, peft: a wrapper
    found = model_facts({"wrapped": wrapper, "head": torch.nn.Linear(4, 4), "n": 3})
    assert found["name"] == "wrapped" and found["params"] == 144, found
    assert found["config"]["n_embd"] == 32, found
    assert model_facts({"n": 3}) is None


def test_the_error_text_carries_the_hint():
    err = RankFailureError([RankError(1, "error", "MemoryError", "")], hint="Out of host ...")
    assert "rank 1" in str(err) and "Out of host ..." in str(err)
    assert err._render_traceback_()[-1] == "Out of host ..."


OOM_CELL = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2,
                                   n_head=4))
if rank == 1:
    torch.empty(2**50)  # 4 PiB: more than any host holds, refused at once
"""


@pytest.mark.engines
@pytest.mark.full
def test_a_rank_out_of_host_memory_lists_plans_that_fit(shell):
    """Rank 1 asks for 4 PiB; the notebook's error names rank 1 and the host tier, the budget
    it measured, and plans for the GPT-2 the cell built; the pool runs the next cell."""
    with pytest.raises(RankFailureError) as info:
        shell.run_cell_magic("colossal", "", OOM_CELL)
    err = info.value
    assert err.ranks == [1]
    text = "\n".join(err._render_traceback_())
    assert "DefaultCPUAllocator" in text  # the raw error is still shown
    assert "Out of host memory on rank 1: it can hold" in text, text
    assert "GPT2LMHeadModel `model`" in text, text
    plans = _plan_lines(text)
    assert plans and all(Plan.parse(p).validate(2) for p in plans), text
    assert "Out of host memory on rank 1" in str(err)
    shell.run_cell_magic("colossal", "--pull ok", "ok = True")
    assert shell.user_ns["ok"] is True
