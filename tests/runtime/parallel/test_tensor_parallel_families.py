"""1D tensor parallelism on BERT, ViT, a plain model and LLaMA-policy families, against the
unsplit model.

What is protected: under tp=2 on 2 real ranks, HF BERT (with a padding mask; a classifier, and
the masked LM whose tied decoder splits an odd vocabulary of 61), HF ViT and a plain multi-head
transformer read by the generic policy, and the LLaMA policy's other families (Qwen2 with q/k/v
biases, Qwen3 with per-head q/k norms, Mistral) give the unsplit model's outputs and, assembled
through the layouts, every parameter's gradient (1e-5 relative L2 per parameter, 1e-8 absolute
where the reference gradient is below 1e-6); BERT, ViT and the plain model trained through
``parallelize`` give the unsplit losses over ten SGD steps (1e-5); a LLaMA saved with
``save_pretrained`` and loaded with ``from_pretrained`` gives the unsplit logits under tp=2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.distributed import context

HEAD_DIM = 8


class Block(nn.Module):
    """Multi-head self-attention and an MLP written in plain PyTorch (heads from -1)."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        # no key bias: it cannot change attention (softmax is shift-invariant), so its gradient
        # is pure rounding noise
        self.q, self.k = nn.Linear(h, h), nn.Linear(h, h, bias=False)
        self.v, self.o = nn.Linear(h, h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, _ = x.shape  # (b, s, h)
        y = self.norm(x)
        q, k, v = (m(y).view(b, s, -1, HEAD_DIM).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(torch.relu(self.up(x)))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 40)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(kind: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)
    if kind == "bert":
        return transformers.BertForSequenceClassification(
            transformers.BertConfig(**small, vocab_size=60, num_labels=3))
    if kind == "bert-mlm":  # decoder tied to the word embedding, its bias to the head's
        return transformers.BertForMaskedLM(transformers.BertConfig(**small, vocab_size=61))
    if kind == "vit":
        return transformers.ViTForImageClassification(
            transformers.ViTConfig(**small, image_size=16, patch_size=8, num_labels=3))
    causal = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=40)
    if kind == "qwen2":  # biases on q, k, v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**causal))
    if kind == "qwen3":  # per-head q and k norms: each rank's gradient covers its heads
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**causal, head_dim=8))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**causal))
    return Plain()


def _output(kind: str, model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind.startswith("bert"):
        ids = torch.randint(0, 60, (2, 7), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 5:] = 0  # padding
        return model(input_ids=ids, attention_mask=mask).logits
    if kind == "vit":
        return model(pixel_values=torch.randn(2, 3, 16, 16, generator=g)).logits
    if kind in ("qwen2", "qwen3", "mistral"):
        return model(input_ids=torch.randint(0, 40, (2, 6), generator=g)).logits
    return model(torch.randint(0, 40, (2, 6), generator=g))


def _loss(out: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return (out * weights).sum()


def _reference(kind: str) -> tuple[torch.Tensor, dict]:
    model = _build(kind)
    out = _output(kind, model)
    _loss(out).backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _split(rank: int, world: int, kind: str) -> dict:
    from kernels_runtime import parallelize_model

    model = parallelize_model(_build(kind), ctx=context(f"tp={world}"))
    out = _output(kind, model)
    _loss(out).backward()
    state = model.parallel_state
    placed = {}
    for name, p in model.named_parameters():
        box = ((0,) * p.dim(), tuple(p.shape))
        placed[name] = [(s.offsets, s.sizes, p.grad[where].detach().clone())
                        for s, where in state.layout(name, p).shards(name, box)]
    return {"out": out.detach(), "placed": placed, "replaced": state.replaced}


@pytest.mark.parametrize("kind", ["bert", "bert-mlm", "vit", "plain", "qwen2", "qwen3",
                                  "mistral"])
def test_tensor_parallel_family_matches_the_unsplit_model(ranks, kind):
    want_out, want_grads = _reference(kind)
    results = ranks(2).run(_split, kind)
    for result in results:
        torch.testing.assert_close(result["out"], want_out, rtol=1e-5, atol=1e-6)
        assert any("Parallel" in what for _, what in result["replaced"])
    for name, want in want_grads.items():
        got = torch.zeros_like(want)
        for result in results:
            for offsets, sizes, grad in result["placed"][name]:
                got[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = grad
        if want.norm() < 1e-6:
            assert (got - want).abs().max() < 1e-8, name
        else:
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 1e-5, f"{kind} {name}: relative L2 {rel:.2e}"


def _fit(out: torch.Tensor) -> torch.Tensor:
    """A bounded training loss: the outputs regressed onto a fixed pattern."""
    target = torch.linspace(-1, 1, out.numel()).reshape(out.shape).sin()
    return (out - target).pow(2).mean()


def _steps(model: nn.Module, opt, kind: str, backward) -> list[float]:
    losses = []
    for _ in range(10):
        loss = _fit(_output(kind, model))
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _trained(rank: int, world: int, kind: str) -> list[float]:
    from kernels_runtime import parallelize

    model = _build(kind)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ctx=context(f"tp={world}"), verbose=False)
    return _steps(model, opt, kind, opt.backward)


@pytest.mark.parametrize("kind", ["bert", "vit", "plain"])
def test_tensor_parallel_family_trains_like_the_unsplit_model(ranks, kind):
    """Ten SGD steps through ``parallelize`` give the unsplit run's losses (1e-5)."""
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = _steps(model, opt, kind, lambda loss: loss.backward())
    for losses in ranks(2).run(_trained, kind):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        assert rel < 1e-5, (kind, losses, ref)


def _pretrained(rank: int, world: int, folder: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from kernels_runtime import parallelize_model

    model = parallelize_model(AutoModelForCausalLM.from_pretrained(folder), ctx=context("tp=2"),
                              verbose=False)
    with torch.no_grad():
        return model(input_ids=torch.arange(12).reshape(2, 6) % 50).logits


def test_a_model_from_pretrained_splits_with_the_same_outputs(ranks, tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=50, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    unsplit = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    with torch.no_grad():
        want = unsplit(input_ids=torch.arange(12).reshape(2, 6) % 50).logits
    for logits in ranks(2).run(_pretrained, str(tmp_path / "llama")):
        assert (logits - want).abs().max().item() <= 1e-5
