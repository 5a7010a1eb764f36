"""Mixture-of-experts blocks as data: where a family keeps its router, experts and shared expert.

Expert parallelism (``kernels_runtime.parallel.expert``) swaps every sparse-MoE block for one
holding only its rank's experts, so it asks each block the same questions: which module routes
(``gate``: returns router logits (t, E), routing weights (t, k) and expert ids (t, k), as every
transformers router of the 5.x MoE families does), where the E experts' weights are (fused 3-D
tensors ``gate_up_proj`` (E, 2*I, h) and ``down_proj`` (E, h, I), the layout transformers 5
uses for Mixtral and Qwen-MoE), and whether a dense shared expert runs beside them (Qwen2-MoE:
``shared_expert``, scaled by ``sigmoid(shared_expert_gate(x))``). ``MOE_BLOCKS`` answers by the
block's class name; ``moe_spec`` falls back to the generic reading (a ``gate`` and fused
``experts`` module) for a family not listed, so a new Mixtral-like model needs no entry.
Blocks whose experts are an ``nn.ModuleList`` of MLPs (transformers 4, hand-written) have their
own reader, ``moe_modulelist.py``.

``MOE_POLICY`` is the same families as a model policy (registered with the HF ones): LLaMA's
attention and pipeline split points, a shared expert split as a gated MLP under tp, router and
experts left whole for the expert applier (which splits the experts over ep and, under tp,
each expert over tp).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from kernels_runtime.policies.hf import HFPolicy
from kernels_runtime.policies.llama import LLAMA_LAYOUT
from kernels_runtime.policies.specs import Rule


@dataclass(frozen=True)
class MoeSpec:
    """One family's sparse-MoE block: the attribute names of its parts."""

    router: str = "gate"
    experts: str = "experts"
    shared_expert: str | None = None  # a dense MLP every token runs through
    shared_gate: str | None = None  # (h -> 1) whose sigmoid scales the shared expert


MOE_BLOCKS: dict[str, MoeSpec] = {
    "MixtralSparseMoeBlock": MoeSpec(),
    "Qwen3MoeSparseMoeBlock": MoeSpec(),
    "Qwen2MoeSparseMoeBlock": MoeSpec(shared_expert="shared_expert",
                                      shared_gate="shared_expert_gate"),
}
FUSED = ("gate_up_proj", "down_proj", "act_fn")  # what the experts module must hold


def moe_spec(module: nn.Module) -> MoeSpec | None:
    """The spec of a sparse-MoE block, or None when ``module`` is not one: a listed class, or
    any module with a ``gate`` router and an ``experts`` module holding fused 3-D weights."""
    spec = MOE_BLOCKS.get(type(module).__name__, MoeSpec())
    router, experts = getattr(module, spec.router, None), getattr(module, spec.experts, None)
    if router is None or experts is None or not all(hasattr(experts, n) for n in FUSED):
        return None
    if getattr(experts.gate_up_proj, "dim", lambda: 0)() != 3:
        return None
    own = {name for name, _ in experts.named_parameters(recurse=False)}
    if type(module).__name__ not in MOE_BLOCKS and own != {"gate_up_proj", "down_proj"}:
        return None  # biases or other parts (gpt-oss): a different expert MLP, not guessed
    return spec


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module, MoeSpec]]:
    """(path, block, spec) of every sparse-MoE block of ``model``, outermost first; a block
    inside another one is not listed twice."""
    found: list[tuple[str, nn.Module, MoeSpec]] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{outer}.") for outer, _, _ in found):
            continue
        spec = moe_spec(module)
        if spec is not None:
            found.append((path, module, spec))
    return found


def expert_count(block: nn.Module, spec: MoeSpec) -> int:
    """E, the number of experts of a block (the first dimension of its fused weights)."""
    return int(getattr(block, spec.experts).gate_up_proj.shape[0])


# ---- the families as a model policy: tensor parallelism and pipeline stages ----------------
# LLaMA's attention and outer layout; in each block either a sparse-MoE block (router and
# experts replicated by the tensor applier: under ep the expert applier then splits the
# experts over ep and, inside each expert, over tp; a shared expert split as a gated MLP) or,
# in Qwen2-MoE's ``mlp_only_layers``, a dense gated MLP.
_ATTENTION_RULES = tuple(r for r in LLAMA_LAYOUT.block_rules if not r.paths[0].startswith("mlp."))
MOE_LAYOUT = replace(LLAMA_LAYOUT, block_rules=(
    *_ATTENTION_RULES,
    Rule(("mlp.gate_proj",), "column", optional=True),  # a dense block
    Rule(("mlp.up_proj",), "column", optional=True),
    Rule(("mlp.down_proj",), "row", optional=True),
    Rule(("mlp.gate",), "replicated", optional=True),  # the router (t, h) -> (t, E)
    Rule(("mlp.experts",), "replicated", optional=True),  # split by the expert applier
    Rule(("mlp.shared_expert.gate_proj",), "column", optional=True),
    Rule(("mlp.shared_expert.up_proj",), "column", optional=True),
    Rule(("mlp.shared_expert.down_proj",), "row", optional=True),
    Rule(("mlp.shared_expert_gate",), "replicated", optional=True),
), extra={"experts": "split over ep by the expert applier, and over tp inside each expert "
                     "when ep > 1; replicated over tp when ep = 1"})

MOE_POLICY = HFPolicy(
    name="moe",
    summary="HF Mixtral, Qwen2-MoE, Qwen3-MoE (*Model, *ForCausalLM); blocks at model.layers",
    model_types=("mixtral", "qwen2_moe", "qwen3_moe"),
    block_paths=("layers",),
    layout=MOE_LAYOUT,
)
