"""``ModelSpec``: the shape facts of a transformer and its workload that the cost model reads.

The planner predicts before any model exists, so it takes a description: a dict with the usual
names, or a Hugging Face config object (``GPT2Config``, ``LlamaConfig``, ...) plus the workload
(sequence length and batch), which a model config does not hold. Parameter counts are derived
from the shape unless given, using the layout of the family (GPT-2: biases, LayerNorm, learned
positions, tied embeddings; LLaMA-like: no biases, RMSNorm, gated MLP, rotary positions).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

_NAMES = {  # our field -> names it goes by in dicts and HF configs, first match wins
    "hidden": ("hidden", "hidden_size", "n_embd", "d_model"),
    "layers": ("layers", "num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("heads", "num_attention_heads", "n_head", "num_heads"),
    "vocab": ("vocab", "vocab_size"),
    "seq": ("seq", "seq_len", "sequence_length"),
    "batch": ("batch", "batch_per_rank", "batch_size"),
    "global_batch": ("global_batch",),
    "ffn": ("ffn", "intermediate_size", "n_inner", "ffn_dim"),
    "kv_heads": ("kv_heads", "num_key_value_heads"),
    "params": ("params", "num_parameters"),
    "model_type": ("model_type",),
    "attention": ("attention", "_attn_implementation", "attn_implementation"),
    "activation": ("activation", "activation_function", "hidden_act"),
    "dropout": ("dropout", "resid_pdrop", "hidden_dropout_prob", "hidden_dropout"),
    "tied_embeddings": ("tied_embeddings", "tie_word_embeddings"),
    "experts": ("experts", "num_local_experts", "num_experts"),
    "top_k": ("top_k", "num_experts_per_tok"),
}
_GATED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral",
                   "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and its batch. ``batch`` is samples per data-parallel rank
    per optimizer step (split into the plan's micro-batches); give ``global_batch`` instead to
    fix the samples per step over all ranks whatever the plan's dp."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    batch: int | None = None
    global_batch: int | None = None
    ffn: int | None = None  # MLP inner size; default 4 * hidden
    kv_heads: int | None = None  # grouped-query attention; default heads
    positions: int = 0  # learned position embeddings (GPT-2: n_positions); 0 for rotary
    params: int | None = None  # a given count replaces the derived one
    model_type: str = "gpt"
    # eager | sdpa | flash: what attention keeps for backward. None: the textbook count
    # (Korthikanti et al.), which materializes the s x s scores; say "sdpa" for fused kernels
    attention: str | None = None
    activation: str = "gelu"
    dropout: float = 0.0
    tied_embeddings: bool = True
    # a mixture of experts: each block's MLP is ``experts`` MLPs of width ``ffn`` behind a
    # router sending each token to ``top_k`` of them (0: a dense block); the expert terms
    # (``expert_terms.py``) read them
    experts: int = 0
    top_k: int = 0

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> ModelSpec:
        """From a ModelSpec, a dict or an HF config; ``overrides`` win (e.g. seq=, batch=)."""
        if isinstance(config, ModelSpec):
            return replace(config, **overrides) if overrides else config
        values: dict[str, Any] = {}
        for field_name, names in _NAMES.items():
            for n in names:
                v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
                if v is not None:
                    values[field_name] = v
                    break
        if not isinstance(config, dict):  # an HF config: its family's layout and defaults
            if values.get("model_type") == "gpt2":
                values["positions"] = getattr(config, "n_positions", 0)
            values.setdefault("attention", "sdpa")  # what transformers picks when unset
            values.setdefault("seq", getattr(config, "n_positions", None)
                              or getattr(config, "max_position_embeddings", None))
        elif "positions" in config:
            values["positions"] = config["positions"]
        values.update(overrides)
        missing = [f for f in ("hidden", "layers", "heads", "vocab", "seq") if not values.get(f)]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}; pass them as keys "
                             "(hidden, layers, heads, vocab, seq) or keyword arguments")
        if values.get("batch") is None and values.get("global_batch") is None:
            raise ValueError("model config lacks the batch: give batch (samples per "
                             "data-parallel rank per step) or global_batch")
        ints = ("hidden", "layers", "heads", "vocab", "seq", "batch", "global_batch", "ffn",
                "kv_heads", "params", "positions", "experts", "top_k")
        for k in ints:
            if values.get(k) is not None:
                values[k] = int(values[k])
        if values.get("experts", 0) and not 0 < values.get("top_k", 0) <= values["experts"]:
            raise ValueError(f"a mixture of {values['experts']} experts needs top_k (experts "
                             "per token, num_experts_per_tok) between 1 and the experts")
        if "dropout" in values:
            values["dropout"] = float(values["dropout"])
        if values.get("attention") is not None:
            values["attention"] = str(values["attention"])
        return cls(**values)

    # ---- derived shape --------------------------------------------------------------------
    @property
    def gated(self) -> bool:
        """LLaMA-style SwiGLU MLP (three matrices), without biases, with RMSNorm."""
        return self.model_type in _GATED_FAMILIES

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one block's matrix products (each costs 2 FLOPs per token forward)."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_size + (3 if self.gated else 2) * h * self.ffn_size

    @property
    def layer_params(self) -> int:
        h, bias = self.hidden, not self.gated
        biases = (h + 2 * self.kv_size + h + self.ffn_size + h) if bias else 0
        norms = 2 * (h if self.gated else 2 * h)
        return self.layer_matmul_params + biases + norms

    @property
    def embedding_params(self) -> int:
        """Token (+ untied output) and position embeddings, and the final norm."""
        h = self.hidden
        head = 0 if self.tied_embeddings else self.vocab * h
        return self.vocab * h + head + self.positions * h + (h if self.gated else 2 * h)

    @property
    def expert_mlp_params(self) -> int:
        """One MLP of a block: under a mixture of experts, one expert's."""
        f, h = self.ffn_size, self.hidden
        return 3 * h * f if self.gated else 2 * h * f + f + h

    @property
    def moe_extra_params(self) -> int:
        """What a mixture-of-experts block holds beyond the dense layout above (which counts
        one MLP): the other experts and the router (hidden x experts); 0 for a dense block."""
        if not self.experts:
            return 0
        return (self.experts - 1) * self.expert_mlp_params + self.hidden * self.experts

    @property
    def param_count(self) -> int:
        return self.params or self.layers * (self.layer_params + self.moe_extra_params) \
            + self.embedding_params

    # ---- under 1D tensor parallelism (the runtime's policies: kernels_runtime/policies) ----
    @property
    def layer_split_params(self) -> int:
        """One block's parameters that 1D tensor parallelism splits: every product's weights
        and the column-parallel biases (QKV, MLP up). Norms and the row-parallel products'
        biases stay whole on every tp rank."""
        column_biases = 0 if self.gated else self.hidden + 2 * self.kv_size + self.ffn_size
        return self.layer_matmul_params + column_biases

    @property
    def vocab_params(self) -> int:
        """Token embedding and, when untied, the output head: split over the vocabulary."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def layer_replicated_tensors(self) -> int:
        """Parameter tensors of one block that tp leaves whole: the two norms' weights (and
        LayerNorm biases) and the row-parallel products' biases."""
        return 2 if self.gated else 6

    def layer_params_per_rank(self, tp: int = 1) -> float:
        return self.layer_split_params / tp + self.layer_params - self.layer_split_params

    def embedding_params_per_rank(self, tp: int = 1) -> float:
        """The vocabulary padded locally to a multiple of tp (as ``VocabParallelEmbedding``
        pads it), positions and the final norm whole."""
        rows = -(-self.vocab // tp)
        local_vocab = rows * self.hidden * (1 if self.tied_embeddings else 2)
        return local_vocab + self.embedding_params - self.vocab_params

    def params_per_rank(self, tp: int = 1) -> float:
        """Parameters one tensor-parallel rank holds, before ZeRO shards them. A given
        ``params`` count is scaled by the derived layout's local share."""
        local = self.layers * self.layer_params_per_rank(tp) + self.embedding_params_per_rank(tp)
        if self.params:
            return self.params * local / (self.layers * self.layer_params
                                          + self.embedding_params)
        return local

    def stage_params_per_rank(self, tp: int, layers: int, first: bool, last: bool) -> float:
        """Parameters of one pipeline rank holding ``layers`` blocks (1D tp shards): the first
        stage adds the token (vocabulary rows padded to tp) and position embeddings, the last
        the final norm and the output head, which under tied embeddings is a copy of the token
        embedding (the runtime keeps it on both stages and sums its gradient) unless one rank
        holds both. Scaled like ``params_per_rank`` when a ``params`` count is given."""
        token = -(-self.vocab // tp) * self.hidden
        local = layers * self.layer_params_per_rank(tp)
        if first:
            local += token + self.positions * self.hidden
        if last:
            local += self.final_norm_params + (token if not (self.tied_embeddings and first)
                                               else 0)
        if self.params:
            return self.params * local / (self.layers * self.layer_params
                                          + self.embedding_params)
        return local

    # ---- under 2D / 2.5D tensor parallelism (kernels_runtime/parallel/tensor/grid) ---------
    @property
    def layer_products(self) -> list[tuple[int, int]]:
        """(in, out) features of one block's products, each a SUMMA on the grid: GPT-2 fuses
        q, k, v into one (c_attn); LLaMA-family models have separate q, k, v, gate and up."""
        h, f, kv = self.hidden, self.ffn_size, self.kv_size
        if self.gated:
            return [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]
        return [(h, h + 2 * kv), (h, h), (h, f), (f, h)]

    @property
    def layer_vector_params(self) -> int:
        """One block's biases and norm weights: chunk j of q on each grid rank."""
        return self.layer_params - self.layer_matmul_params

    @property
    def final_norm_params(self) -> int:
        return self.hidden if self.gated else 2 * self.hidden

    def grid_layer_params_per_rank(self, q: int) -> float:
        """Block (i, j) of every product (1/q^2) and chunk j of every vector (1/q), the same
        on every depth of a 2.5D grid."""
        return self.layer_matmul_params / q**2 + self.layer_vector_params / q

    def grid_embedding_params_per_rank(self, q: int) -> float:
        """The vocabulary as the grid cuts it, E[vocabulary chunk j, hidden chunk i] padded to
        a multiple of q rows (an untied head alike); learned positions and the final norm keep
        hidden chunk j (``ChunkEmbedding``, ``LayerNorm2D``)."""
        rows = -(-self.vocab // q) * (1 if self.tied_embeddings else 2)
        return rows * self.hidden / q + (self.positions * self.hidden
                                         + self.final_norm_params) / q

    def grid_params_per_rank(self, q: int) -> float:
        """Parameters one rank of a q x q grid holds (before ZeRO over dp), scaled like
        ``params_per_rank`` when a ``params`` count is given."""
        local = self.layers * self.grid_layer_params_per_rank(q) \
            + self.grid_embedding_params_per_rank(q)
        if self.params:
            return self.params * local / (self.layers * self.layer_params
                                          + self.embedding_params)
        return local

    def local_batch(self, dp: int) -> int:
        """Samples per data-parallel rank per step under a plan with ``dp`` replicas."""
        if self.batch is not None:
            return self.batch
        assert self.global_batch is not None
        if self.global_batch % dp:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp={dp}")
        return self.global_batch // dp

    def plan_config(self) -> dict[str, int | None]:
        """The names ``Plan.validate`` checks a plan against."""
        return {"num_attention_heads": self.heads, "num_hidden_layers": self.layers,
                "hidden_size": self.hidden, "num_key_value_heads": self.kv_heads,
                "vocab_size": self.vocab, "num_local_experts": self.experts or None}

    def describe(self) -> str:
        batch = f"batch {self.batch}/rank" if self.batch is not None \
            else f"global batch {self.global_batch}"
        moe = f", {self.experts} experts (top-{self.top_k})" if self.experts else ""
        return (f"{self.model_type} {self.layers} layers, hidden {self.hidden}{moe}, "
                f"{self.heads} heads, vocab {self.vocab}, {self.param_count / 1e6:,.1f} M "
                f"parameters; seq {self.seq}, {batch}")
