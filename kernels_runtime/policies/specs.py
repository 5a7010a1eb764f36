"""The vocabulary of a model-family plan: what each module is, written as data.

A policy answers, for one family, every model-specific question the parallel dimensions ask,
so the strategies stay model-agnostic (torchtitan keeps one such plan per model; ColossalAI's
shardformer one policy per model). Here the answers are frozen dataclasses, not code:

- ``Rule``: how the parameters of one module split under tensor parallelism: ``column``
  (output features split; a fused QKV by heads, GPT-2's ``Conv1D`` with its (in, out) weight),
  ``row`` (input features split), ``vocab`` (an embedding or LM head split over the
  vocabulary) or ``replicated`` (norms, positions, small heads).
- ``AttentionSpec``: where attention lives in a block and its query and key/value head counts.
- ``PositionSpec``: learned position embeddings or rotary (RoPE) offsets.
- ``PipelineSpec``: the glue that runs before the blocks (first stage) and after them (last).
- ``ModelLayout``: all of it for one family, plus the embedding, final norm and head.

Module paths are tuples of candidates, tried in order, because transformers renames modules
between releases (ViT's ``attention.attention.query`` in 4.x is ``attention.q_proj`` in 5.x).
"""

from __future__ import annotations

from dataclasses import dataclass, field

STYLES = ("column", "row", "vocab", "replicated")
Paths = tuple[str, ...]


@dataclass(frozen=True)
class Rule:
    """How the parameters of the module at ``paths`` split under tensor parallelism."""

    paths: Paths
    style: str
    transposed: bool = False  # weight stored (in, out), as transformers' Conv1D
    fused: tuple[str, ...] = ()  # parts along the output features, each split by heads
    optional: bool = False  # present only in some models of the family (a pooler, a head)
    kv: bool = False  # a key or value projection: split by key/value heads, which are
    # replicated (each rank keeps the head its query heads share) when tp exceeds them

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"Rule style {self.style!r} is not one of {STYLES}")
        if self.fused and self.style != "column":
            raise ValueError("a fused projection is column-parallel (its parts split by heads)")


@dataclass(frozen=True)
class AttentionSpec:
    """The attention module of a block (``path`` relative to it) and its head counts, read
    from the model's config under these keys."""

    path: Paths
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = "num_key_value_heads"  # None: as many as query heads
    causal: bool = True
    # attributes of the attention module that hold widths or head counts of the whole layer
    # and must hold this rank's share once its projections are split by heads
    local_attributes: tuple[str, ...] = ()
    # the attribute holding query heads per key/value head (grouped-query attention): it
    # changes when tp exceeds the key/value heads and each rank keeps one of them
    groups_attribute: str | None = None


@dataclass(frozen=True)
class PositionSpec:
    kind: str  # "learned" (an embedding at ``path``), "rope" (rotary, module at ``path``),
    # or "unknown"
    path: Paths = ()


@dataclass(frozen=True)
class PipelineSpec:
    """Modules that run before the blocks (on the first stage) and after them (on the last),
    in execution order. Everything else is inside the blocks."""

    before: tuple[Paths, ...] = ()
    after: tuple[Paths, ...] = ()


@dataclass(frozen=True)
class ModelLayout:
    """One family's plan (module docstring). Outer paths are relative to the model; block
    rules and the attention path relative to each block."""

    blocks: Paths
    embedding: Paths
    final_norm: Paths | None
    head: Paths | None
    attention: AttentionSpec | None  # None: the policy does not know where attention is
    positions: PositionSpec
    pipeline: PipelineSpec
    block_rules: tuple[Rule, ...] = ()
    outer_rules: tuple[Rule, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)  # family notes for humans


@dataclass(frozen=True)
class ParamSpec:
    """What the resolved plan says about one parameter."""

    module: str  # the module's path in the model
    attribute: str  # "weight", "bias", ...
    style: str
    transposed: bool = False
    fused: tuple[str, ...] = ()
    block: int | None = None  # index of the block holding it; None outside the blocks
    kv: bool = False  # split by key/value heads (``Rule.kv``)
    adapter: str = ""  # "A" or "B": a LoRA factor of the layer two modules up (its style
    # follows the layer's: A of a row-parallel layer splits by input, B of a column-parallel
    # one by output; ``resolve.lora_specs``), swapped with that layer, never alone
