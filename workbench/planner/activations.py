"""Activation memory: what one transformer layer keeps for backward, per implementation.

Korthikanti et al. 2022 (arXiv 2205.05198) count a GPT layer in 16-bit as
``s*b*h*(34 + 5*a*s/h)`` bytes: 16 values per token and hidden unit (4 stay whole under tensor
parallelism: the two LayerNorm inputs and the inputs of the QKV and first MLP products; 12
split by tp), 2 bytes of dropout masks, and per head the softmax output and its dropout
(2 values + 1 mask byte per ``a*s*s*b``). Real code keeps a different set: PyTorch's fused
attention (``sdpa``) keeps no ``s x s`` scores but q/k/v, its output and an fp32 log-sum-exp;
GPT-2's tanh GELU keeps four ``4h``-wide intermediates. So the counts are an
``ActivationProfile``, with the paper's as the default and profiles for what transformers'
GPT-2 keeps (measured with ``saved_tensors_hooks``, see ``bench/planner.py``).

Full recomputation (activation checkpointing) keeps each layer's input, ``2*s*b*h`` bytes in
16-bit, and during backward one layer's activations at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.planner.spec import ModelSpec

MASK_BYTES = 1  # dropout masks are bool tensors


@dataclass(frozen=True)
class ActivationProfile:
    """Per layer: values kept per ``s*b*h`` (whole under tp / split by tp), mask bytes per
    ``s*b*h``, values and mask bytes per ``a*s*s*b`` (attention scores), fp32 values per
    ``a*s*b`` (softmax statistics), and values per ``s*b*h`` kept under recomputation."""

    name: str
    replicated: float
    sharded: float
    masks: float
    scores: float
    score_masks: float
    stats: float = 0.0
    keep: float = 1.0


KORTHIKANTI = ActivationProfile("Korthikanti et al. 2022", replicated=4, sharded=12, masks=2,
                                scores=2, score_masks=1)

# What transformers' attention keeps, as values per s*b*h besides the output projection's input.
_ATTENTION_CORE = {"eager": 3.0, "sdpa": 5.0, "flash": 5.0}  # eager: q, k, v; sdpa: q, k, v,
# the (b, a, s, d) query it passes and its output
# Values per s*b*ffn kept by the MLP, including the down projection's input.
_MLP = {"gelu_new": 5.0, "gelu_fast": 5.0, "gelu": 2.0, "gelu_pytorch_tanh": 2.0, "relu": 2.0,
        "silu": 4.0}  # silu (gated): gate, up, silu(gate), product


def profile_for(spec: ModelSpec) -> ActivationProfile:
    """The paper's counts for a described model (``attention=None``); otherwise the counts of
    the named attention implementation, MLP activation and dropout."""
    if spec.attention is None:
        return KORTHIKANTI
    fused = spec.attention != "eager"
    core = _ATTENTION_CORE.get(spec.attention, 5.0)
    mlp = _MLP.get(spec.activation, 5.0) * spec.ffn_size / spec.hidden
    dropout = spec.dropout > 0
    return ActivationProfile(
        name=f"{spec.model_type} ({spec.attention} attention, {spec.activation})",
        replicated=4,
        sharded=core + 1 + mlp,
        masks=2 * MASK_BYTES if dropout else 0,
        scores=0 if fused else 1 + (1 if dropout else 0),
        score_masks=0 if fused or not dropout else MASK_BYTES,
        stats=1 if fused else 0,
    )


def layer_bytes(profile: ActivationProfile, s: int, b: int, h: int, a: int, elem: int = 2,
                tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps for backward with ``elem``-byte activations.

    With sequence parallelism the values tensor parallelism leaves whole are split too; that is
    the paper's ``(s*b*h/t)*(34 + 5*a*s/h)``.
    """
    whole = profile.replicated * elem + profile.masks
    per_token = (whole / tp if sequence_parallel else whole) + profile.sharded * elem / tp
    scores = a * s * s * b * (profile.scores * elem + profile.score_masks) / tp
    stats = a * s * b * profile.stats * 4 / tp
    return s * b * h * per_token + scores + stats


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, tp: int = 1,
                            sequence_parallel: bool = False) -> float:
    """The paper's closed forms, written out (16-bit activations)."""
    if sequence_parallel:
        return s * b * h / tp * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def head_bytes(spec: ModelSpec, b: int, elem: int) -> float:
    """Outside the layers: token ids, the final norm's and the output product's inputs, and the
    fp32 log-probabilities the cross-entropy keeps (transformers upcasts logits for the loss)."""
    s, h = spec.seq, spec.hidden
    return s * b * 8 + 2 * s * b * h * elem + s * b * spec.vocab * 4


def activation_bytes(spec: ModelSpec, micro_batch: int, elem: int, checkpointing: bool,
                     tp: int = 1, sequence_parallel: bool = False) -> dict[str, float]:
    """Peak bytes kept for backward by one micro-batch, split into ``layers`` (all of them, or
    under recomputation their inputs plus one layer recomputed in backward) and ``head``."""
    profile = profile_for(spec)
    one = layer_bytes(profile, spec.seq, micro_batch, spec.hidden, spec.heads, elem, tp,
                      sequence_parallel)
    if checkpointing:
        kept = profile.keep * spec.seq * micro_batch * spec.hidden * elem
        layers = spec.layers * kept + one
    else:
        layers = spec.layers * one
    return {"layers": layers, "head": head_bytes(spec, micro_batch, elem)}
