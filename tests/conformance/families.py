"""The model families the conformance matrix runs: published shapes at reduced depth, and the
batches each is trained on.

Each family keeps what its real checkpoints carry and toy configs usually do not: the published
head counts (so divisibility is real: Qwen2's 14 heads, SmolLM2's 9 over 3), key/value heads
fewer than query heads, tied or untied embeddings, biases on some projections and not others,
an explicit head size unequal to hidden/heads (Qwen3), rope scaling (LLaMA 3.2), a
``padding_idx`` (BERT's pad token 0; the pad id that is also the eos in Qwen and SmolLM2, whose
row must not learn although end-of-turn tokens inside a row are attended and labelled), and
padded batches with their attention masks. Hidden
sizes shrink by using a head size of 4 to 8; depth is two blocks. SmolLM2 is the real
checkpoint, cut to its first two blocks (``smollm2_folder``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SEQ, ROWS = 16, 4  # tokens per row (sp=4 zig-zag needs 8 | SEQ); rows of the global batch
LENGTHS = (16, 11, 7, 13)  # real tokens per row: the rest is padding (right-padded)
MASK_ID = 3  # the masked LM's [MASK] (any id but the pad)
EOS = 2  # the causal families' end of turn; SmolLM2's real pad and eos (<|im_end|>) is 2 too
TURN_END = 5  # where a row's first turn ends: an eos inside the row, as in packed chat data
IMAGE, PATCH = 12, 4  # 3 x 3 patches and the class token: 10 tokens


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], nn.Module]  # fixed weights on every call
    kind: str  # "causal" (ids, mask, labels), "masked" (ids with [MASK], mask, labels where
    # masked), "classify" (ids, mask, a label per row), "image" (pixels, a label per row)
    vocab: int
    heads: tuple[int, int]  # (query heads, key/value heads)
    pad_id: int = 0
    lr: float = 0.05  # SGD's: the real weights take a smaller one (the losses stay smooth)


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().eval()  # eval: dropout off, whatever the config says
    return build


def _gpt2() -> nn.Module:  # GPT-2 small: 12 heads, biases everywhere, tied head
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=1001, n_positions=64, n_embd=48, n_layer=2,
                                      n_head=12, bos_token_id=0, eos_token_id=0))


def _llama() -> nn.Module:  # Llama-3.2-1B: 32 heads over 8, tied, llama3 rope scaling
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_parameters=rope))


def _mistral() -> nn.Module:  # Mistral-7B: 32 heads over 8, untied head
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=224, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False))


def _qwen2() -> nn.Module:  # Qwen2-0.5B: 14 heads over 2, q/k/v biases, tied, pad = eos
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=1000, hidden_size=56, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
        pad_token_id=EOS))


def _qwen3() -> nn.Module:  # Qwen3-0.6B: 16 heads over 8, head size != hidden/heads, q/k norms,
    # pad = eos
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=1000, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=4, tie_word_embeddings=True,
        pad_token_id=EOS))


def _bert() -> nn.Module:  # bert-base: 12 heads, pad token 0 is the embedding's padding_idx
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=1001, hidden_size=48, num_hidden_layers=2, num_attention_heads=12,
        intermediate_size=96, num_labels=3, pad_token_id=0))


def _bert_mlm() -> nn.Module:  # bert-base's masked LM: decoder tied to the word embedding
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(
        vocab_size=1001, hidden_size=48, num_hidden_layers=2, num_attention_heads=12,
        intermediate_size=96, pad_token_id=0))


def _vit() -> nn.Module:  # ViT-base: 12 heads, (image/patch)^2 + 1 tokens (never 4k)
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=12, intermediate_size=96,
        image_size=IMAGE, patch_size=PATCH, num_labels=3))


_SMOLLM2: list[Path] = []  # the cut checkpoint's folder, set by the session fixture


def smollm2_folder(folder: Path | None = None) -> Path:
    """Set (the test session does, once) or get the folder of SmolLM2 cut to two blocks."""
    if folder is not None:
        _SMOLLM2[:] = [folder]
    if not _SMOLLM2:
        raise RuntimeError("the SmolLM2 conformance checkpoint was not prepared")
    return _SMOLLM2[0]


@contextlib.contextmanager
def using_smollm2(folder: Path | str) -> Iterator[None]:
    """SmolLM2's family built from ``folder`` in this process for the block's duration (a
    deeper cut than the session's), then whatever was set before."""
    before = list(_SMOLLM2)
    _SMOLLM2[:] = [Path(folder)]
    try:
        yield
    finally:
        _SMOLLM2[:] = before


def cut_smollm2(full: Path, out: Path, blocks: int = 2) -> Path:
    """The real SmolLM2 with its first ``blocks`` blocks (real embedding, norm and blocks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(full)
    model.model.layers = model.model.layers[:blocks]
    model.config.num_hidden_layers = blocks
    model.config.layer_types = model.config.layer_types[:blocks] \
        if getattr(model.config, "layer_types", None) else None
    model.save_pretrained(out)
    return out


_LOADED: dict[Path, nn.Module] = {}  # per process: rank pools outlive a test


def _smollm2() -> nn.Module:  # the real weights: 9 heads over 3, tied, 49152 tokens
    import copy

    from transformers import AutoModelForCausalLM

    folder = smollm2_folder()
    if folder not in _LOADED:
        _LOADED[folder] = AutoModelForCausalLM.from_pretrained(folder)
    return copy.deepcopy(_LOADED[folder])


FAMILIES = {f.name: f for f in [
    Family("gpt2", _seeded(_gpt2), "causal", 1001, (12, 12)),
    Family("llama", _seeded(_llama), "causal", 1000, (32, 8)),
    Family("smollm2", _seeded(_smollm2), "causal", 49152, (9, 3), pad_id=EOS, lr=0.002),
    Family("mistral", _seeded(_mistral), "causal", 1000, (32, 8)),
    Family("qwen2", _seeded(_qwen2), "causal", 1000, (14, 2), pad_id=EOS),
    Family("qwen3", _seeded(_qwen3), "causal", 1000, (16, 8), pad_id=EOS),
    Family("bert", _seeded(_bert), "classify", 1001, (12, 12)),
    Family("bert-mlm", _seeded(_bert_mlm), "masked", 1001, (12, 12)),
    Family("vit", _seeded(_vit), "image", 0, (12, 12)),
]}


def global_batch(family: Family, step: int) -> dict[str, torch.Tensor]:
    """The step's whole batch: ROWS padded rows (ids, attention mask, labels) or images."""
    g = torch.Generator().manual_seed(100 + step)
    if family.kind == "image":
        return {"pixel_values": torch.randn(ROWS, 3, IMAGE, IMAGE, generator=g),
                "labels": torch.randint(0, 3, (ROWS,), generator=g)}
    ids = torch.randint(1, family.vocab, (ROWS, SEQ), generator=g)  # (b, s), never the pad id
    mask = (torch.arange(SEQ) < torch.tensor(LENGTHS)[:, None]).long()  # (b, s)
    ids = ids.masked_fill(mask == 0, family.pad_id)
    if family.kind == "classify":
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.randint(0, 3, (ROWS,), generator=g)}
    if family.kind == "masked":  # every third real token masked and predicted
        hidden = (torch.arange(SEQ) % 3 == 1) & (mask == 1)
        return {"input_ids": ids.masked_fill(hidden, MASK_ID), "attention_mask": mask,
                "labels": ids.masked_fill(~hidden, -100)}
    # an end of turn inside every row, attended and labelled like any token: where the pad id
    # is the eos (Qwen, SmolLM2) the embedding's padding_idx row must still not learn from it
    ids[:, TURN_END] = EOS
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def pieces_of(family: Family, step: int, dp: int, microbatches: int) -> list[list[dict]]:
    """The batch as each data-parallel rank trains it: contiguous rows per rank, then its
    micro-batches (``pieces[dp_rank][m]``)."""
    batch = global_batch(family, step)
    per_rank = ROWS // dp
    per_mb = per_rank // microbatches
    return [[{k: v[r * per_rank + m * per_mb:r * per_rank + (m + 1) * per_mb]
              for k, v in batch.items()} for m in range(microbatches)] for r in range(dp)]
