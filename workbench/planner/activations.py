"""Activation memory: what one transformer layer keeps for backward, per implementation.

Korthikanti et al. 2022 (arXiv 2205.05198) count a GPT layer in 16-bit as
``s*b*h*(34 + 5*a*s/h)`` bytes: 16 values per token and hidden unit (4 stay whole under tensor
parallelism: the two LayerNorm inputs and the inputs of the QKV and first MLP products; 12
split by tp), 2 bytes of dropout masks, and per head the softmax output and its dropout
(2 values + 1 mask byte per ``a*s*s*b``). Real code keeps a different set: PyTorch's fused
attention (``sdpa``) keeps no ``s x s`` scores but q/k/v, its output and an fp32 log-sum-exp;
GPT-2's tanh GELU keeps four ``4h``-wide intermediates. So the counts are an
``ActivationProfile``, with the paper's as the default and profiles for what transformers'
GPT-2 keeps (measured with ``saved_tensors_hooks``, see ``bench/planner/run.py``).

Full recomputation (activation checkpointing) keeps each layer's input, ``2*s*b*h`` bytes in
16-bit, and during backward one layer's activations at a time.

Parallelism divides these counts per rank (``layer_bytes``): 1D tensor parallelism splits the
``sharded`` values and the scores by t, Megatron sequence parallelism (sp_mode=split_gather)
also the ``replicated`` ones and the masks (this runtime keeps its column products'
all-gathered inputs whole: ``sp_whole``), and Ulysses / ring attention over the sp axis every
per-token term (each rank keeps its ``s/sp`` tokens). A 2D / 2.5D grid (``grid_activation_bytes``)
splits every term: a rank keeps (b/(d*q), s, h/q) of each tensor and a/q heads of its b/(d*q)
samples, 1/(d*q^2) = 1/tp of a layer (the table's 1/q^2 for 2D, 1/(d*q^2) for 2.5D).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    fp32_replicated: float = 0.0  # fp32 values per s*b*h kept whole by tp (RMSNorm upcasts)
    # the loss reads each tp rank's slice of the logits (Megatron's vocabulary-parallel
    # cross-entropy) rather than logits gathered whole (what an HF model's output gives)
    vocab_parallel_loss: bool = False
    # under split_gather: of ``replicated``, values kept whole anyway (this runtime's column
    # products save their all-gathered input; Megatron saves the shard and gathers it again in
    # backward), and whether the final norm and the head run on sequence shards (Megatron) or
    # on the sequence gathered after the last block (this runtime: HF outputs keep their shape)
    sp_whole: float = 0.0
    sp_head_split: bool = False


KORTHIKANTI = ActivationProfile("Korthikanti et al. 2022", replicated=4, sharded=12, masks=2,
                                scores=2, score_masks=1, vocab_parallel_loss=True,
                                sp_head_split=True)

# What transformers' attention keeps, as values per s*b*h besides the output projection's input.
_ATTENTION_CORE = {"eager": 3.0, "sdpa": 5.0, "flash": 5.0}  # eager: q, k, v; sdpa: q, k, v,
# the (b, a, s, d) query it passes and its output. LLaMA-family sdpa keeps q, its k and v
# (kv heads wide) and an output that is also the output projection's input (measured with
# saved-tensor hooks on 2 ranks, also under tp=2).
# Values per s*b*ffn kept by the MLP, including the down projection's input.
_MLP = {"gelu_new": 5.0, "gelu_fast": 5.0, "gelu": 2.0, "gelu_pytorch_tanh": 2.0, "relu": 2.0,
        "silu": 4.0}  # silu (gated): gate, up, silu(gate), product


def mlp_values(activation: str) -> float:
    """Values per token and MLP unit one MLP keeps for backward under ``activation``."""
    return _MLP.get(activation, 5.0)


def profile_for(spec: ModelSpec, sp_mode: str = "none") -> ActivationProfile:
    """The paper's counts for a described model (``attention=None``); otherwise the counts of
    the named attention implementation, MLP activation and dropout. On the sp axis the
    runtime's own attention replaces transformers': ring attention keeps q, k, v and its
    output, Ulysses also the output's all-to-all back (the output projection's input)."""
    if spec.attention is None:
        return KORTHIKANTI
    fused = spec.attention != "eager"
    core = _ATTENTION_CORE.get(spec.attention, 5.0)
    qkv = 1 + 2 * spec.kv_size / spec.hidden  # q, k, v
    if sp_mode in ("ring", "all_to_all"):
        fused, core = True, qkv + (1 if sp_mode == "all_to_all" else 0)
    elif spec.gated and fused:
        core = qkv
    mlp = mlp_values(spec.activation) * spec.ffn_size / spec.hidden
    dropout = spec.dropout > 0
    # whole under tp, per norm: LayerNorm its input and output (the next product's input);
    # RMSNorm (gated families) an fp32 input (upcast), the normalized values and the output
    return ActivationProfile(
        name=f"{spec.model_type} ({spec.attention} attention, {spec.activation})",
        replicated=4,
        fp32_replicated=2 if spec.gated else 0,
        sharded=core + 1 + mlp,
        masks=2 * MASK_BYTES if dropout else 0,
        scores=0 if fused else 1 + (1 if dropout else 0),
        score_masks=0 if fused or not dropout else MASK_BYTES,
        stats=1 if fused else 0,
        sp_whole=2,  # the QKV and MLP-up products' gathered inputs
    )


def layer_bytes(profile: ActivationProfile, s: int, b: int, h: int, a: int, elem: int = 2,
                tp: int = 1, sequence_parallel: bool = False, sp: int = 1) -> float:
    """Bytes one layer keeps for backward on one rank, with ``elem``-byte activations.

    ``tp`` divides what tensor parallelism splits (``sharded``, per-head scores and statistics);
    with Megatron sequence parallelism (``sequence_parallel``, inside the tp group) the values
    tp leaves whole are split too: the paper's ``(s*b*h/t)*(34 + 5*a*s/h)``. ``sp`` (Ulysses or
    ring attention over the sp axis) divides every term: a rank keeps its ``s/sp`` tokens, and
    attention keeps ``s/sp`` rows of scores per head (ring) or ``a/sp`` whole heads (Ulysses).
    """
    whole = profile.replicated * elem + profile.fp32_replicated * 4 + profile.masks
    if sequence_parallel:
        kept = profile.sp_whole * elem
        whole = kept + (whole - kept) / tp
    per_token = whole + profile.sharded * elem / tp
    scores = a * s * s * b * (profile.scores * elem + profile.score_masks) / tp
    stats = a * s * b * profile.stats * 4 / tp
    return (s * b * h * per_token + scores + stats) / sp


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, tp: int = 1,
                            sequence_parallel: bool = False) -> float:
    """The paper's closed forms, written out (16-bit activations)."""
    if sequence_parallel:
        return s * b * h / tp * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def head_bytes(spec: ModelSpec, b: int, elem: int, tp: int = 1, sp: int = 1,
               sp_mode: str = "none", profile: ActivationProfile | None = None) -> float:
    """Outside the layers: token ids, the final norm's and the output product's inputs, and the
    fp32 log-probabilities the cross-entropy keeps (transformers upcasts logits for the loss):
    split over the vocabulary by a vocabulary-parallel loss, whole when the logits are
    gathered first. Megatron's head (the paper's profile) runs on sequence shards; this
    runtime joins the sequence before it: after the last block under split_gather, after the
    final norm on the sp axis, so the product's input and the logits are whole."""
    profile = profile or profile_for(spec, sp_mode)
    s, h = spec.seq, spec.hidden
    per_norm = (profile.replicated * elem + profile.fp32_replicated * 4) / 2  # as in a layer
    norm, output = per_norm - elem, elem  # the norm's own values, its output (product input)
    split_gather = sp_mode == "split_gather"
    if profile.sp_head_split:
        shards = (tp if split_gather else 1) * sp
        inputs = (norm + output) / shards
        logits = spec.vocab * 4 / tp / sp
    else:
        inputs = norm / sp + output
        logits = spec.vocab * 4.0 / (tp if profile.vocab_parallel_loss else 1)
    return s * b * (8 / sp + h * inputs + logits)


