"""LoRA fine-tuning of the real SmolLM2 at the issue's size: four real blocks, five steps.

What is protected: SmolLM2-135M-Instruct's real weights cut to their first four blocks,
wrapped in random rank-8 adapters on all seven projections with B near zero
(``lora.with_near_zero_lora``), trained five SGD steps through ``parallelize`` and
``train_step`` under each plan below, give single-process peft's five losses (1e-5 relative)
and its first-step gradient of every adapter parameter (1e-5 relative L2, assembled from the
pieces each rank writes); no frozen parameter holds a gradient after backward. The plans:
data parallelism at each ZeRO stage, tp=3 (its 9 heads over 3 key/value heads split three
ways), dp=2 x tp=3, a two-stage pipeline (1F1B, interleaved, zero-bubble V), ring sequence
parallelism, and every model state offloaded to the host and, beyond a zero host budget, to
disk. GPT-2 and BERT configs run the
same five steps under tp=2 and 2D tp=4.

The two-block cells of ``test_lora.py`` cover the families and plans broadly at three steps;
these run longer on more of the real model, so they sit in ``make test-full``.
"""

from __future__ import annotations

import contextlib

import pytest

from conformance import families, harness
from conformance.families import FAMILIES
from conformance.lora import with_near_zero_lora
from conformance.plans import OFFLOAD

pytest.importorskip("peft")

BLOCKS, STEPS = 4, 5
CASES: list[tuple[str, str, int]] = [
    *[("smollm2", p, 2) for p in ("dp=2", "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3")],
    ("smollm2", "tp=3", 3),
    ("smollm2", "dp=2 tp=3", 6),
    ("smollm2", "pp=2 mb=2", 2),
    ("smollm2", "pp=2 pp_schedule=interleaved pp_chunks=2 mb=2", 2),  # four blocks: two chunks
    ("smollm2", "pp=2 pp_schedule=zbv mb=2", 2),  # each rank's gradient for weights apart
    ("smollm2", "sp=2 sp_mode=ring", 2),
    ("smollm2", f"dp=2 zero=2 {OFFLOAD}", 2),  # the frozen base on the host
    ("smollm2", f"dp=2 zero=2 {OFFLOAD} host_mem=0", 2),  # ... and on disk
    *[(f, p, w) for p, w in (("tp=2", 2), ("tp=4 tp_mode=2d", 4)) for f in ("gpt2", "bert")],
]


@pytest.fixture(scope="session")
def smollm2_four_blocks(smollm2, tmp_path_factory):
    return families.cut_smollm2(smollm2.folder, tmp_path_factory.mktemp("smollm2-4-blocks"),
                                blocks=BLOCKS)


@pytest.mark.full
@pytest.mark.parametrize("family, plan, world", CASES, ids=[f"{f}-{p}" for f, p, _ in CASES])
def test_lora_trains_five_steps_like_single_process_peft(request, ranks, references, family,
                                                         plan, world):
    folder = str(request.getfixturevalue("smollm2_four_blocks")) if family == "smollm2" \
        else None
    name = f"{family}-{BLOCKS}-blocks" if folder else family
    cell = harness.Cell(f"{name}+lora-{STEPS}-steps", plan, world)
    results = ranks(world).run(harness.train_on_rank, family, plan, folder,
                               with_near_zero_lora, STEPS, timeout_s=600)
    assert not any("refused" in r for r in results), [r.get("refused") for r in results]
    key = ("lora", name, STEPS, *harness.batch_split(plan, world))
    if key not in references:
        references[key] = _reference(family, folder, *key[3:])
    ref = references[key]
    assert len(ref["losses"]) == STEPS
    assert ref["grads"] and all(".lora_" in n for n in ref["grads"]), sorted(ref["grads"])
    harness.compare(cell, ref, results).record()
    assert not cell.problems, "\n".join(cell.problems)
    pieces = {n for r in results for n, *_ in r["grads"]}
    assert pieces == set(ref["grads"]), sorted(pieces ^ set(ref["grads"]))
    assert not any(r["frozen_grads"] for r in results), [r["frozen_grads"] for r in results]
    print(f"{name} {plan}: loss {cell.loss_rel:.2e}, grad {cell.grad_rel:.2e} ({cell.worst})")


def _reference(family: str, folder: str | None, dp: int, microbatches: int) -> dict:
    """Single-process peft on the same model; SmolLM2's four-block folder only for this call
    (the session's other cells use the two-block cut)."""
    with families.using_smollm2(folder) if folder else contextlib.nullcontext():
        return harness.reference(FAMILIES[family], dp, microbatches,
                                 wrap=with_near_zero_lora, steps=STEPS)
