"""``workbench serve`` of the real SmolLM2 on 2 dp replicas against hostile clients.

What is protected (issue 26's Must-show): with 4 good streams running, each hostile request
(a seed past 64 bits and a negative one, a content part whose text is not a string, a
``developer`` role, two user turns in a row, a 20 MB body, 10,000-deep JSON, 1,000 stop
strings, ``max_tokens`` 10**9, a non-ASCII key, a wrong key) gets a 4xx, or a 200 where the
request is legitimate (SmolLM2's template takes any role and any order), never a 500 or a
dropped connection; the 4 good streams complete with their text; requests past
``--max-inflight`` get a 429 with ``Retry-After``; a non-streaming client that goes away has
its request aborted (the 499 in ``/metrics``); and afterwards the same greedy request returns
the same text as before, so no replica's loop ended or drifted.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from helpers import real_model
from helpers.serve_cli import workbench_serve

pytestmark = [pytest.mark.full, pytest.mark.engines]  # the real model on 2 ranks, ~1 min

MAX_INFLIGHT = 5  # the 4 good streams and one hostile request at a time
LONG = {"prompt": "Count from one to a thousand: one, two, three,", "max_tokens": 400,
        "temperature": 0, "ignore_eos": True}  # seconds of generation, whatever it says


def hostile(model: str) -> dict[str, tuple[dict[str, Any], set[int]]]:
    """name -> (httpx.post keywords against /v1/chat/completions, the statuses allowed)."""
    def chat(**extra: Any) -> dict[str, Any]:
        return {"json": {"model": model, "max_tokens": 8, "temperature": 0,
                         "messages": [{"role": "user", "content": "Hi"}], **extra}}

    deep = b'{"model": "x", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    big = json.dumps({"model": model, "messages": [
        {"role": "user", "content": "a " * 10_000_000}]}).encode()  # 20 MB
    return {
        "seed 2**64": (chat(seed=2**64, temperature=1.0), {400}),
        "seed -1": (chat(seed=-1, temperature=1.0), {400}),
        "non-string part": (chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": {"nested": 1}}]}]), {400}),
        "developer role": (chat(messages=[{"role": "developer", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}]), {200, 400}),
        "two user turns": (chat(messages=[{"role": "user", "content": "Hi"},
                                          {"role": "user", "content": "Hello?"}]), {200, 400}),
        "20 MB body": ({"content": big}, {413}),
        "10,000-deep JSON": ({"content": deep}, {400}),
        "1,000 stop strings": (chat(stop=[f"s{i}" for i in range(1000)]), {400}),
        "max_tokens 10**9": (chat(max_tokens=10**9), {400}),
        "non-ASCII key": ({**chat(), "headers": {
            "Authorization": "Bearer cl\u00e9-\u4e2d".encode()}}, {401}),
        "wrong key": ({**chat(), "headers": {"Authorization": "Bearer not-the-key"}}, {401}),
    }


def stream_text(client: httpx.Client, body: dict[str, Any], started: threading.Event,
                out: list[str]) -> None:
    """One good stream, read to ``[DONE]``; its text appended to ``out``."""
    text, done = "", False
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            started.set()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    assert done, text
    out.append(text)


def test_hostile_requests_beside_good_streams_get_4xx_and_leave_the_replicas_serving(
        smollm2, smollm2_greedy):
    from transformers import AutoTokenizer

    from workbench.serving import api_key

    tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
    model = smollm2.folder.name
    with workbench_serve("--model", str(smollm2.folder), "--plan", "dp=2",
                         "--max-inflight", str(MAX_INFLIGHT)) as served:
        key = api_key(served.port)
        client = httpx.Client(base_url=served.url, timeout=120,
                              headers={"Authorization": f"Bearer {key}"})
        greedy = {"model": model, "max_tokens": real_model.NEW, "temperature": 0,
                  "messages": [{"role": "user", "content": real_model.CHAT[0]}]}
        before = client.post("/v1/chat/completions", json=greedy)
        assert before.status_code == 200, before.text
        want = tokenizer.decode(smollm2_greedy.tokens[0], skip_special_tokens=True)
        assert before.json()["choices"][0]["message"]["content"] == want

        # 4 good streams, running while every hostile request is sent
        texts: list[str] = []
        errors: list[BaseException] = []
        started = [threading.Event() for _ in range(4)]

        def good(i: int) -> None:
            try:
                stream_text(client, {**greedy, "max_tokens": 48, "messages": [
                    {"role": "user", "content": real_model.CHAT[i]}]}, started[i], texts)
            except BaseException as err:  # noqa: BLE001 - reported by the main thread
                errors.append(err)

        threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for event in started:
            assert event.wait(120), "a good stream never started"
        answers = {}
        for name, (kwargs, allowed) in hostile(model).items():
            kwargs = dict(kwargs)
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                       **kwargs.pop("headers", {})}
            r = httpx.post(served.url + "/v1/chat/completions", headers=headers, timeout=120,
                           **kwargs)  # a dropped connection raises here
            answers[name] = (r.status_code, r.text[:200])
            assert r.status_code in allowed, (name, r.status_code, r.text[:500])
            if r.status_code == 401:
                assert r.headers["WWW-Authenticate"] == "Bearer"
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert len(texts) == 4 and all(texts), texts
        assert "2**63" in answers["seed 2**64"][1] or "9223372036854775807" in \
            answers["seed 2**64"][1], answers
        assert "context" in answers["max_tokens 10**9"][1], answers

        # past --max-inflight: a 429 with Retry-After while MAX_INFLIGHT streams are open
        held = []
        try:
            for _ in range(MAX_INFLIGHT):
                r = client.send(client.build_request("POST", "/v1/completions", json={
                    "model": model, **LONG, "stream": True}), stream=True)
                assert r.status_code == 200
                held.append(r)
            refused = client.post("/v1/completions", json={"model": model, "prompt": "Hi"})
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
        finally:
            for r in held:
                r.close()  # the clients go away: their requests are aborted

        # once the held clients' streams are torn down, capacity is back
        deadline = time.monotonic() + 60
        while (probe := client.post("/v1/completions", json={
                "model": model, "prompt": "Hi", "max_tokens": 1})).status_code == 429:
            assert time.monotonic() < deadline, "capacity never came back after the aborts"
            time.sleep(0.2)
        assert probe.status_code == 200, probe.text

        # a non-streaming client that gives up: its request is aborted (a 499 is counted)
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", timeout=3, json={"model": model, **LONG})
        after = client.post("/v1/chat/completions", json=greedy)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["message"]["content"] == want
        metrics = client.get("/metrics").text
        assert re.search(r'workbench_requests_total\{route="/v1/completions",status="499"\} '
                         r"[1-9]", metrics), metrics
        assert httpx.get(served.url + "/health").status_code == 200
        client.close()
    assert served.proc.returncode == 0, served.output
    assert "Traceback" not in served.output, served.output
