"""The model-policy registry: ``get_policy(model)`` says how the runtime should treat a model.

Policies are tried in order and the first whose ``matches(model)`` is true wins. Built-in policies
for HF GPT-2, LLaMA, BERT and ViT come first, and the generic policy is always last, so every
model gets a policy. ``register_policy`` puts a user's policy in front of the built-ins by default,
so a user can override how a family is treated without editing this package.

The registry is the one piece of module-level state in the runtime, on purpose: it holds code (how
to read a model family), not run state, and is the same on every rank, like Python's codec
registry. Anything that varies per run lives in a ``ParallelContext``.
"""

from __future__ import annotations

from torch import nn

from kernels_runtime.policies.adapters import adapted_model, adapter_policy
from kernels_runtime.policies.base import CONFIG_KEYS, ModelConfig, Policy
from kernels_runtime.policies.generic import GenericPolicy
from kernels_runtime.policies.hf import HF_POLICIES, HFPolicy
from kernels_runtime.policies.moe import MOE_POLICY
from kernels_runtime.policies.resolve import (
    ResolvedLayout,
    find_module,
    is_lora_layer,
    resolve,
    tied_parameters,
)
from kernels_runtime.policies.specs import (
    AttentionSpec,
    ModelLayout,
    ParamSpec,
    PipelineSpec,
    PositionSpec,
    Rule,
)

__all__ = [
    "CONFIG_KEYS",
    "AttentionSpec",
    "GenericPolicy",
    "HFPolicy",
    "ModelConfig",
    "ModelLayout",
    "ParamSpec",
    "PipelineSpec",
    "Policy",
    "PositionSpec",
    "ResolvedLayout",
    "Rule",
    "adapted_model",
    "available_policies",
    "find_module",
    "get_policy",
    "is_lora_layer",
    "register_policy",
    "resolve",
    "tied_parameters",
]

_GENERIC = GenericPolicy()
_policies: list[Policy] = [*HF_POLICIES, MOE_POLICY]  # tried in order; _GENERIC always follows them


def get_policy(model: nn.Module) -> Policy:
    """The first registered policy that matches ``model``; the generic policy if none does.
    A peft wrapper no policy matches gets the policy of the model inside it, seen through."""
    for policy in _policies:
        if policy.matches(model):
            return policy
    found = adapted_model(model)
    if found is not None:
        return adapter_policy(model, get_policy(found[1]))
    return _GENERIC


def register_policy(policy: Policy, first: bool = True) -> None:
    """Add ``policy`` in front of all others (``first``) or just before the generic policy.

    A policy registered under an existing name replaces it, so re-running the notebook cell that
    registers it does not stack copies. The generic policy cannot be displaced from last place.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"register_policy takes a Policy, got {type(policy).__name__}")
    if policy.name == _GENERIC.name:
        raise ValueError(f"the name {_GENERIC.name!r} is reserved for the fallback policy")
    _policies[:] = [p for p in _policies if p.name != policy.name]
    if first:
        _policies.insert(0, policy)
    else:
        _policies.append(policy)


def available_policies() -> list[Policy]:
    """Every policy in the order ``get_policy`` tries them, the generic policy last."""
    return [*_policies, _GENERIC]
