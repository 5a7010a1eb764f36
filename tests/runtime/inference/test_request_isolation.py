"""One request's failure is that request's error, never the end of a replica's serving loop.

What is protected (issue 26, item 2): in ``service.serve`` (the loop every rank of a replica
runs), a request whose seed torch cannot take (past 64 bits, or negative) and one whose
parameters cannot even be built each come back as a finished delta carrying its ``error``,
while a good request sent in the same turn generates exactly what it generates alone and the
loop goes on to drain at ``stop``; a sampled request at the smallest positive temperature
(found by the schema fuzz: it made the softmax nan and ended the replica's loop) generates
the greedy tokens. A chat template's refusal is a ``ChatTemplateError`` naming its reason
(``service.admit`` makes it the request's error as it does the others); ``SamplingParams``
refuses a seed out of range by itself.

The trained tiny GPT-2 of ``helpers/inference.py`` on one real gloo rank; the chat template
is a real tokenizer's (built in memory) with a template that raises as many models' do.
"""

from __future__ import annotations

import pytest

from helpers import inference as inf
from helpers.distributed import process_comm

NEW = 12


def _serve_with_bad_requests(rank: int, world: int, path: str) -> dict:
    from kernels_runtime.data.corpus import ByteTokenizer
    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.commands import Command
    from kernels_runtime.inference.service import serve

    engine = Engine(inf.load("gpt2", path), "dp=1", comm=process_comm(), verbose=False,
                    tokenizer=ByteTokenizer())
    good = inf.prompts((20,))[0]
    alone = engine.generate([good], SamplingParams(max_new_tokens=NEW))[0].token_ids
    turns = [[Command("completion", "seed-big", good, {"seed": 2**64, "temperature": 1.0}),
              Command("completion", "seed-neg", good, {"seed": -1, "temperature": 1.0}),
              Command("completion", "no-params", good, {"colour": "red"}),
              Command("completion", "good", good, {"max_new_tokens": NEW}),
              # the smallest double above 0: sampled, it must act as greedy, not give nan
              Command("completion", "tiny-t", good, {"max_new_tokens": NEW,
                                                     "temperature": 5e-324, "seed": 3})]]
    sent: list[dict] = []

    def receive(timeout_s: float) -> list:
        if turns:
            return turns.pop(0)
        done = {d["id"] for d in sent if d["finish_reason"]} >= {"good", "tiny-t"}
        return [Command("stop")] if done else []

    serve(engine, receive, sent.extend, idle_s=0.0)
    by_id: dict[str, dict] = {}
    for d in sent:
        merged = by_id.setdefault(d["id"], {"token_ids": []})
        merged["token_ids"] += d["token_ids"]
        merged.update(finish_reason=d["finish_reason"], error=d["error"])
    return {"by_id": by_id, "alone": alone, "blocks_used": engine.stats()["blocks_used"]}


def test_bad_requests_are_their_own_errors_and_the_loop_serves_on(ranks, trained):
    out = ranks(1).run(_serve_with_bad_requests, trained["gpt2"])[0]
    got = out["by_id"]
    for rid, phrase in (("seed-big", "seed must be in [0, 9223372036854775807]"),
                        ("seed-neg", "seed must be in [0,"),
                        ("no-params", "unexpected keyword argument 'colour'")):
        assert got[rid]["finish_reason"] == "error" and phrase in got[rid]["error"], got[rid]
    assert got["good"]["finish_reason"] == "length" and got["good"]["error"] is None
    assert got["good"]["token_ids"] == out["alone"]
    assert got["tiny-t"]["finish_reason"] == "length" and got["tiny-t"]["token_ids"] == \
        out["alone"]
    assert out["blocks_used"] == 0


def _templated_tokenizer():
    """A real fast tokenizer with a template that refuses non-alternating roles (Llama-2's
    and Mistral's templates raise the same way)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0},
                                                                       unk_token="[UNK]")))
    tok.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/"
        "assistant/...') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    return tok


def test_a_template_that_refuses_the_messages_names_its_reason():
    from kernels_runtime.inference.chat import ChatTemplateError, chat_prompt

    tok = _templated_tokenizer()
    fine = chat_prompt(tok, [{"role": "user", "content": "hi"}])
    assert fine.startswith("[user] hi")
    with pytest.raises(ChatTemplateError, match="roles must alternate") as err:
        chat_prompt(tok, [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo"}])
    assert "roles: user, user" in str(err.value)


@pytest.mark.parametrize("seed, ok", [(0, True), (2**63 - 1, True), (2**63, False),
                                      (2**64, False), (-1, False)])
def test_sampling_params_refuse_a_seed_torch_cannot_take(seed, ok):
    from kernels_runtime.inference import SamplingParams

    problem = SamplingParams(temperature=1.0, seed=seed).problem(has_tokenizer=True)
    assert (problem is None) == ok, problem
    if not ok:
        assert "seed must be in [0, 9223372036854775807]" in problem
