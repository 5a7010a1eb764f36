"""HF ViT as data: patch embedding (a convolution, kept whole), class token and learned
positions, bidirectional attention, a classifier on the class token. Module names differ
between transformers 4.x (``attention.attention.query``, ``intermediate.dense``) and 5.x
(``attention.q_proj``, ``mlp.fc1``); each rule lists both."""

from __future__ import annotations

from kernels_runtime.policies.specs import (
    AttentionSpec,
    ModelLayout,
    PipelineSpec,
    PositionSpec,
    Rule,
)

_EMBEDDINGS = ("vit.embeddings", "embeddings")
_PATCHES = ("vit.embeddings.patch_embeddings.projection", "embeddings.patch_embeddings.projection")
_NORM = ("vit.layernorm", "layernorm")

VIT_LAYOUT = ModelLayout(
    blocks=("vit.layers", "layers", "vit.encoder.layer", "encoder.layer"),
    embedding=_PATCHES,
    final_norm=_NORM,
    head=("classifier",),
    attention=AttentionSpec(("attention.attention", "attention"), kv_heads_key=None,
                            causal=False,
                            local_attributes=("num_attention_heads", "all_head_size")),
    positions=PositionSpec("learned", _EMBEDDINGS),  # position_embeddings, a parameter there
    pipeline=PipelineSpec(before=(_EMBEDDINGS,),
                          after=(_NORM, ("vit.pooler", "pooler"), ("classifier",))),
    block_rules=(
        Rule(("layernorm_before",), "replicated"),
        Rule(("attention.q_proj", "attention.attention.query"), "column"),
        Rule(("attention.k_proj", "attention.attention.key"), "column"),
        Rule(("attention.v_proj", "attention.attention.value"), "column"),
        Rule(("attention.o_proj", "attention.output.dense"), "row"),
        Rule(("layernorm_after",), "replicated"),
        Rule(("mlp.fc1", "intermediate.dense"), "column"),
        Rule(("mlp.fc2", "output.dense"), "row"),
    ),
    outer_rules=(
        Rule(_EMBEDDINGS, "replicated"),  # class token, positions (and a mask token)
        Rule(_PATCHES, "replicated"),
        Rule(_NORM, "replicated"),
        Rule(("vit.pooler.dense", "pooler.dense"), "replicated", optional=True),
        Rule(("classifier",), "replicated", optional=True),
    ),
)
