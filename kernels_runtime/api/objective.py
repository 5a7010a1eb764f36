"""What a training step optimizes: a forward and a loss, kept apart.

A pipeline runs the forward of a micro-batch across stages and the loss on the last one only,
so the loss cannot be buried inside the forward. An ``Objective`` holds the two separately and
is still callable as ``objective(model, batch)``, so any ``loss_fn(model, batch)`` written for
the sequential schedule keeps working.

Two objectives for ``(input_ids, labels)`` batches or dicts of model inputs with ``labels``:

- ``causal_lm_loss`` (``train_step``'s default) lets the model compute its loss: HF models given
  ``labels`` return an output with ``.loss``; any model may return the loss tensor itself.
  The shortcuts below apply to next-token models only (``next_token_model``): a masked LM or a
  classifier under tp computes its own loss from gathered outputs, and under sp is refused.
  Under tensor parallelism with a vocabulary-parallel LM head it computes the same loss from
  each rank's slice of the logits instead (``vocab_parallel_cross_entropy``), never gathering
  the full (b, s, V) logits; under sp (ring, all_to_all) from each rank's tokens'
  logits, never joining the sequence (``causal_lm_loss_sequence_parallel``).
- ``next_token_loss`` computes it outside the model, from its logits: the labels shifted by one
  position, ``-100`` ignored, averaged over the counted tokens in fp32, as transformers does
  inside its causal LMs. This is the one a pipeline's last stage can run on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels_runtime.parallel.sequence.loss import causal_lm_loss_sequence_parallel
from kernels_runtime.parallel.state import parallel_state
from kernels_runtime.parallel.tensor.cross_entropy import causal_lm_loss_vocab_parallel
from kernels_runtime.parallel.tensor.grid import LMHead2D
from kernels_runtime.parallel.tensor.grid_parallel import causal_lm_loss_grid

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Objective:
    forward: Callable[[nn.Module, Any], Any]  # (model, batch) -> output
    loss: Callable[[Any, Any], torch.Tensor]  # (output, batch) -> scalar loss

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.loss(self.forward(model, batch), batch)


def _labels(batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        return batch["labels"]
    return batch[1]


def lm_forward(model: nn.Module, batch: Any) -> Any:
    """The model on the batch's inputs (without the labels: the loss is computed outside)."""
    if isinstance(batch, dict):
        return model(**{k: v for k, v in batch.items() if k != "labels"})
    return model(input_ids=batch[0])


def shifted_cross_entropy(output: Any, batch: Any) -> torch.Tensor:
    """Next-token cross-entropy in fp32: logits at position t against the label at t + 1."""
    logits = output.logits if hasattr(output, "logits") else output  # (b, s, V)
    labels = _labels(batch)  # (b, s)
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX)


def next_token_model(model: nn.Module) -> bool:
    """Whether the model's own loss is the next-token loss the shortcuts below compute: a
    transformers causal LM (its class among the causal-LM classes), or a model outside
    transformers (whose logits ``causal_lm_loss`` is documented to score that way). A masked LM
    or a classifier computes another loss from its labels."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return True
    if not isinstance(model, PreTrainedModel):
        return True
    causal = _causal_lm_classes()
    return any(cls.__name__ in causal for cls in type(model).__mro__)  # FSDP2 subclasses it


@functools.cache
def _causal_lm_classes() -> frozenset[str]:
    """transformers' causal-LM class names, read once (asked on every micro-batch)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return frozenset(n for v in names for n in (v if isinstance(v, (list, tuple)) else (v,)))


def forward_with_labels(model: nn.Module, batch: Any) -> Any:
    state = parallel_state(model)
    if state is not None and (state.sequence is not None or state.vocab_head is not None) \
            and not next_token_model(model):
        if state.sequence is not None:
            raise ValueError(
                f"train_step's default loss under sp_mode={state.ctx.plan.sp_mode} is the "
                f"next-token loss of a causal LM on sequence shards, but "
                f"{type(model).__name__} computes another loss from its labels; pass "
                "loss_fn=... computing it from each rank's sequence shard, or split the model "
                "with tp or dp instead of sp")
        if isinstance(batch, dict):
            return model(**batch)
        return model(input_ids=batch[0], labels=batch[1])
    if state is not None and state.sequence is not None:
        head = model.get_submodule(state.vocab_head) if state.vocab_head else None
        ids, labels = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) \
            else (batch[0], batch[1])
        rest = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")} \
            if isinstance(batch, dict) else {}
        return causal_lm_loss_sequence_parallel(model, state.sequence, state.ctx.size("sp"),
                                                ids, labels, head, **rest)
    if state is not None and state.vocab_head is not None:
        head = model.get_submodule(state.vocab_head)
        if isinstance(head, LMHead2D):
            ids, labels = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) \
                else (batch[0], batch[1])
            rest = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")} \
                if isinstance(batch, dict) else {}
            return causal_lm_loss_grid(model, head, ids, labels, **rest)
        if isinstance(batch, dict):
            rest = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
            return causal_lm_loss_vocab_parallel(model, head, batch["input_ids"],
                                                 batch["labels"], **rest)
        return causal_lm_loss_vocab_parallel(model, head, batch[0], batch[1])
    if isinstance(batch, dict):
        return model(**batch)
    return model(input_ids=batch[0], labels=batch[1])


def model_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss the model computed: ``output.loss``, or the output itself."""
    return output.loss if hasattr(output, "loss") else output


causal_lm_loss = Objective(forward=forward_with_labels, loss=model_loss)
next_token_loss = Objective(forward=lm_forward, loss=shifted_cross_entropy)
