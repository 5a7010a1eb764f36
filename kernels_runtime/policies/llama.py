"""HF LLaMA as data, which also fits Mistral, Qwen2 and Qwen3: separate q/k/v projections
with grouped key/value heads, rotary positions, gated MLP, an untied (or tied) LM head."""

from __future__ import annotations

from kernels_runtime.policies.specs import (
    AttentionSpec,
    ModelLayout,
    PipelineSpec,
    PositionSpec,
    Rule,
)

_EMBED, _NORM = ("model.embed_tokens", "embed_tokens"), ("model.norm", "norm")
_ROTARY = ("model.rotary_emb", "rotary_emb")

LLAMA_LAYOUT = ModelLayout(
    blocks=("model.layers", "layers"),
    embedding=_EMBED,
    final_norm=_NORM,
    head=("lm_head",),
    attention=AttentionSpec(("self_attn",), groups_attribute="num_key_value_groups"),
    positions=PositionSpec("rope", _ROTARY),
    pipeline=PipelineSpec(before=(_EMBED, _ROTARY), after=(_NORM, ("lm_head",), ("score",))),
    block_rules=(
        Rule(("input_layernorm",), "replicated"),
        Rule(("self_attn.q_proj",), "column"),
        Rule(("self_attn.k_proj",), "column", kv=True),
        Rule(("self_attn.v_proj",), "column", kv=True),
        Rule(("self_attn.q_norm",), "replicated", optional=True),  # Qwen3: per-head norms
        Rule(("self_attn.k_norm",), "replicated", optional=True),
        Rule(("self_attn.o_proj",), "row"),
        Rule(("post_attention_layernorm",), "replicated"),
        Rule(("mlp.gate_proj",), "column"),
        Rule(("mlp.up_proj",), "column"),
        Rule(("mlp.down_proj",), "row"),
    ),
    outer_rules=(
        Rule(_EMBED, "vocab"),
        Rule(_NORM, "replicated"),
        Rule(("lm_head",), "vocab", optional=True),
        Rule(("score",), "replicated", optional=True),  # *ForSequenceClassification
    ),
)
