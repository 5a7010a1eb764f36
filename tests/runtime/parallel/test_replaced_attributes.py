"""Module attributes under tensor parallelism: what a swapped module carries, what is refused.

What is protected (issue 24): a BERT masked LM with a [PAD] row (``pad_token_id``; the row
trained, not zero, as in a published checkpoint) on a tokenized-like batch of four sequences of
different lengths padded to one length with an attention mask, the labels its input ids (the
loss reads the padded positions, so the [PAD] lookups get a gradient that ``padding_idx``
drops), under tp=2 gives the unsplit model's loss and, assembled from both ranks' shards
through their layouts, every parameter's gradient (1e-5 relative L2; 1e-8 absolute where the
reference gradient is below 1e-6, BERT's key biases), then the unsplit losses
over three SGD steps (1e-5); with an untied decoder the [PAD] row is unchanged after them on
both. Cases: the decoder tied or not, [PAD] in the first rank's vocabulary shard (id 0, BERT's)
or the second's (its index relative to that shard's start). An embedding with ``max_norm``,
``scale_grad_by_freq`` or ``sparse=True`` is refused by the tensor applier's ``check``, naming
the module, attribute and value and what to do, before the model changes; so are a hooked
linear layer, and on the 2D grid (which also rebuilds replicated modules) a position embedding
with ``max_norm`` and an RMSNorm of another formula than LlamaRMSNorm's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from helpers.distributed import context

VOCAB, LENGTHS, LR, STEPS = 51, (8, 6, 3, 5), 0.1, 3  # 51: the shards hold 26 and 25 rows
WORDS = "bert.embeddings.word_embeddings.weight"


def _bert(tied: bool = True, pad: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=pad, tie_word_embeddings=tied)
    model = transformers.BertForMaskedLM(config)
    with torch.no_grad():  # a published checkpoint's [PAD] row is trained, not zero
        model.bert.embeddings.word_embeddings.weight[pad].normal_(0.0, 0.02)
    return model


def _batch(pad: int) -> dict[str, torch.Tensor]:
    """[CLS] tokens [SEP], padded with ``pad`` to the longest, as a tokenizer returns them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.full((len(LENGTHS), max(LENGTHS)), pad)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        words = torch.randint(5, VOCAB, (n - 2,), generator=g)
        words = torch.where(words == pad, words + 1, words)  # never [PAD] inside a sentence
        ids[row, :n] = torch.cat([torch.tensor([2]), words, torch.tensor([3])])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _loss(model: nn.Module, pad: int) -> torch.Tensor:
    batch = _batch(pad)
    return model(**batch, labels=batch["input_ids"]).loss  # labels=input_ids: pads included


def _steps(model: nn.Module, opt, pad: int, backward) -> list[float]:
    losses = []
    for _ in range(STEPS):
        loss = _loss(model, pad)
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(tied: bool, pad: int) -> dict:
    model = _bert(tied, pad)
    loss = _loss(model, pad)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}  # untied, transformers leaves cls.predictions.bias unused
    model = _bert(tied, pad)
    losses = _steps(model, torch.optim.SGD(model.parameters(), lr=LR), pad,
                    lambda loss: loss.backward())
    return {"loss": loss.item(), "grads": grads, "losses": losses,
            "row": model.get_parameter(WORDS)[pad].detach().clone()}


def _split(rank: int, world: int, tied: bool, pad: int) -> dict:
    from kernels_runtime import parallelize, parallelize_model

    from helpers.models import full_parameters

    model = parallelize_model(_bert(tied, pad), ctx=context(f"tp={world}"), verbose=False)
    loss = _loss(model, pad)
    loss.backward()
    state = model.parallel_state
    placed = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        box = ((0,) * p.dim(), tuple(p.shape))
        placed[name] = [(s.offsets, s.sizes, p.grad[where].detach().clone())
                        for s, where in state.layout(name, p).shards(name, box)]
    trained = _bert(tied, pad)
    trained, opt = parallelize(trained, torch.optim.SGD(trained.parameters(), lr=LR),
                               ctx=context(f"tp={world}"), verbose=False)
    losses = _steps(trained, opt, pad, opt.backward)
    row = full_parameters(trained)[WORDS][pad]
    return {"loss": loss.item(), "placed": placed, "losses": losses, "row": row}


