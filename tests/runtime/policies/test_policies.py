"""Model policies and activation checkpointing.

Protects two promises: every supported model family (HF GPT-2, LLaMA, BERT, ViT and any model built
from ``nn.Linear`` blocks) gets the right policy, its blocks in order and its shape facts under the
names ``Plan.validate`` reads; and checkpointing those blocks changes memory, never numbers — the
loss and every gradient are bitwise the same while fewer bytes are saved for backward.
HF models are built from tiny configs with random weights (no hub access).
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from kernels_runtime import policies
from kernels_runtime.mesh.plan import Plan, PlanError
from kernels_runtime.parallel import activation_checkpoint as ac
from kernels_runtime.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    is_checkpointed,
    remove_activation_checkpointing,
)
from kernels_runtime.policies import (
    GenericPolicy,
    HFPolicy,
    available_policies,
    get_policy,
    register_policy,
)

transformers = pytest.importorskip("transformers")

NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
NO_DROPOUT_BERT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def gpt2_config():
    # bos/eos default to 50256, outside the tiny vocabulary; transformers 5 warns about it.
    return transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=64,
        bos_token_id=0, eos_token_id=0, **NO_DROPOUT_GPT2,
    )  # fmt: skip


def llama_config():
    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip


def bert_config():
    return transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=256, max_position_embeddings=64, **NO_DROPOUT_BERT,
    )  # fmt: skip


def vit_config():
    return transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=8, **NO_DROPOUT_BERT,
    )  # fmt: skip


def build(cls_name: str, config_fn: Callable) -> nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config_fn()).eval()


# (model class, config, policy name, where its blocks are, expected model_config)
HF_CASES = [
    ("GPT2Model", gpt2_config, "gpt2", lambda m: m.h, (4, 2, 32, None, 256)),
    ("GPT2LMHeadModel", gpt2_config, "gpt2", lambda m: m.transformer.h, (4, 2, 32, None, 256)),
    ("LlamaModel", llama_config, "llama", lambda m: m.layers, (4, 2, 32, 2, 256)),
    ("LlamaForCausalLM", llama_config, "llama", lambda m: m.model.layers, (4, 2, 32, 2, 256)),
    ("BertModel", bert_config, "bert", lambda m: m.encoder.layer, (4, 2, 32, None, 256)),
    (
        "BertForSequenceClassification",
        bert_config,
        "bert",
        lambda m: m.bert.encoder.layer,
        (4, 2, 32, None, 256),
    ),
    # transformers 5 keeps ViT blocks at ``layers``; 4.x had ``encoder.layer``.
    ("ViTModel", vit_config, "vit", lambda m: m.base_model.layers, (4, 2, 32, None, None)),
    (
        "ViTForImageClassification",
        vit_config,
        "vit",
        lambda m: m.vit.layers,
        (4, 2, 32, None, None),
    ),
]


@pytest.mark.parametrize(
    "cls_name, config_fn, name, where, expected", HF_CASES, ids=[c[0] for c in HF_CASES]
)
def test_hf_policy_blocks_and_config(cls_name, config_fn, name, where, expected):
    model = build(cls_name, config_fn)
    policy = get_policy(model)
    assert isinstance(policy, HFPolicy) and policy.name == name
    blocks = policy.blocks(model)
    assert len(blocks) == 2 and all(a is b for a, b in zip(blocks, where(model), strict=True))
    assert policy.model_config(model) == dict(zip(policies.CONFIG_KEYS, expected))
    assert policy.describe().startswith(f"{name}: ")


def test_model_config_feeds_plan_validate():
    """The keys are the ones ``Plan.validate`` reads: LLaMA's 4 query heads rule out tp=8 and
    its 2 key/value heads allow tp=2 (split) and tp=4 (replicated); with 12 query heads and 4
    key/value heads tp=6 is refused (neither dividing them nor a multiple of them)."""
    model = build("LlamaForCausalLM", llama_config)
    config = get_policy(model).model_config(model)
    assert Plan.parse("tp=2").validate(2, config).tp == 2
    assert Plan.parse("tp=4").validate(4, config).tp == 4
    with pytest.raises(PlanError, match=r"4 attention heads \(2 key/value heads\); tp values "
                                        "that work: 1, 2, 4$"):
        Plan.parse("tp=8").validate(8, config)
    odd = dict(config, num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(PlanError, match="neither divides the model's 4 key/value heads.*"
                                        "work: 1, 2 on this pool of 6 ranks; 4, 12 on a pool"):
        Plan.parse("tp=6").validate(6, odd)
    with pytest.raises(PlanError, match="needs at least 4 blocks but the model has 2"):
        Plan.parse("pp=4 mb=4").validate(4, config)


class MLPBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class MLPStack(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(n_blocks))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Nested(nn.Module):
    """Two layers, each holding a list of four identical experts: the layers are the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(*(MLPBlock() for _ in range(4))) for _ in range(2)
        )