def activation_bytes(spec: ModelSpec, micro_batch: int, elem: int, checkpointing: bool,
                     tp: int = 1, sp: int = 1, sp_mode: str = "none",
                     grid: tuple[int, int] | None = None,
                     layers: int | None = None) -> dict[str, float]:
    """Peak bytes kept for backward by one micro-batch on one rank, split into ``layers`` (all
    of them, or under recomputation their inputs plus one layer recomputed in backward) and
    ``head``. A layer's input is whole on every tp rank unless sequence parallelism
    (``sp_mode=split_gather``) splits it (the paper's ``2*s*b*h/t`` per layer), and split over
    ``sp`` by the sp-axis modes. ``grid`` = (q, d): a 2D / 2.5D plan (``tp`` = d*q*q).
    ``layers``: the blocks counted (a pipeline stage's), default all of the model's."""
    n = spec.layers if layers is None else layers
    if grid is not None:
        return grid_activation_bytes(spec, micro_batch, elem, checkpointing, *grid, layers=n)
    profile = profile_for(spec, sp_mode)
    split_gather = sp_mode == "split_gather"
    one = layer_bytes(profile, spec.seq, micro_batch, spec.hidden, spec.heads, elem, tp,
                      split_gather, sp)
    if checkpointing:
        split = (tp if split_gather else 1) * sp
        kept = profile.keep * spec.seq * micro_batch * spec.hidden * elem / split
        kept_layers = n * kept + one
    else:
        kept_layers = n * one
    head = head_bytes(spec, micro_batch, elem, tp, sp, sp_mode, profile)
    return {"layers": kept_layers, "head": head}


