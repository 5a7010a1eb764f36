"""Tiny HF models, batches and a single-process reference trainer for data-parallel parity.

The reference is independent of the runtime: plain PyTorch with the same mixed-precision
recipe (16-bit parameters, fp32 master copies updated by AdamW), trained on the whole global
batch in one process. Data-parallel runs must reproduce its losses and final parameters.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 16
LR, WEIGHT_DECAY = 3e-3, 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_model(kind: str) -> nn.Module:
    """A tiny GPT-2 or LLaMA with fixed random weights (seed 0), dropout off."""
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=SEQ)
        return LlamaForCausalLM(cfg)
    raise ValueError(kind)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences: each row counts up by a per-row stride from a random start."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def local_microbatches(step: int, dp_rank: int, dp: int, n: int) -> list[tuple]:
    x, y = global_batch(step)
    b = GLOBAL_BATCH // dp
    x, y = x[dp_rank * b:(dp_rank + 1) * b], y[dp_rank * b:(dp_rank + 1) * b]
    if b % n:
        raise ValueError(f"{b} rows per rank do not split into {n} micro-batches")
    m = b // n
    return [(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) for i in range(n)]


def hf_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Next-token loss with HF's label convention (labels already shifted here)."""
    x, y = batch
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def reference_run(kind: str, precision: str, steps: int) -> tuple[list[float], dict]:
    model = make_model(kind)
    params = list(model.parameters())
    masters = [p.detach().clone().float() for p in params]
    model.to(DTYPES[precision])
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        loss = hf_loss(model, global_batch(step))
        loss.backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
        losses.append(loss.item())
    final = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, final


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 copies of every parameter: FSDP2 DTensors gathered over dp, then
    tensor-parallel shards placed by their layouts and summed over tp (collective)."""
    from torch.distributed.tensor import DTensor

    state = getattr(model, "parallel_state", None)
    out = {}
    for n, p in model.named_parameters():
        t = (p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
        layout = state.layout(n, t) if state is not None else None
        if layout is None or "tp" not in layout.sharded:
            out[n] = t.clone()
            continue
        whole = torch.zeros(layout.shape, dtype=torch.float32, device=t.device)
        if layout.replica[0] == 0:  # one copy of blocks that repeat inside tp (a 2D grid's)
            for shard, where in layout.shards(n, ((0,) * t.dim(), tuple(t.shape))):
                whole[tuple(slice(o, o + s) for o, s in zip(shard.offsets, shard.sizes))] = \
                    t[where]
        state.ctx.comm.all_reduce(whole, group=state.ctx.group("tp"))
        out[n] = whole
    return out