def test_generic_policy_finds_the_mlp_blocks():
    model = MLPStack()
    policy = get_policy(model)
    assert isinstance(policy, GenericPolicy)
    assert policy.blocks(model) == list(model.blocks)
    config = policy.model_config(model)
    assert config["hidden_size"] == 16  # in_features of 3 fc1s and the head
    assert config["num_hidden_layers"] == 3
    assert config["num_attention_heads"] is None and config["vocab_size"] is None


def test_generic_policy_prefers_outermost_lists_and_needs_repeated_blocks():
    nested = Nested()
    assert GenericPolicy().blocks(nested) == list(nested.layers)
    no_repeats = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert get_policy(no_repeats).blocks(no_repeats) == []
    bare_linears = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert get_policy(bare_linears).blocks(bare_linears) == []
    assert get_policy(no_repeats).model_config(no_repeats)["num_hidden_layers"] is None


def test_registry_order_override_and_replacement(monkeypatch):
    monkeypatch.setattr(policies, "_policies", list(policies._policies))
    names = [p.name for p in available_policies()]
    assert names[-1] == "generic" and {"gpt2", "llama", "bert", "vit"} <= set(names)

    mine = HFPolicy(name="my-gpt2", model_types=("gpt2",), block_paths=("h",))
    register_policy(mine)
    assert get_policy(build("GPT2Model", gpt2_config)) is mine
    late = HFPolicy(name="late", summary="v1")
    register_policy(late, first=False)
    register_policy(HFPolicy(name="late", summary="v2"), first=False)
    names = [p.name for p in available_policies()]
    assert names[0] == "my-gpt2" and names[-2:] == ["late", "generic"]
    assert names.count("late") == 1 and available_policies()[-2].summary == "v2"
    with pytest.raises(ValueError, match="reserved"):
        register_policy(GenericPolicy())


def test_policies_import_neither_transformers_nor_ipython():
    code = (
        "import sys, kernels_runtime.policies, kernels_runtime.parallel.activation_checkpoint\n"
        "bad = {'transformers', 'IPython'} & set(sys.modules)\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- activation checkpointing ----


def saved_bytes_in_blocks(model: nn.Module, blocks: list[nn.Module], run: Callable) -> int:
    """Bytes of tensors saved for backward while any block's forward is running."""
    depth = [0]
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if depth[0]:
            total[0] += t.numel() * t.element_size()
        return t

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter),
                                          b.register_forward_hook(leave))]  # fmt: skip
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(model)
    finally:
        for h in handles:
            h.remove()
    return total[0]


def loss_and_grads(model: nn.Module, run: Callable) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = run(model)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def lm_loss(use_cache: bool | None = False) -> Callable:
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 16))
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    return lambda m: m(input_ids=ids, labels=ids, **kwargs).loss


def mlp_loss() -> Callable:
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    return lambda m: m(x).square().mean()


