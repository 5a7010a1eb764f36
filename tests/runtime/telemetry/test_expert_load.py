"""Expert load travels with the telemetry: tokens per expert per MoE layer, as the router chose.

What is protected: on 2 real gloo ranks under ``ep=2`` (with activation checkpointing, whose
backward replays the routing), each rank's published ``expert_load`` of the last step equals
the tokens per expert recomputed in one plain process from the same model's router logits
(top-2), per layer and by global expert index: its micro-batches summed, the replay not counted
again, an ``eval_step``'s routing outside the step not counted, the step before not added; each
layer's row sums to the rank's tokens x top-k, and the imbalance is max / mean of the row.
In a plain process: ``ExpertLoad`` sums a step's micro-batches, publishes the last step only,
forgets a cell's counts when the next cell starts and explains a layer recorded with two sizes.
"""

from __future__ import annotations

import pytest

from kernels_runtime.telemetry import ExpertLoad, Telemetry
from kernels_runtime.telemetry.expert_load import imbalance

from helpers.expert_load import EXPERTS, LAYERS, TOP_K, ep2_expert_load


def test_published_counts_equal_the_routing_recomputed_in_one_process(ranks) -> None:
    runs = ep2_expert_load(ranks)
    for rank, run in enumerate(runs):
        blocks = [s["expert_load"] for s in run["published"] if s.get("expert_load")]
        assert blocks, f"rank {rank} published no expert load"
        last = blocks[-1]
        assert last["step"] == 2 and last["layers"] == [f"model.layers.{i}.mlp"
                                                        for i in range(LAYERS)]
        assert last["counts"] == run["expected"], f"rank {rank}"
        assert last["tokens"] == [run["tokens"] * TOP_K] * LAYERS
        assert all(len(row) == EXPERTS for row in last["counts"])
        assert last["imbalance"] == [max(r) / (sum(r) / EXPERTS) for r in last["counts"]]
        # the first step's block, published as it ended, held that step's routing only
        assert blocks[0]["step"] == 1 and blocks[0]["counts"] == run["first"]
    # the two ranks routed different tokens: the sum is the step's whole load
    assert runs[0]["expected"] != runs[1]["expected"]


def test_a_step_sums_its_micro_batches_and_publishes_only_the_last_step() -> None:
    load = ExpertLoad()
    assert load.block() is None
    load.record("a", [1, 2, 0, 1])  # a forward outside any step (evaluation)
    load.begin_step()
    for _ in range(2):  # two micro-batches, two layers
        load.record("a", [3, 0, 1, 0])
        load.record("b", [1, 1, 1, 1])
    load.end_step()
    assert load.block() == {"step": 1, "layers": ["a", "b"],
                            "counts": [[6, 0, 2, 0], [2, 2, 2, 2]], "tokens": [8, 8],
                            "imbalance": [3.0, 1.0]}
    load.begin_step()
    load.end_step()  # a step without MoE forwards keeps the last one shown
    load.begin_step()
    load.record("a", [0, 0, 0, 4])
    load.end_step()
    assert load.block()["counts"] == [[0, 0, 0, 4]] and load.block()["step"] == 2
    with pytest.raises(ValueError, match="give each MoE layer its own name"):
        load.record("a", [1, 2])
        load.record("a", [1, 2, 3])
    assert imbalance([0, 0]) == 0.0


def test_telemetry_publishes_the_tick_s_step_and_a_new_cell_forgets_it() -> None:
    telemetry = Telemetry()
    telemetry.tick()  # the first tick only starts the clock
    telemetry.expert_load.record("layer", [2, 2])
    telemetry.tick()
    assert telemetry.snapshot()["expert_load"]["counts"] == [[2, 2]]
    with telemetry.step():
        telemetry.expert_load.record("layer", [4, 0])
    assert telemetry.snapshot()["expert_load"]["counts"] == [[4, 0]]
    telemetry.new_cell()
    assert telemetry.snapshot()["expert_load"] is None
