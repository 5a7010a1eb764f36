"""The serving loop shares its leader's commands with the replica's other ranks as JSON.

What is protected (issue 26, item 6): ``service.share`` sends the commands as JSON bytes in a
tensor, never pickle (a rank unpickling what came over the network would run whatever it
said), and every rank of a tensor-parallel replica still applies the same commands in the same
order: requests given as token ids and as non-ASCII text, sent in one turn and in later turns,
generate under the serving loop exactly what ``engine.generate`` gives each alone, and the
loop drains at ``stop``. A tiny GPT-2 of seeded random weights (the same on both ranks; no
training needed for parity) on 2 gloo ranks (tp=2); only rank 0, the leader, is given
commands. In make test-full.
"""

from __future__ import annotations

import pytest

from helpers.distributed import process_comm

pytestmark = pytest.mark.full  # a 2-rank pool: make test's budget is used up
NEW = 10


def _serve_tp2(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from kernels_runtime.data.corpus import ByteTokenizer
    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.commands import Command
    from kernels_runtime.inference.service import replica_leader, serve

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=256, n_embd=32, n_layer=2,
                                       n_head=2)).eval()
    engine = Engine(model, "tp=2", comm=process_comm(), verbose=False,
                    tokenizer=ByteTokenizer(), kv_mem="4MiB")
    ids = list(b"def __init__(self, name")
    text = "caf\u00e9 \u4e2d\u6587 = {"  # bytes past ASCII through the JSON share
    greedy = SamplingParams(max_new_tokens=NEW)
    alone = [o.token_ids for o in engine.generate([ids, text], greedy)]
    turns = [[Command("completion", "ids", ids, {"max_new_tokens": NEW})], [],
             [Command("completion", "text", text, {"max_new_tokens": NEW}),
              Command("abort", "nobody")]]
    sent: list[dict] = []

    def receive(timeout_s: float) -> list:
        if turns:
            return turns.pop(0)
        done = {d["id"] for d in sent if d["finish_reason"]} >= {"ids", "text"}
        return [Command("stop")] if done else []

    leader = replica_leader(engine.ctx)
    serve(engine, receive if leader else None, sent.extend if leader else None, idle_s=0.0)
    dist.barrier()
    by_id: dict[str, list[int]] = {}
    for d in sent:
        by_id.setdefault(d["id"], []).extend(d["token_ids"])
    return {"leader": leader, "by_id": by_id, "alone": alone,
            "blocks_used": engine.stats()["blocks_used"]}


def test_tensor_parallel_ranks_share_json_commands_and_generate_alike(ranks):
    out = ranks(2).run(_serve_tp2)
    leader, other = out
    assert leader["leader"] and not other["leader"] and other["by_id"] == {}
    assert leader["by_id"] == {"ids": leader["alone"][0], "text": leader["alone"][1]}, leader
    assert leader["blocks_used"] == other["blocks_used"] == 0
