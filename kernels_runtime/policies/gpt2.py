"""HF GPT-2 as data: fused QKV in transposed ``Conv1D`` layers, learned positions, the LM head
tied to the token embedding."""

from __future__ import annotations

from kernels_runtime.policies.specs import (
    AttentionSpec,
    ModelLayout,
    PipelineSpec,
    PositionSpec,
    Rule,
)

_WTE, _WPE = ("transformer.wte", "wte"), ("transformer.wpe", "wpe")
_LN_F = ("transformer.ln_f", "ln_f")

GPT2_LAYOUT = ModelLayout(
    blocks=("transformer.h", "h"),
    embedding=_WTE,
    final_norm=_LN_F,
    head=("lm_head",),
    # c_attn's output is [q | k | v], each n_embd wide, heads contiguous inside each part
    attention=AttentionSpec(("attn",), kv_heads_key=None,
                            local_attributes=("split_size", "embed_dim", "num_heads")),
    positions=PositionSpec("learned", _WPE),
    pipeline=PipelineSpec(before=(_WTE, _WPE, ("transformer.drop", "drop")),
                          after=(_LN_F, ("lm_head",), ("score",), ("classifier",),
                                 ("qa_outputs",))),
    block_rules=(
        Rule(("ln_1",), "replicated"),
        Rule(("attn.c_attn",), "column", transposed=True, fused=("q", "k", "v")),
        Rule(("attn.c_proj",), "row", transposed=True),
        Rule(("ln_cross_attn",), "replicated", optional=True),  # add_cross_attention=True
        Rule(("crossattention.q_attn",), "column", transposed=True, optional=True),
        Rule(("crossattention.c_attn",), "column", transposed=True, fused=("k", "v"),
             optional=True),
        Rule(("crossattention.c_proj",), "row", transposed=True, optional=True),
        Rule(("ln_2",), "replicated"),
        Rule(("mlp.c_fc",), "column", transposed=True),
        Rule(("mlp.c_proj",), "row", transposed=True),
    ),
    outer_rules=(
        Rule(_WTE, "vocab"),
        Rule(_WPE, "replicated"),
        Rule(_LN_F, "replicated"),
        Rule(("lm_head",), "vocab", optional=True),  # tied to wte unless configured apart
        Rule(("score",), "replicated", optional=True),  # GPT2ForSequenceClassification
        Rule(("classifier",), "replicated", optional=True),  # GPT2ForTokenClassification
        Rule(("qa_outputs",), "replicated", optional=True),  # GPT2ForQuestionAnswering
    ),
)
