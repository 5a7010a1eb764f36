"""Decoders outside transformers, as the generic policy covers them: a hand-written model of
``nn.Linear`` blocks calling ``scaled_dot_product_attention(is_causal=True)`` and taking
``position_ids``, trained briefly, generates under the engine (single rank and tp=2) exactly
what recomputing the whole sequence each step gives; a model without ``position_ids`` or
without a context length is refused with what to change.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers import inference as inf
from helpers.distributed import process_comm

HIDDEN, HEADS, CONTEXT, NEW = 64, 4, 128, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = (p(y).view(b, s, -1, HIDDEN // HEADS).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # (b, heads, s, d): local heads under tp
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(inf.VOCAB, HIDDEN), nn.Embedding(CONTEXT, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, inf.VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def trained_decoder() -> Decoder:
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, g = inf.corpus()[:200_000], torch.Generator().manual_seed(0)
    for _ in range(150):
        rows = torch.stack([tokens[s:s + 65] for s in torch.randint(
            0, tokens.numel() - 65, (16,), generator=g).tolist()])
        logits = model(rows[:, :-1])
        F.cross_entropy(logits.reshape(-1, inf.VOCAB), rows[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def recompute(model: Decoder, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy by running the whole sequence every step (no cache)."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW):
            row = model(torch.tensor([ids]))[0, -1]
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt):], torch.stack(logits)


def _engine(rank: int, world: int, state: dict, plan: str) -> list:
    from kernels_runtime.inference import Engine, SamplingParams

    model = Decoder()
    model.load_state_dict(state)
    engine = Engine(model, plan, comm=process_comm(), max_model_len=CONTEXT, max_batch_tokens=32,
                    verbose=False)
    outs = engine.generate(inf.prompts((40, 9, 23)),
                           SamplingParams(max_new_tokens=NEW, return_logits=True))
    return [(o.token_ids, torch.stack(o.logits)) for o in outs]


@pytest.mark.parametrize(("plan", "n"), [("dp=1", 1),
                                         pytest.param("tp=2", 2, marks=pytest.mark.slow)])
def test_a_generic_decoder_generates_what_recomputing_gives(ranks, plan, n):
    model = trained_decoder()
    got = ranks(n).run(_engine, model.state_dict(), plan, timeout_s=300)[0]
    for prompt, (tokens, logits) in zip(inf.prompts((40, 9, 23)), got):
        want_tokens, want_logits = recompute(model, prompt)
        assert tokens == want_tokens
        assert (logits - want_logits).abs().max().item() <= 1e-4


class NoPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


def _refusals(rank: int, world: int) -> list[str]:
    from kernels_runtime.inference import Engine

    out = []
    for model, kwargs in ((NoPositions(), {"max_model_len": 64}), (Decoder(), {})):
        try:
            Engine(model, "dp=1", comm=process_comm(), verbose=False, **kwargs)
        except TypeError as err:
            out.append(str(err))
    return out


def test_generic_decoders_without_positions_or_a_context_are_refused(ranks):
    positions, context = ranks(1).run(_refusals)[0]
    assert "forward must take position_ids" in positions
    assert "Engine(..., max_model_len=N)" in context
