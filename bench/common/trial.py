"""The small GPT-2, its token batches and its loss that the data-parallel and planner benchmarks
both train, so that the planner's measured step is the data-parallel benchmark's step.

The model comes from ``kernels_runtime.calibrate.trial`` (the tuner's "Measure" button builds
the same one); the imports are inside the functions because these run on the ranks, and the
parent process that only prints tables should not pay for importing torch.
"""

from __future__ import annotations

from typing import Any


def gpt2_model(layers: int, hidden: int, seq: int) -> Any:
    """A GPT-2 of ``layers`` blocks of width ``hidden`` over 256 byte tokens, heads of 64."""
    from kernels_runtime.calibrate.trial import build_model

    return build_model({"model_type": "gpt2", "vocab": 256, "seq": seq, "hidden": hidden,
                        "layers": layers, "heads": max(1, hidden // 64),
                        "attention": "sdpa"})


def token_batch(step: int, rank: int, batch: int, seq: int) -> Any:
    """Random tokens and their next-token targets, each (batch, seq), per step and rank."""
    from kernels_runtime.calibrate.trial import token_batch as batch_of

    return batch_of(step, rank, batch, seq)


def next_token_loss(model: Any, batch: Any) -> Any:
    """The mean next-token cross entropy of ``model`` on ``batch``."""
    from kernels_runtime.calibrate.trial import next_token_loss as loss_of

    return loss_of(model, batch)
