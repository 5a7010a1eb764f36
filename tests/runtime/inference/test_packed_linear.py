"""``Engine(pack_weights=True)`` (``packed_linear.py``): oneDNN-packed linears compute what
``F.linear`` does, on every row count and input shape, and the engine decodes the same greedy
tokens with them on the real SmolLM2 checkpoint, with and without speculation.

What is protected: the packed output equals ``F.linear`` within fp32 rounding (1e-4 relative)
for 1 to 40 rows, 2-D and 3-D inputs, with and without a bias, and exactly for the one or two
rows that stay on ``F.linear``; a weight written after packing (in place, or by
``load_state_dict``) is repacked, never served stale; with gradients wanted the layer is
``F.linear`` (gradients equal); ``unpack_linears`` gives plain ``nn.Linear`` back; a GPU
device, an offloading plan and ``compile_model=True`` beside it are refused with what to do.
On SmolLM2 (two ranks' worth of the bench's workload on one rank): every linear packed, the
packed path taken, and the greedy tokens of the chat prompts (six decoding together: six rows a
step) and of the repeat-a-passage prompts with prompt-lookup speculation (drafts verified in
steps of several rows) identical to the unpacked engine's. LoRA adapters over packed linears:
``test_engine_adapters.py``'s "packed weights" case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels_runtime.inference.packed_linear import (
    MIN_ROWS,
    PackedLinear,
    pack_linears,
    unpack_linears,
)
from kernels_runtime.mesh.plan import Plan

CPU = torch.device("cpu")


def _layers(bias: bool) -> tuple[nn.Linear, nn.Linear]:
    """A layer and its packed twin, the same weights."""
    torch.manual_seed(0)
    plain = nn.Linear(96, 160, bias=bias)
    packed = nn.Sequential(nn.Linear(96, 160, bias=bias))
    packed[0].load_state_dict(plain.state_dict())
    assert pack_linears(packed, Plan(), CPU) == 1
    return plain, packed[0]


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_computes_f_linear_for_every_row_count(bias):
    plain, packed = _layers(bias)
    assert type(packed) is PackedLinear and isinstance(packed, nn.Linear)
    with torch.no_grad():
        for rows in range(1, 41):
            for shape in ((rows, 96), (1, rows, 96)):
                x = torch.randn(shape)
                got, want = packed(x), plain(x)
                assert got.shape == want.shape
                if rows < MIN_ROWS:
                    assert torch.equal(got, want), rows  # F.linear itself
                else:
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_weight_written_after_packing_is_repacked():
    plain, packed = _layers(True)
    x = torch.randn(8, 96)
    with torch.no_grad():
        first = packed(x)
        packed.weight.mul_(2)  # in place: the version moves
        torch.testing.assert_close(packed(x), F.linear(x, packed.weight, packed.bias))
        assert not torch.allclose(packed(x), first)
        packed.load_state_dict(plain.state_dict())
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-4, atol=1e-5)


def test_with_gradients_wanted_the_layer_is_f_linear():
    plain, packed = _layers(True)
    x = torch.randn(8, 96)
    plain(x).square().sum().backward()
    packed(x).square().sum().backward()
    assert torch.equal(packed.weight.grad, plain.weight.grad)
    assert torch.equal(packed.bias.grad, plain.bias.grad)


def test_unpack_gives_plain_linears_back():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert pack_linears(model, Plan(), CPU) == 2
    assert unpack_linears(model) == 2
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert not hasattr(model[0], "_packed")


def test_where_packing_cannot_apply_it_says_what_to_do():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="for CPU ranks.*leave it off"):
        pack_linears(model, Plan(), torch.device("cuda"))
    with pytest.raises(ValueError, match="undoes offload=static.*leave pack_weights off"):
        pack_linears(model, Plan.parse("offload=static offload_params=1"), CPU)
    from kernels_runtime.inference import Engine

    with pytest.raises(ValueError, match="compile_model=True and pack_weights=True.*choose one"):
        Engine(model, compile_model=True, pack_weights=True, verbose=False)
    assert type(model[0]) is nn.Linear  # refused before anything was touched


# ---- the engine, on the real checkpoint --------------------------------------------------
def _tokens(rank: int, world: int, folder: str) -> dict:
    from transformers import AutoModelForCausalLM

    from bench.inference.speculation import prompts as repeat_prompts
    from kernels_runtime.inference import Engine, SamplingParams

    from helpers import real_model
    from helpers.distributed import process_comm

    chat = real_model.chat_ids(folder, real_model.CHAT)
    repeat = repeat_prompts(folder, 2)
    out: dict = {}
    calls = {"packed": 0}
    current = PackedLinear._current

    def counted(self):  # a spy: the packed weight was used, not only built
        calls["packed"] += 1
        return current(self)

    PackedLinear._current = counted
    try:
        for pack in (False, True):
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
            engine = Engine(model, "dp=1", comm=process_comm(), kv_mem="32MiB",
                            pack_weights=pack, verbose=False)
            linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear)]
            out[f"packed linears {pack}"] = (sum(type(m) is PackedLinear for m in linears),
                                             len(linears))
            out[f"chat {pack}"] = [o.token_ids for o in engine.generate(
                chat, SamplingParams(max_new_tokens=real_model.NEW))]
            out[f"repeat {pack}"] = [o.token_ids for o in engine.generate(
                repeat, SamplingParams(max_new_tokens=40, speculate=4))]
            out[f"accepted {pack}"] = engine.stats()["spec_accepted_tokens"]
            out[f"calls {pack}"] = calls["packed"]
    finally:
        PackedLinear._current = current
    return out


@pytest.mark.full
def test_the_engine_decodes_the_same_tokens_with_packed_weights(ranks, smollm2):
    got = ranks(1).run(_tokens, str(smollm2.folder), timeout_s=600)[0]
    assert got["packed linears False"] == (0, 211)  # 30 layers x 7 projections, and the head
    assert got["packed linears True"] == (211, 211)
    assert got["calls False"] == 0 and got["calls True"] > 211
    assert got["chat True"] == got["chat False"]
    assert got["repeat True"] == got["repeat False"]
    assert got["accepted True"] == got["accepted False"] > 0  # drafts verified, and kept
