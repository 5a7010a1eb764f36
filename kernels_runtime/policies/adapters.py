"""Models wrapped in LoRA adapters (peft's ``PeftModel``), seen through to the model inside.

Fine-tuning a pretrained model wraps it: ``get_peft_model`` puts the transformers model at
``base_model.model`` and replaces each targeted linear layer by a LoRA layer holding the frozen
layer as ``base_layer`` and the trainable factors ``lora_A[adapter]`` (r, in) and
``lora_B[adapter]`` (out, r). The wrapper is still that family's model, so its policy is the
inner model's, with every outer path under the wrapper's prefix (``AdapterPolicy``); a rule
naming a module that became a LoRA layer covers the layer's base and factors
(``resolve.lora_specs``).
Parameter names stay the wrapper's own (``base_model.model....q_proj.base_layer.weight``), so
checkpoints and ``named_parameters`` are unchanged.

peft is optional: wrappers and LoRA layers are recognised by duck typing, never imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from kernels_runtime.policies.base import ModelConfig, Policy
from kernels_runtime.policies.specs import ModelLayout, Paths, PipelineSpec


def _from_peft(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.")


def adapted_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(prefix, inner model) of a peft wrapper (``PeftModel`` or a bare ``LoraModel``); None
    for any other model."""
    if not _from_peft(model):
        return None
    prefix, node = "", model
    base = getattr(node, "base_model", None)
    if isinstance(base, nn.Module) and base is not node and _from_peft(base):
        prefix, node = "base_model.", base
    inner = getattr(node, "model", None)
    if not isinstance(inner, nn.Module) or _from_peft(inner):
        return None
    return f"{prefix}model.", inner


def _under(prefix: str, paths: Paths) -> Paths:
    return tuple(f"{prefix}{p}" if p else prefix.rstrip(".") for p in paths)


def prefixed(layout: ModelLayout, prefix: str) -> ModelLayout:
    """``layout`` with every path relative to the model under ``prefix`` (block rules and the
    attention path stay relative to a block)."""
    return replace(
        layout,
        blocks=_under(prefix, layout.blocks),
        embedding=_under(prefix, layout.embedding),
        final_norm=_under(prefix, layout.final_norm) if layout.final_norm else None,
        head=_under(prefix, layout.head) if layout.head else None,
        positions=replace(layout.positions, path=_under(prefix, layout.positions.path)),
        pipeline=PipelineSpec(before=tuple(_under(prefix, p) for p in layout.pipeline.before),
                              after=tuple(_under(prefix, p) for p in layout.pipeline.after)),
        outer_rules=tuple(replace(r, paths=_under(prefix, r.paths))
                          for r in layout.outer_rules),
    )


@dataclass(frozen=True)
class AdapterPolicy(Policy):
    """The policy of the model inside a peft wrapper, answering for the wrapper."""

    inner: Policy | None = None
    prefix: str = ""

    def _model(self, model: nn.Module) -> nn.Module:
        found = adapted_model(model)
        return found[1] if found is not None else model

    def matches(self, model: nn.Module) -> bool:
        found = adapted_model(model)
        return found is not None and self.inner is not None and self.inner.matches(found[1])

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        assert self.inner is not None
        return self.inner.blocks(self._model(model))

    def model_config(self, model: nn.Module) -> ModelConfig:
        assert self.inner is not None
        return self.inner.model_config(self._model(model))

    def model_layout(self, model: nn.Module) -> ModelLayout | None:
        assert self.inner is not None
        layout = self.inner.model_layout(self._model(model))
        return prefixed(layout, self.prefix) if layout is not None else None

    def attention_heads(self, model: nn.Module) -> tuple[int | None, int | None]:
        assert self.inner is not None
        return self.inner.attention_heads(self._model(model))


def adapter_policy(model: nn.Module, inner: Policy) -> AdapterPolicy:
    """``inner`` (the policy of the model inside the wrapper ``model``) for the wrapper."""
    found = adapted_model(model)
    assert found is not None
    return AdapterPolicy(name=f"{inner.name}+peft", summary=f"{inner.summary} (peft wrapper)",
                         inner=inner, prefix=found[0])
