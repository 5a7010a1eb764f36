"""Policies as data: every parameter of every supported model has exactly one plan entry.

What is protected: for HF GPT-2 (bare, LM, sequence classification), LLaMA (with grouped
key/value heads), Mistral, Qwen2, Qwen3, BERT (bare, masked LM, classification), ViT and a plain
PyTorch model read by the generic policy, the policy's layout names every parameter exactly
once (none uncovered, none claimed twice, no required module missing); the facts tensor and
pipeline parallelism will read are right (GPT-2's fused, transposed QKV; row-parallel output
projections; vocabulary-parallel embeddings and tied heads; attention head counts; positions);
and the pipeline glue plus the blocks hold every parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels_runtime.policies import GenericPolicy, find_module, get_policy

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
CAUSAL = dict(**SMALL, vocab_size=96, num_key_value_heads=2, max_position_embeddings=32)


def _gpt2(cls: str = "GPT2LMHeadModel") -> nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return getattr(transformers, cls)(config)


MODELS = {
    "gpt2": lambda: _gpt2(),
    "gpt2-bare": lambda: _gpt2("GPT2Model"),
    "gpt2-classifier": lambda: _gpt2("GPT2ForSequenceClassification"),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**CAUSAL)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**CAUSAL)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CAUSAL)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CAUSAL)),
    "bert-mlm": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        **SMALL, vocab_size=96)),
    "bert-bare": lambda: transformers.BertModel(transformers.BertConfig(**SMALL, vocab_size=96)),
    "bert-classifier": lambda: transformers.BertForSequenceClassification(
        transformers.BertConfig(**SMALL, vocab_size=96)),
    "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        **SMALL, image_size=16, patch_size=8, num_labels=3)),
}
POLICY = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama",
          "qwen3": "llama", "bert": "bert", "vit": "vit"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_parameter_is_named_exactly_once(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    policy = get_policy(model)
    assert policy.name == POLICY[name.split("-")[0]]
    resolved = policy.resolve(model)
    assert resolved.complete, resolved.problems()
    assert set(resolved.specs) == {n for n, _ in model.named_parameters()}


def _specs(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    return model, get_policy(model).resolve(model)


def test_gpt2_plan_fused_transposed_qkv_and_tied_head():
    model, resolved = _specs("gpt2")
    qkv = resolved.specs["transformer.h.0.attn.c_attn.weight"]
    assert (qkv.style, qkv.transposed, qkv.fused, qkv.block) == ("column", True,
                                                                 ("q", "k", "v"), 0)
    assert resolved.specs["transformer.h.1.attn.c_proj.weight"].style == "row"
    assert resolved.specs["transformer.h.1.mlp.c_proj.bias"].style == "row"
    assert resolved.specs["transformer.wte.weight"].style == "vocab"
    assert resolved.specs["transformer.wpe.weight"].style == "replicated"
    assert resolved.tied == [("lm_head.weight", "transformer.wte.weight")]
    layout = get_policy(model).model_layout(model)
    assert layout.positions.kind == "learned"
    assert get_policy(model).attention_heads(model) == (4, 4)


def test_llama_plan_grouped_heads_rope_and_untied_head():
    model, resolved = _specs("llama")
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert resolved.specs[f"model.layers.0.self_attn.{proj}.weight"].style == "column"
    assert resolved.specs["model.layers.0.self_attn.o_proj.weight"].style == "row"
    assert resolved.specs["model.layers.0.mlp.down_proj.weight"].style == "row"
    assert resolved.specs["lm_head.weight"].style == "vocab" and resolved.tied == []
    assert get_policy(model).attention_heads(model) == (4, 2)
    assert get_policy(model).model_layout(model).positions.kind == "rope"


def test_bert_plan_ties_decoder_and_bias_to_the_vocabulary():
    model, resolved = _specs("bert-mlm")
    assert sorted(resolved.tied) == [
        ("cls.predictions.decoder.bias", "cls.predictions.bias"),
        ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")]
    assert resolved.specs["cls.predictions.bias"].style == "vocab"
    layout = get_policy(model).model_layout(model)
    assert layout.attention.causal is False


@pytest.mark.parametrize("name", sorted(MODELS))
def test_pipeline_glue_and_blocks_hold_every_parameter(name):
    model = MODELS[name]()
    layout = get_policy(model).model_layout(model)
    held = set()
    for paths in (*layout.pipeline.before, *layout.pipeline.after, layout.blocks):
        found = find_module(model, paths)
        if found is not None:
            held |= {id(p) for p in found[1].parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in held]
    assert not missing, f"outside the glue and the blocks: {missing}"


class Block(nn.Module):
    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        y = self.norm(x)
        att = torch.softmax(self.q(y) @ self.k(y).transpose(-1, -2), -1) @ self.v(y)
        x = x + self.o(att)
        return x + self.down(torch.relu(self.up(x)))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_generic_policy_pairs_attention_and_mlp_linears():
    model = Plain()
    policy = get_policy(model)
    assert isinstance(policy, GenericPolicy)
    resolved = policy.resolve(model)
    assert resolved.complete, resolved.problems()
    styles = {n.split(".", 2)[2]: s.style for n, s in resolved.specs.items()
              if n.startswith("blocks.0.")}
    assert styles == {"q.weight": "column", "q.bias": "column", "k.weight": "column",
                      "k.bias": "column", "v.weight": "column", "v.bias": "column",
                      "o.weight": "row", "o.bias": "row", "up.weight": "column",
                      "up.bias": "column", "down.weight": "row", "down.bias": "row",
                      "norm.weight": "replicated", "norm.bias": "replicated"}
    assert resolved.specs["embed.weight"].style == "replicated"
    assert "unreadable" not in policy.model_layout(model).extra


def test_generic_policy_says_when_it_cannot_read_a_block():
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
    layout = get_policy(model).model_layout(model)
    assert "row-parallel" in layout.extra["unreadable"]
    assert get_policy(model).resolve(model).complete  # still one entry per parameter
