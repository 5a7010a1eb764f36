"""Every model family under every plan equals the unsplit model trained in one process.

What is protected: for each (family, plan) cell of ``plans.PLANS`` x ``families.FAMILIES``,
on real gloo ranks, a padded batch with its attention mask (or images) trained for three SGD
steps through ``parallelize`` and ``train_step`` gives the single-process losses (1e-5
relative) and the first step's gradient of every parameter, assembled from the pieces each
rank writes, within 1e-5 relative L2 (1e-8 absolute where the reference is below 1e-6), every
element written by exactly one rank. Cells a plan cannot run are refused before any rank works,
with a message naming the reason (``plans.REFUSED``). Each cell's figures go to
``artifacts/tests/conformance.jsonl``; ``python -m tests.conformance.report`` prints the matrix.
Cells of 2 and 3 ranks run in ``make test`` (the real SmolLM2 under tp=3, zero=3 and pp=2 only),
the rest (4 and 8 ranks, SmolLM2's other plans) in ``make test-full``.
"""

from __future__ import annotations

import pytest

from conformance import harness
from conformance.families import FAMILIES
from conformance.plans import REFUSED, cells

# the real SmolLM2's cells cost ~10 s each (a 49152-token vocabulary): make test runs these
SMOLLM2_IN_TEST = {"tp=3", "dp=2 zero=3", "pp=2 mb=2"}


def _param(family: str, plan: str, world: int):
    full = world >= 4 or (family == "smollm2" and plan not in SMOLLM2_IN_TEST)
    marks = [pytest.mark.full] if full else [pytest.mark.slow]
    return pytest.param(family, plan, world, marks=marks, id=f"{family}-{plan}")


@pytest.mark.parametrize("family, plan, world", [_param(*c) for c in cells()])
def test_the_plan_trains_like_one_process(request, ranks, references, family, plan, world):
    folder = str(request.getfixturevalue("smollm2_cut")) if family == "smollm2" else None
    cell = harness.Cell(family, plan, world)
    results = ranks(world).run(harness.train_on_rank, family, plan, folder, timeout_s=300)
    refusals = {r["refused"] for r in results if "refused" in r}
    if (family, plan) in REFUSED:
        cell.outcome, cell.message = "refused", " | ".join(sorted(refusals))
        cell.record()
        assert len(refusals) == 1 and len(results) == len([r for r in results if "refused" in r])
        assert REFUSED[family, plan] in cell.message, cell.message
        return
    assert not refusals, refusals
    key = (family, *harness.batch_split(plan, world))
    if key not in references:
        references[key] = harness.reference(FAMILIES[family], *key[1:])
    harness.compare(cell, references[key], results).record()
    assert not cell.problems, "\n".join(cell.problems)
