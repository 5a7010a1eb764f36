"""A serving leader paces a request's deltas (``stream_pacing.py``): at most one send of its
new tokens per interval, its first tokens and its end at once, nothing lost or reordered.

What is protected: with an interval, a request changed in a step whose interval has not ended
is held, unless it has sent nothing yet (time to first token is never paced) or it finished
(its last tokens go with its finish); a held request goes out when the interval ends even if
that step did not change it (a preempted request is not stranded); an aborted request is
forgotten; interval 0 sends every step's changes, as the loop did before pacing. Under the
real serving loop on one rank (a tiny seeded GPT-2, prompts as token ids), an interval longer
than the run sends each request exactly twice, its first token and the rest with its finish,
and every request's tokens still equal ``engine.generate``'s; without one, a delta per token.
A bad interval is refused by the engine side and by the server, saying what it takes.
"""

from __future__ import annotations

import pytest

from kernels_runtime.inference.params import RequestOutput
from kernels_runtime.inference.stream_pacing import StreamPacer

from helpers.distributed import process_comm

NEW = 12


def _out(rid: str, tokens: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, [1], token_ids=[7] * tokens, finish_reason=finish)


def _ids(outs: list[RequestOutput]) -> list[str]:
    return [o.request_id for o in outs]


def test_a_request_is_held_within_the_interval_but_its_first_and_last_go_at_once():
    pacer = StreamPacer(3600.0)
    sent: set[str] = set()
    assert _ids(pacer.due([_out("a", 1)], sent)) == ["a"]  # the first call starts an interval
    sent.add("a")
    assert _ids(pacer.due([_out("a", 2), _out("b", 1)], sent)) == ["b"]  # b's first: at once
    sent.add("b")
    assert _ids(pacer.due([_out("a", 3), _out("b", 2)], sent)) == []  # both held
    due = pacer.due([_out("b", 3, "length")], sent)  # b ends: its finish, at once
    assert [(o.request_id, len(o.token_ids), o.finish_reason) for o in due] == [
        ("b", 3, "length")]
    assert set(pacer.pending) == {"a"} and len(pacer.pending["a"].token_ids) == 3
    pacer.flushed -= 3600.0  # the interval ends, in a step that did not change a
    assert [(o.request_id, len(o.token_ids)) for o in pacer.due([], sent)] == [("a", 3)]
    assert pacer.pending == {}


def test_an_aborted_request_is_forgotten_and_interval_zero_sends_every_step():
    pacer = StreamPacer(3600.0)
    pacer.due([_out("a", 1)], set())
    pacer.due([_out("a", 2)], {"a"})
    pacer.drop("a")
    pacer.flushed -= 3600.0
    assert pacer.due([], {"a"}) == []
    every = StreamPacer(0.0)
    for n in range(1, 4):
        assert _ids(every.due([_out("a", n), _out("b", n)], {"a", "b"})) == ["a", "b"]


def test_a_bad_interval_is_refused_saying_what_it_takes():
    from workbench.serving.server import Server

    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="seconds >= 0"):
            StreamPacer(bad)
        with pytest.raises(ValueError, match="stream_interval_s must be between 0 and 10"):
            Server(None, "engine", stream_interval_s=bad)


def _serve(rank: int, world: int, interval_s: float) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.commands import Command
    from kernels_runtime.inference.service import serve

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=256, n_embd=32, n_layer=2,
                                       n_head=2)).eval()
    # no tokenizer: no text held back for a half character, so every token can be sent
    engine = Engine(model, "dp=1", comm=process_comm(), verbose=False, kv_mem="4MiB")
    prompts = {rid: list(text.encode()) for rid, text in
               (("a", "def __init__(self"), ("b", "import "), ("c", "for name in"))}
    # ignore_eos: every request makes its NEW tokens, each one step after its first
    params = {"max_new_tokens": NEW, "ignore_eos": True}
    alone = {rid: o.token_ids for rid, o in zip(prompts, engine.generate(
        list(prompts.values()), SamplingParams(**params)))}
    turns = [[Command("completion", "a", prompts["a"], params)], [],
             [Command("completion", rid, prompts[rid], params) for rid in ("b", "c")]]
    sent: list[list[dict]] = []  # the leader's messages, one per send

    def receive(timeout_s: float) -> list:
        if turns:
            return turns.pop(0)
        done = {d["id"] for m in sent for d in m if d["finish_reason"]} >= set(prompts)
        return [Command("stop")] if done else []

    serve(engine, receive, sent.append, idle_s=0.0, stream_interval_s=interval_s)
    deltas: dict[str, list[list[int]]] = {}
    for message in sent:
        for d in message:
            deltas.setdefault(d["id"], []).append(d["token_ids"])
    return {"alone": alone, "deltas": deltas, "blocks_used": engine.stats()["blocks_used"]}


@pytest.mark.full
def test_the_serving_loop_paces_each_request_and_loses_no_token(ranks):
    paced = ranks(1).run(_serve, 3600.0)[0]
    every = ranks(1).run(_serve, 0.0)[0]
    for got in (paced, every):
        assert {rid: sum(parts, []) for rid, parts in got["deltas"].items()} == got["alone"]
        assert got["blocks_used"] == 0
    # an interval longer than the run: the first token at once, the rest with the finish
    assert {rid: [len(p) for p in parts] for rid, parts in paced["deltas"].items()} == {
        rid: [1, NEW - 1] for rid in "abc"}
    assert {rid: [len(p) for p in parts] for rid, parts in every["deltas"].items()} == {
        rid: [1] * NEW for rid in "abc"}
