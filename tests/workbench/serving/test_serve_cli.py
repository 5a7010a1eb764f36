"""``workbench serve`` from a shell: a ``save_pretrained`` folder (a tiny GPT-2 with its own BPE
tokenizer and chat template) served by a pool of its own under tp=2, called with the official
``openai`` client: greedy completions and chat completions, streamed and not, equal
``engine.generate`` of an engine built in one process on the same folder; SIGINT drains and
exits cleanly. Bad invocations fail fast with a clear message.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import inference as inf
from helpers.distributed import process_comm
from helpers.serve_cli import workbench_serve

pytestmark = pytest.mark.engines
PROMPTS = ["def __init__(self", "import os\n"]
CHAT = [{"role": "user", "content": "A function:"}]


def _reference(rank: int, world: int, folder: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kernels_runtime.inference import Engine, SamplingParams
    from kernels_runtime.inference.chat import chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = Engine(AutoModelForCausalLM.from_pretrained(folder), "dp=1", comm=process_comm(),
                    tokenizer=tokenizer, verbose=False)
    greedy = SamplingParams(max_new_tokens=20)
    return {"completions": [o.text for o in engine.generate(PROMPTS, greedy)],
            "chat": engine.generate(chat_prompt(tokenizer, CHAT), greedy)[0].text}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return inf.save_hf_folder(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


def test_workbench_serve_answers_like_the_engine_and_drains_on_sigint(folder, ranks):
    from openai import OpenAI

    expected = ranks(1).run(_reference, str(folder), timeout_s=300)[0]
    with workbench_serve("--model", str(folder), "--plan", "tp=2", "--pool-size", "2",
                         "--api-key", "k-test") as served:
        client = OpenAI(base_url=served.url + "/v1", api_key="k-test", max_retries=0)
        for prompt, text in zip(PROMPTS, expected["completions"]):
            got = client.completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=20,
                                            temperature=0)
            assert got.choices[0].text == text
            streamed = client.completions.create(model="tiny-gpt2", prompt=prompt,
                                                 max_tokens=20, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in streamed) == text
        chat = client.chat.completions.create(model="tiny-gpt2", messages=CHAT, max_tokens=20,
                                              temperature=0)
        assert chat.choices[0].message.content == expected["chat"]
        streamed = client.chat.completions.create(model="tiny-gpt2", messages=CHAT,
                                                  max_tokens=20, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected["chat"]
    out = served.output
    assert served.proc.returncode == 0, out
    assert "serving tiny-gpt2 at" in out and "draining" in out
    # CPU ranks: paced by default (stream_pacing.py), said on the start line
    assert "tokens streamed at most every 40 ms, first and last at once" in out, out


def test_bad_invocations_fail_fast(tmp_path):
    from workbench.serving.server import free_port

    missing = subprocess.run([sys.executable, "-m", "workbench.cli", "serve", "--model",
                              str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "is not a model folder" in missing.stderr
    port = free_port()
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        (tmp_path / "config.json").write_text("{}")
        taken = subprocess.run([sys.executable, "-m", "workbench.cli", "serve", "--model",
                                str(tmp_path), "--port", str(port)], capture_output=True,
                               text=True, timeout=60)
    assert taken.returncode == 2 and "port is in use" in taken.stderr
    for bad in ("-1", "nan", "11"):
        paced = subprocess.run([sys.executable, "-m", "workbench.cli", "serve", "--model",
                                str(tmp_path), "--stream-interval", bad], capture_output=True,
                               text=True, timeout=60)
        assert paced.returncode == 2 and "give seconds from 0 to 10" in paced.stderr, bad
