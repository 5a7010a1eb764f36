"""Policies for Hugging Face transformers models: GPT-2, LLaMA, BERT and ViT.

transformers is optional for users of the runtime, so this module never imports it: a model is
recognised by duck typing, as an instance of a class named ``PreTrainedModel`` from the
``transformers`` package whose ``config.model_type`` is one this policy covers. Every head of a
family (``GPT2LMHeadModel``, ``BertForSequenceClassification``, ...) shares the base model's
``model_type``, and the blocks are looked up under ``model.base_model`` (``transformer`` for
GPT-2 heads, ``model`` for LLaMA, ``bert``, ``vit``), so one policy covers the bare model and all
its heads.

Block paths are a tuple of candidates because transformers moves them between releases: ViT keeps
its blocks at ``encoder.layer`` in 4.x and directly at ``layers`` in 5.x.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kernels_runtime.policies.base import CONFIG_KEYS, ModelConfig, Policy
from kernels_runtime.policies.bert import BERT_LAYOUT
from kernels_runtime.policies.gpt2 import GPT2_LAYOUT
from kernels_runtime.policies.llama import LLAMA_LAYOUT
from kernels_runtime.policies.specs import ModelLayout
from kernels_runtime.policies.vit import VIT_LAYOUT


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``, checked without importing it."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    node: object = root
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node if isinstance(node, nn.Module) else None


@dataclass(frozen=True)
class HFPolicy(Policy):
    """One transformers family: the ``model_type`` values it covers and where its blocks live.

    ``block_paths`` are attribute paths relative to ``model.base_model``, tried in order; the first
    that names an ``nn.ModuleList`` wins. ``layout`` is the family's plan as data.
    """

    model_types: tuple[str, ...] = ()
    block_paths: tuple[str, ...] = ()
    layout: ModelLayout | None = None

    def model_layout(self, model: nn.Module) -> ModelLayout | None:
        return self.layout

    def matches(self, model: nn.Module) -> bool:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        return (
            model_type in self.model_types
            and is_transformers_model(model)
            and self._block_list(model) is not None
        )

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        found = self._block_list(model)
        if found is None:
            raise ValueError(
                f"policy {self.name!r} found no blocks at {' or '.join(self.block_paths)} "
                f"in {type(model).__name__}; is this the model family the policy is for?"
            )
        return list(found)

    def model_config(self, model: nn.Module) -> ModelConfig:
        # transformers configs map the common names onto family-specific ones themselves
        # (GPT2Config.attribute_map: num_attention_heads -> n_head, hidden_size -> n_embd, ...).
        config = model.config
        out: ModelConfig = {}
        for key in CONFIG_KEYS:
            value = getattr(config, key, None)
            out[key] = int(value) if value is not None else None
        return out

    def _block_list(self, model: nn.Module) -> nn.ModuleList | None:
        base = getattr(model, "base_model", model)
        for path in self.block_paths:
            found = _resolve(base, path)
            if isinstance(found, nn.ModuleList):
                return found
        return None


GPT2_POLICY = HFPolicy(
    name="gpt2",
    summary="HF GPT-2 (GPT2Model, GPT2LMHeadModel, ...); blocks at transformer.h",
    model_types=("gpt2",),
    block_paths=("h",),
    layout=GPT2_LAYOUT,
)

LLAMA_POLICY = HFPolicy(
    name="llama",
    summary="HF LLaMA, Mistral, Qwen2, Qwen3 (*Model, *ForCausalLM); blocks at model.layers",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    block_paths=("layers",),
    layout=LLAMA_LAYOUT,
)

BERT_POLICY = HFPolicy(
    name="bert",
    summary="HF BERT (BertModel, BertFor*); blocks at encoder.layer",
    model_types=("bert",),
    block_paths=("encoder.layer",),
    layout=BERT_LAYOUT,
)

VIT_POLICY = HFPolicy(
    name="vit",
    summary="HF ViT (ViTModel, ViTForImageClassification); blocks at layers or encoder.layer",
    model_types=("vit",),
    block_paths=("layers", "encoder.layer"),
    layout=VIT_LAYOUT,
)

HF_POLICIES = (GPT2_POLICY, LLAMA_POLICY, BERT_POLICY, VIT_POLICY)
