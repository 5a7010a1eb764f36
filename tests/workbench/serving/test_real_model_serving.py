"""``workbench serve`` on a real pretrained model, as a user first types it.

What is protected: ``workbench serve --model DIR`` with no other option (a port aside) on the
converted SmolLM2-135M-Instruct folder (30 layers, 9 query over 3 key/value heads) starts its
default pool (2 ranks on a CPU machine, one replica each) and answers the official ``openai``
client's chat completions with the text of HF ``generate``'s greedy tokens under the model's
own chat template (the end-of-turn token dropped), both for an answer that ends at that token
(``finish_reason="stop"``) and for one the token budget cuts (``"length"``); and
``--plan tp=2`` on that folder is one line on stderr naming the tp values its heads allow, exit
status 2, before any pool starts. With ``--pack-weights --stream-interval 0`` (oneDNN-packed
linears, every step streamed; ``make test-full``) the streamed answers are the same text.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import real_model
from helpers.serve_cli import workbench_serve

pytestmark = pytest.mark.slow  # the converted model (~20 s once per session)
# an answer that stops at the end-of-turn token, one the budget cuts, one with apostrophes
ASKED = [0, 3, 5]


@pytest.mark.engines
def test_serve_with_only_a_model_answers_chat_like_hf_generate(smollm2, smollm2_greedy):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from workbench.serving import api_key

    tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
    name = smollm2.folder.name
    with workbench_serve("--model", str(smollm2.folder)) as served:
        client = OpenAI(base_url=served.url + "/v1", api_key=api_key(served.port),
                        max_retries=0)
        for i in ASKED:
            want = smollm2_greedy.tokens[i]
            got = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": real_model.CHAT[i]}],
                max_tokens=real_model.NEW, temperature=0)
            choice = got.choices[0]
            assert choice.message.content == tokenizer.decode(want, skip_special_tokens=True)
            stopped = len(want) < real_model.NEW
            assert choice.finish_reason == ("stop" if stopped else "length"), (i, choice)
    out = served.output
    assert served.proc.returncode == 0, out
    # the default pool (2 CPU ranks here) serves one replica per rank
    assert re.search(rf"serving {re.escape(name)} at .* \((\d+) ranks, plan dp=\1\)", out), out
    assert "tokens streamed at most every 40 ms" in out, out  # CPU ranks: paced by default


@pytest.mark.engines
@pytest.mark.full
def test_packed_weights_streamed_every_step_answer_like_hf_generate(smollm2, smollm2_greedy):
    from openai import OpenAI
    from transformers import AutoTokenizer

    from workbench.serving import api_key

    tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
    with workbench_serve("--model", str(smollm2.folder), "--pack-weights",
                         "--stream-interval", "0") as served:
        client = OpenAI(base_url=served.url + "/v1", api_key=api_key(served.port),
                        max_retries=0)
        for i in ASKED:
            streamed = client.chat.completions.create(
                model=smollm2.folder.name, max_tokens=real_model.NEW, temperature=0,
                messages=[{"role": "user", "content": real_model.CHAT[i]}], stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            assert text == tokenizer.decode(smollm2_greedy.tokens[i], skip_special_tokens=True)
    assert served.proc.returncode == 0, served.output
    assert "tokens streamed as each step makes them" in served.output, served.output


def test_a_tp_the_heads_refuse_is_one_line_naming_the_tp_that_work(smollm2):
    result = subprocess.run([sys.executable, "-m", "workbench.cli", "serve", "--model",
                             str(smollm2.folder), "--plan", "tp=2"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines() == [
        "workbench serve: tp=2 does not divide the model's 9 attention heads (3 key/value "
        "heads); tp values that work: 1, 3, 9"]
