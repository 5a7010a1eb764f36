"""The first command a user types works: ``workbench serve --model DIR`` with no other option
(a port aside) chooses a plan that fits the default pool (replicas over its ranks, since a tiny
GPT-2 fits each rank) and answers the official ``openai`` client with the greedy text of HF
``generate`` on the same prompt. A plan the model cannot take (tp=2 over 9 query and 3
key/value heads) is one line on stderr naming the tp values that work, exit status 2, no
traceback, before any pool starts. Requests schemathesis generates from ``/openapi.json`` (a
bounded number here; more against the real model in make test-full) never get a 5xx and the
same greedy request answers the same afterwards.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import inference as inf
from helpers.schema_fuzz import fuzz_endpoint
from helpers.serve_cli import workbench_serve

pytestmark = pytest.mark.engines
PROMPT = "def __init__(self"
CHAT = [{"role": "user", "content": "A function:"}]
NEW = 20
FUZZ_EXAMPLES = 6  # per route and mode: 24 generated requests


def _hf_greedy(folder: str, prompt: str) -> str:
    """HF ``generate``'s greedy continuation of ``prompt``, as text (without the end token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    if out and out[-1] == tokenizer.eos_token_id:
        out = out[:-1]
    return tokenizer.decode(out)


def _chat_prompt(folder: str) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return inf.save_hf_folder(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


def test_serve_with_only_a_model_answers_like_hf_generate(folder):
    from openai import OpenAI

    from workbench.serving import api_key

    expected = _hf_greedy(str(folder), PROMPT)
    expected_chat = _hf_greedy(str(folder), _chat_prompt(str(folder)))
    with workbench_serve("--model", str(folder)) as served:
        client = OpenAI(base_url=served.url + "/v1", api_key=api_key(served.port),
                        max_retries=0)
        got = client.completions.create(model="tiny-gpt2", prompt=PROMPT, max_tokens=NEW,
                                        temperature=0)
        assert got.choices[0].text == expected
        chat = client.chat.completions.create(model="tiny-gpt2", messages=CHAT,
                                              max_tokens=NEW, temperature=0)
        assert chat.choices[0].message.content == expected_chat
        # a bounded fuzz from the endpoint's own OpenAPI document (more in test_schema_fuzz.py)
        seen = fuzz_endpoint(served.url, {"Authorization": f"Bearer {api_key(served.port)}"},
                             "tiny-gpt2", FUZZ_EXAMPLES)
        assert seen.get(200) and seen.get(400), seen
        again = client.completions.create(model="tiny-gpt2", prompt=PROMPT, max_tokens=NEW,
                                          temperature=0)
        assert again.choices[0].text == expected
    out = served.output
    assert served.proc.returncode == 0, out
    # the default pool (2 CPU ranks here) serves one replica per rank
    assert re.search(r"serving tiny-gpt2 at .* \((\d+) ranks, plan dp=\1\)", out), out


def test_a_tp_the_heads_refuse_is_one_line_naming_the_tp_that_work(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=9, num_key_value_heads=3).save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-m", "workbench.cli", "serve", "--model",
                             str(tmp_path), "--plan", "tp=2"], capture_output=True, text=True,
                            timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert lines[0] == ("workbench serve: tp=2 does not divide the model's 9 attention heads "
                        "(3 key/value heads); tp values that work: 1, 3, 9")


def test_the_default_plan_replicates_where_the_model_fits_else_splits_it():
    """``fit.fitting`` on a 9/3-head model: replicas over every rank when the weights take at
    most half a rank's memory; else the narrowest tp the heads allow (tp=2 is skipped); else a
    one-line refusal."""
    from kernels_runtime.mesh.plan import PlanError
    from workbench.serving import fit

    config = {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 2}
    gib = 1 << 30
    assert fit.fitting(6, 8 * gib, config, gib).to_string() == "dp=6"
    assert fit.fitting(6, 4 * gib, config, 5 * gib).to_string() == "dp=2 tp=3"
    with pytest.raises(PlanError, match="do not fit this pool of 2 ranks: at tp=1"):
        fit.fitting(2, 4 * gib, config, 5 * gib)
