"""Adapters trained on the real SmolLM2 under tp=3 leave the plan: to peft's own folder, and
into another plan.

What is protected: the real SmolLM2 (two blocks) with rank-8 adapters on its seven projections,
trained two SGD steps under ``tp=3`` (its 3 key/value heads one per rank) and saved with
``save``, is exported by ``export_hf`` through a plain ``PeftModel`` as peft's adapter folder
(``adapter_config.json``, ``adapter_model.safetensors``, no base weights), which
``PeftModel.from_pretrained`` loads over the base model in one process with the logits of the
same two steps trained in one process by peft (1e-5); with ``merged=True`` it writes the base
with the adapters folded in, an ordinary checkpoint transformers loads without peft, with the
same logits (1e-5); and the tp=3 checkpoint resumes under
``dp=2 zero=2`` with the losses of an uninterrupted single-process run (1e-5), its data split
per step as each plan splits it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.families import FAMILIES, global_batch, pieces_of, smollm2_folder
from conformance.lora import with_lora

pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # 3 ranks on the real 49152-token vocabulary

FAMILY = FAMILIES["smollm2"]
MOMENTUM = 0.9


def _train_on_rank(rank: int, world: int, plan: str, folder: str, directory: str,
                   steps: range, resume: bool) -> list[float]:
    """SmolLM2 with adapters under ``plan``: resumed from ``directory`` or fresh, trained on
    ``steps``, saved after the last."""
    from kernels_runtime import load, parallelize, save, train_step

    from helpers.distributed import context

    smollm2_folder(Path(folder))
    model = with_lora(FAMILY, FAMILY.build())
    ctx = context(plan)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=FAMILY.lr,
                                                    momentum=MOMENTUM), ctx=ctx, verbose=False)
    if resume:
        load(directory, model, opt)
    losses = [train_step(model, opt, pieces_of(FAMILY, s, ctx.dp_size, 1)[ctx.dp_rank]).loss
              for s in steps]
    if not resume:
        save(directory, model, opt, step=steps.stop)
    return losses


def _single_process(splits: list[int]) -> tuple[torch.nn.Module, list[float]]:
    """peft in one process, step s averaging the loss over ``splits[s]`` data-parallel parts."""
    model = with_lora(FAMILY, FAMILY.build())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=FAMILY.lr,
                          momentum=MOMENTUM)
    losses = []
    for step, dp in enumerate(splits):
        parts = [rank[0] for rank in pieces_of(FAMILY, step, dp, 1)]
        total = 0.0
        for batch in parts:
            loss = model(**batch).loss / len(parts)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses


def _relative(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def test_a_tp3_adapter_exports_to_peft_and_resumes_under_zero2(ranks, smollm2_cut, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kernels_runtime import export_hf

    folder, ckpt = str(smollm2_cut), str(tmp_path / "ckpt")
    trained = ranks(3).run(_train_on_rank, "tp=3", folder, ckpt, range(2), False,
                           timeout_s=300)[0]
    _, want = _single_process([1, 1, 2, 2])
    assert _relative(trained, want[:2]) < 1e-5, (trained, want[:2])

    out = export_hf(ckpt, with_lora(FAMILY, FAMILY.build()), tmp_path / "adapter")
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names, names
    assert not any(n.startswith("model") for n in names), names  # the adapter, not the base
    loaded = PeftModel.from_pretrained(FAMILY.build(), out).eval()
    two_steps, _ = _single_process([1, 1])
    batch = {k: v for k, v in global_batch(FAMILY, 7).items() if k != "labels"}
    with torch.no_grad():
        got, ref = loaded(**batch).logits, two_steps(**batch).logits
        before = with_lora(FAMILY, FAMILY.build())(**batch).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, f"exported adapter's logits differ by {rel:.2e}"
    moved = ((before - ref).norm() / ref.norm()).item()
    assert moved > 100 * 1e-5, f"two steps moved the logits by {moved:.1e} only"

    merged = export_hf(ckpt, with_lora(FAMILY, FAMILY.build()), tmp_path / "merged",
                       merged=True)
    assert "model.safetensors" in {p.name for p in merged.iterdir()}
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()  # no peft: the merged base
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        rel = ((plain(**batch).logits - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, f"the merged export's logits differ by {rel:.2e}"

    resumed = ranks(2).run(_train_on_rank, "dp=2 zero=2", folder, ckpt, range(2, 4), True,
                           timeout_s=300)[0]
    assert _relative(resumed, want[2:]) < 1e-5, (resumed, want[2:])
