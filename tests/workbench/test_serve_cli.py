"""``workbench serve`` from a shell: a ``save_pretrained`` folder (a tiny GPT-2 with its own BPE
tokenizer and chat template) served by a pool of its own under tp=2, called with the official
``openai`` client: greedy completions and chat completions, streamed and not, equal
``engine.generate`` of an engine built in one process on the same folder; SIGINT drains and
exits cleanly. Bad invocations fail fast with a clear message.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from helpers import inference as inf
from helpers.distributed import process_comm

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

    from workbench.serving.server import free_port

    expected = ranks(1).run(_reference, str(folder), timeout_s=300)[0]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "serve", "--model", str(folder), "--plan",
         "tp=2", "--pool-size", "2", "--port", str(port), "--api-key", "k-test"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        client = OpenAI(base_url=url + "/v1", api_key="k-test", max_retries=0)
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
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "serving tiny-gpt2 at" in out and "draining" in out


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