def _relative(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


@pytest.mark.parametrize("tied, pad", [(True, 0), (False, 0), (False, 40)],
                         ids=["tied-pad0", "untied-pad0", "untied-pad-in-shard1"])
def test_padded_bert_under_tp_matches_the_unsplit_model(ranks, tied, pad):
    ref = _reference(tied, pad)
    results = ranks(2).run(_split, tied, pad)
    for result in results:
        assert _relative(result["loss"], ref["loss"]) < 1e-5, (result["loss"], ref["loss"])
        steps = max(_relative(a, b) for a, b in zip(result["losses"], ref["losses"]))
        assert steps < 1e-5, f"SGD losses {result['losses']} vs unsplit {ref['losses']}"
        assert result["placed"].keys() == ref["grads"].keys()
    for name, want in ref["grads"].items():
        got = torch.zeros_like(want)
        for result in results:
            for offsets, sizes, grad in result["placed"][name]:
                got[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = grad
        if want.norm() < 1e-6:  # key biases: softmax is shift-invariant, rounding noise
            assert (got - want).abs().max() < 1e-8, name
            continue
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-5, f"{name}: relative L2 {rel:.2e}"
    initial = _bert(tied, pad).get_parameter(WORDS)[pad].detach()
    for result in results:
        torch.testing.assert_close(result["row"], ref["row"], rtol=1e-5, atol=1e-7)
    if not tied:  # only a tied decoder's gradient moves the [PAD] row
        assert torch.equal(ref["row"], initial)
        assert all(torch.equal(r["row"], initial) for r in results), "the [PAD] row learned"


@dataclass(frozen=True)
class _PlanOnly:
    """The one field of a ``ParallelContext`` the tensor applier's ``check`` reads."""

    plan: object


def _check(model: nn.Module, plan: str, world: int) -> str | None:
    from kernels_runtime import Plan
    from kernels_runtime.parallel.state import ParallelState
    from kernels_runtime.parallel.tensor.applier import check
    from kernels_runtime.policies import get_policy

    ctx = _PlanOnly(Plan.parse(plan).validate(world))
    return check(ParallelState(ctx=ctx, policy=get_policy(model)), model)  # type: ignore


REFUSED = [("max_norm", 1.0, "max_norm to None"),
           ("scale_grad_by_freq", True, "scale_grad_by_freq to False"),
           ("sparse", True, "sparse to False")]


@pytest.mark.parametrize("attribute, value, fix", REFUSED, ids=[r[0] for r in REFUSED])
def test_embedding_attributes_tp_does_not_implement_are_refused(attribute, value, fix):
    model = _bert()
    assert _check(model, "tp=2", 2) is None
    setattr(model.bert.embeddings.word_embeddings, attribute, value)
    message = _check(model, "tp=2", 2)
    assert message is not None, f"{attribute}={value} was not refused"
    for words in ("bert.embeddings.word_embeddings", f"{attribute}={value}", "tp=1", fix):
        assert words in message, message


def _refused(rank: int, world: int) -> dict:
    from kernels_runtime import PlanError, parallelize_model

    model = _bert()
    model.bert.embeddings.word_embeddings.max_norm = 1.0
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    try:
        parallelize_model(model, ctx=context(f"tp={world}"), verbose=False)
        message = "no error"
    except PlanError as err:
        message = str(err)
    after = {n: p.data_ptr() for n, p in model.named_parameters()}
    kept = type(model.bert.embeddings.word_embeddings) is nn.Embedding
    return {"message": message, "untouched": before == after and kept
            and "parallel_state" not in model.__dict__}


def test_a_refused_attribute_leaves_the_model_untouched(ranks):
    for result in ranks(2).run(_refused):
        assert "max_norm=1.0" in result["message"], result["message"]
        assert result["untouched"], "the model changed before the refusal"


def test_a_hooked_linear_layer_is_refused():
    model = _bert()
    model.bert.encoder.layer[0].attention.self.query.register_forward_hook(lambda *a: None)
    message = _check(model, "tp=2", 2)
    assert message is not None and "encoder.layer.0.attention.self.query" in message
    assert "forward_hooks" in message, message


def test_the_grid_refuses_a_replicated_embedding_it_cannot_rebuild():
    """1D leaves position embeddings whole (attributes and all); the grid cuts them."""
    model = _bert()
    model.bert.embeddings.position_embeddings.max_norm = 2.0
    assert _check(model, "tp=2", 2) is None
    message = _check(model, "tp=4 tp_mode=2d", 4)
    assert message is not None and "position_embeddings" in message, message
    assert "max_norm=2.0" in message, message


class _OnePlusRMSNorm(nn.Module):
    """Gemma's RMSNorm: (1 + weight) * x / rms(x), an RMSNorm by name, not LlamaRMSNorm's."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(hidden)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        return (1.0 + self.weight) * (x.float() * rms).to(x.dtype)


def test_the_grid_refuses_an_rms_norm_of_another_formula():
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=40))
    assert _check(model, "tp=4 tp_mode=2d", 4) is None
    model.model.norm = _OnePlusRMSNorm(32)
    message = _check(model, "tp=4 tp_mode=2d", 4)
    assert message is not None and "model.norm" in message and "tp_mode=1d" in message
    assert _check(model, "tp=2", 2) is None  # 1D keeps norms whole
