"""HF BERT as data: bidirectional attention, learned absolute and token-type positions, the
masked-LM decoder tied to the word embedding and its bias to the prediction head's."""

from __future__ import annotations

from kernels_runtime.policies.specs import (
    AttentionSpec,
    ModelLayout,
    PipelineSpec,
    PositionSpec,
    Rule,
)


def _both(path: str) -> tuple[str, str]:
    """A path under the encoder model, from a task model (``bert.``) or the bare BertModel."""
    return f"bert.{path}", path


BERT_LAYOUT = ModelLayout(
    blocks=_both("encoder.layer"),
    embedding=_both("embeddings.word_embeddings"),
    final_norm=None,  # post-norm blocks: each ends in its own LayerNorm
    head=("cls.predictions.decoder",),
    attention=AttentionSpec(("attention.self",), kv_heads_key=None, causal=False,
                            local_attributes=("num_attention_heads", "all_head_size")),
    positions=PositionSpec("learned", _both("embeddings.position_embeddings")),
    pipeline=PipelineSpec(before=(_both("embeddings"),),
                          after=(_both("pooler"), ("cls",), ("classifier",), ("qa_outputs",))),
    block_rules=(
        Rule(("attention.self.query",), "column"),
        Rule(("attention.self.key",), "column"),
        Rule(("attention.self.value",), "column"),
        Rule(("attention.output.dense",), "row"),
        Rule(("attention.output.LayerNorm",), "replicated"),
        Rule(("intermediate.dense",), "column"),
        Rule(("output.dense",), "row"),
        Rule(("output.LayerNorm",), "replicated"),
    ),
    outer_rules=(
        Rule(_both("embeddings.word_embeddings"), "vocab"),
        Rule(_both("embeddings.position_embeddings"), "replicated"),
        Rule(_both("embeddings.token_type_embeddings"), "replicated"),
        Rule(_both("embeddings.LayerNorm"), "replicated"),
        Rule(_both("pooler.dense"), "replicated", optional=True),
        Rule(("cls.predictions",), "vocab", optional=True),  # its bias, over the vocabulary
        Rule(("cls.predictions.transform.dense",), "replicated", optional=True),
        Rule(("cls.predictions.transform.LayerNorm",), "replicated", optional=True),
        Rule(("cls.predictions.decoder",), "vocab", optional=True),  # tied to the embedding
        Rule(("cls.seq_relationship",), "replicated", optional=True),  # next-sentence head
        Rule(("classifier",), "replicated", optional=True),
        Rule(("qa_outputs",), "replicated", optional=True),
    ),
)