def grid_activation_bytes(spec: ModelSpec, micro_batch: int, elem: int, checkpointing: bool,
                          q: int, d: int, layers: int | None = None) -> dict[str, float]:
    """A 2D (d = 1) / 2.5D grid rank: every tensor of a layer as its (b/(d*q), s, h/q) block,
    so each term of the unsplit layer divides by tp = d*q*q; recomputation keeps the layer
    input's block, 2*s*b*h/tp. The grid's norms (``LayerNorm2D``, ``RMSNorm2D``) save their
    input and statistics but no fp32 copy (LLaMA's RMSNorm upcast is not kept). Head: token ids
    per row block (/(d*q)), the final norm and the head's input as blocks (/tp), and the fp32
    log-probabilities either of this rank's vocabulary chunk (the grid's vocabulary-parallel
    loss, /tp) or of the whole micro-batch (an HF output: the runtime gathers the logits from
    every row, column and depth before the model's own loss, as 1D gathers them whole)."""
    profile = replace(profile_for(spec), fp32_replicated=0.0)
    n = spec.layers if layers is None else layers
    tp = d * q * q
    s, b, h = spec.seq, micro_batch, spec.hidden
    one = layer_bytes(profile, s, b, h, spec.heads, elem) / tp
    kept = profile.keep * s * b * h * elem / tp  # a layer's input under recomputation
    kept_layers = n * kept + one if checkpointing else n * one
    per_norm = profile.replicated * elem / 2  # a layer's two norms, as in layer_bytes
    logits = spec.vocab * 4.0 / (tp if profile.vocab_parallel_loss else 1)
    head = s * b * (8 / (d * q) + h * per_norm / tp + logits)
    return {"layers": kept_layers, "head": head}