CKPT_CASES = [
    ("GPT2LMHeadModel", lambda: build("GPT2LMHeadModel", gpt2_config), lm_loss),
    ("LlamaForCausalLM", lambda: build("LlamaForCausalLM", llama_config), lm_loss),
    ("MLPStack", lambda: MLPStack().eval(), mlp_loss),
]


@pytest.mark.parametrize("name, make, loss_fn", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_checkpointing_keeps_numbers_and_saves_memory(name, make, loss_fn, monkeypatch):
    model, run = make(), loss_fn()
    blocks = get_policy(model).blocks(model)
    keys = list(model.state_dict())
    base_loss, base_grads = loss_and_grads(model, run)
    base_bytes = saved_bytes_in_blocks(model, blocks, run)

    assert apply_activation_checkpointing(blocks) == len(blocks) > 0
    assert all(is_checkpointed(b) for b in blocks) and list(model.state_dict()) == keys
    loss, grads = loss_and_grads(model, run)
    assert torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    assert all(torch.equal(grads[k], base_grads[k]) for k in grads)
    ckpt_bytes = saved_bytes_in_blocks(model, blocks, run)
    assert base_bytes > 0 and ckpt_bytes < base_bytes / 4, (base_bytes, ckpt_bytes)

    # Idempotent: a second call wraps nothing, and a forward checkpoints each block once.
    assert apply_activation_checkpointing(blocks) == 0
    calls = []
    real = ac.checkpoint
    monkeypatch.setattr(ac, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    run(model)
    assert len(calls) == len(blocks)

    assert remove_activation_checkpointing(blocks) == len(blocks)
    assert remove_activation_checkpointing(blocks) == 0
    for b in blocks:
        assert "forward" not in b.__dict__ and b.forward.__func__ is type(b).forward
    assert saved_bytes_in_blocks(model, blocks, run) == base_bytes


def test_checkpointing_drops_the_kv_cache_instead_of_writing_it_twice():
    """GPT-2 defaults to use_cache=True and hands its blocks a DynamicCache even in training.

    Replaying a block in backward with that cache would append its keys and values a second time
    (16 cached positions become 32), so checkpointed blocks get no cache, as in transformers' own
    gradient checkpointing.
    """
    model = build("GPT2LMHeadModel", gpt2_config)
    run = lm_loss(use_cache=None)
    base_loss, base_grads = loss_and_grads(model, run)
    apply_activation_checkpointing(get_policy(model).blocks(model))
    ids = torch.randint(0, 256, (2, 16))
    with pytest.warns(UserWarning, match="drops the KV cache"):
        out = model(input_ids=ids, labels=ids)
        cached = out.cache.get_seq_length()
        out.loss.backward()
        loss, grads = loss_and_grads(model, run)
    assert out.cache.get_seq_length() == cached  # backward wrote nothing into the cache
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[k], base_grads[k]) for k in base_grads)


def test_checkpointing_is_off_without_grad_and_survives_copies():
    model = MLPStack().eval()
    x = torch.randn(4, 8)
    apply_activation_checkpointing(model.blocks)
    with torch.no_grad():
        expected = model(x)

    clone = copy.deepcopy(model)
    assert all(is_checkpointed(b) for b in clone.blocks)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
        assert torch.equal(model(x), expected)  # the copy's forward runs the copy's weights
        assert torch.equal(clone(x), torch.zeros(4, 4))

    restored = pickle.loads(pickle.dumps(model))
    assert all(is_checkpointed(b) for b in restored.blocks)
    with torch.no_grad():
        assert torch.equal(restored(x), expected)


def test_remove_restores_an_instance_level_forward():
    block = MLPBlock()

    def custom(x: torch.Tensor) -> torch.Tensor:
        return x

    block.forward = custom
    apply_activation_checkpointing([block])
    x = torch.randn(2, 16, requires_grad=True)
    assert torch.equal(block(x), x)
    remove_activation_checkpointing([block])
    assert block.__dict__["forward"] is custom
