"""``Policy``: what the runtime needs to know about one model family, kept out of the model.

Parallelizing a model means answering model-specific questions: which modules are the repeated
transformer blocks (the unit of activation checkpointing and of pipeline splits), how many heads
and layers it has (what ``Plan.validate`` checks tp and pp against), which ``Linear`` is column-
or row-parallel (a fused QKV and its head layout, GPT-2's transposed ``Conv1D``), which parameters
are tied, where attention lives and how positions are encoded, and which glue runs before and
after the blocks of a pipeline. A policy answers them for one family, as data (a ``ModelLayout``
of ``specs.py``), so the strategies stay model-agnostic and the user never rewrites the model.
This is the role of a per-model ``parallelize.py`` plan in torchtitan and of a policy in
ColossalAI's shardformer.

Policies are frozen dataclasses: a policy is a description, not state, so one instance serves every
model of its family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import nn

from kernels_runtime.policies.resolve import ResolvedLayout, resolve
from kernels_runtime.policies.specs import ModelLayout

# The shape facts every policy reports, under the names ``Plan.validate`` reads. ``None`` means
# the policy does not know the value (or the model has no such thing, e.g. a ViT vocabulary).
CONFIG_KEYS = (
    "num_attention_heads",
    "num_hidden_layers",
    "hidden_size",
    "num_key_value_heads",
    "vocab_size",
)

ModelConfig = dict[str, int | None]


@dataclass(frozen=True)
class Policy(ABC):
    """How the runtime treats one model family.

    ``name`` identifies the policy in the registry (registering a policy under an existing name
    replaces it, so re-running a notebook cell does not stack copies); ``summary`` is one line for
    humans.
    """

    name: str
    summary: str = ""

    @abstractmethod
    def matches(self, model: nn.Module) -> bool:
        """Whether this policy understands ``model``; the registry takes the first that does."""

    @abstractmethod
    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks in execution order; empty if the model has none."""

    def model_config(self, model: nn.Module) -> ModelConfig:
        """Shape facts of ``model`` under the names in ``CONFIG_KEYS`` (``None`` where unknown)."""
        return dict.fromkeys(CONFIG_KEYS)

    def model_layout(self, model: nn.Module) -> ModelLayout | None:
        """The family's plan as data (``specs.ModelLayout``); None when the policy has none."""
        return None

    def resolve(self, model: nn.Module) -> ResolvedLayout:
        """A ``ParamSpec`` for every parameter of ``model`` under this policy's layout (with
        what does not fit reported rather than guessed)."""
        layout = self.model_layout(model)
        if layout is None:
            out = ResolvedLayout()
            out.uncovered = [n for n, _ in model.named_parameters()]
            return out
        return resolve(model, layout)

    def attention_heads(self, model: nn.Module) -> tuple[int | None, int | None]:
        """(query heads, key/value heads) of the model's attention; None where unknown."""
        config = self.model_config(model)
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads")
        return heads, kv if kv is not None else heads

    def describe(self) -> str:
        """One line for logs and the notebook: the policy's name and what it covers."""
        return f"{self.name}: {self.summary}" if self.summary else self.name
