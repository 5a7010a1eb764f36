"""A request past its deadline is aborted on its replica and told so, never left running.

What is protected (issue 26, item 3): every request has a deadline, the endpoint's
``request_timeout_s`` (``workbench serve --request-timeout``) or the shorter ``timeout`` its
body asks for. A non-streaming request past it is a 504 naming the timeout; a streaming one
ends with an error event; either way the replica gets the abort (its finish comes back as
``abort``, so its KV blocks are freed) and serves the next request. A ``timeout`` that is not
a positive number is a 400 naming it; a longer one than the endpoint's is cut to the
endpoint's.

In-process (``helpers/inprocess_serving.py``): the real app, bridge and serving loop on a tiny
engine, whose 4,000-token requests run for seconds while the deadlines here are fractions of
one.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from workbench.serving.bridge import Bridge

from helpers import inprocess_serving as served
from helpers.inprocess_serving import wait_until

LONG = {"prompt": "def f(x", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    return served.tiny_engine()


@pytest.fixture
def endpoint(engine):
    """(server factory, the finish reasons the replica sent, by arrival)."""
    bridge = Bridge()
    finishes: list[str] = []
    bridge.on_delta = lambda d: d.get("finish_reason") and finishes.append(d["finish_reason"])
    with served.leader(engine, bridge):
        yield (lambda **kwargs: served.server(bridge, **kwargs)), finishes
    bridge.close()


def _run(server, *requests: dict) -> list:
    """POST each ``{"path", "json"}`` in turn to ``server``'s app; the responses. The body
    goes as Python's JSON, whose NaN and Infinity a hostile client can send too."""
    async def go() -> list:
        async with served.client(server) as client:
            return [await client.post(r.get("path", "/v1/completions"),
                                      content=json.dumps(r["json"]),
                                      headers={"Content-Type": "application/json"})
                    for r in requests]

    return asyncio.run(go())


def test_a_request_past_its_timeout_is_a_504_and_aborted_on_its_replica(endpoint):
    make, finishes = endpoint
    late, after = _run(make(), {"json": {**LONG, "timeout": 0.3}},
                       {"json": {"prompt": "import ", "max_tokens": 4}})
    assert late.status_code == 504, late.text
    error = late.json()["error"]
    assert error["type"] == "timeout" and error["code"] == "request_timeout", error
    assert "took longer than its timeout" in error["message"], error
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
    assert finishes == ["abort", "length"], finishes


def test_a_stream_past_its_timeout_ends_with_an_error_event(endpoint):
    make, finishes = endpoint
    (stream,) = _run(make(), {"path": "/v1/chat/completions", "json": {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
        "ignore_eos": True, "stream": True, "timeout": 0.3}})
    assert stream.status_code == 200, stream.text
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert len(events) > 2, events  # tokens streamed before the deadline
    last = json.loads(events[-1])
    assert last["error"]["type"] == "timeout" and "timeout" in last["error"]["message"], last
    assert "[DONE]" not in events
    wait_until(lambda: finishes == ["abort"], 10, f"the abort's finish ({finishes})")


def test_the_endpoints_timeout_applies_and_caps_the_bodys(endpoint):
    make, finishes = endpoint
    server = make(request_timeout_s=0.3)
    plain, longer = _run(server, {"json": LONG}, {"json": {**LONG, "timeout": 3600}})
    assert plain.status_code == 504 and longer.status_code == 504, (plain.text, longer.text)
    assert "allows 0.3 s" in plain.json()["error"]["message"], plain.text
    wait_until(lambda: finishes == ["abort", "abort"], 10, f"the aborts ({finishes})")


@pytest.mark.parametrize("timeout", [0, -1, "5", True, [1], float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_positive_number_is_a_400(timeout):
    bridge = Bridge()
    try:
        (r,) = _run(served.server(bridge), {"json": {**LONG, "timeout": timeout}})
    finally:
        bridge.close()
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text
    assert "timeout must be a number of seconds > 0" in r.json()["error"]["message"]


def test_the_server_and_the_cli_refuse_a_timeout_that_is_not_positive():
    from workbench.serving.options import seconds
    from workbench.serving.server import Server

    with pytest.raises(ValueError, match="request_timeout_s must be"):
        Server(None, "tiny", request_timeout_s=0)
    for bad in ("0", "-3", "soon", "inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds > 0"):
            seconds(bad)
    assert seconds("2.5") == 2.5


@pytest.mark.full
@pytest.mark.engines
def test_workbench_serve_times_out_a_long_request_and_serves_on(smollm2, smollm2_greedy):
    """The same through ``workbench serve --request-timeout`` of the real model on 2 dp
    replicas (a pool: make test-full): a request past its body's deadline is a 504, a stream
    past it ends with an error event, and then the greedy answer is still HF's."""
    import re

    import httpx
    from transformers import AutoTokenizer

    from workbench.serving import api_key

    from helpers import real_model
    from helpers.serve_cli import workbench_serve

    model = smollm2.folder.name
    long = {"model": model, "prompt": "Count: one, two,", "max_tokens": 2000,
            "ignore_eos": True, "timeout": 2}
    with workbench_serve("--model", str(smollm2.folder), "--plan", "dp=2",
                         "--request-timeout", "300") as served_cli:
        client = httpx.Client(base_url=served_cli.url, timeout=120, headers={
            "Authorization": f"Bearer {api_key(served_cli.port)}"})
        late = client.post("/v1/completions", json=long)
        assert late.status_code == 504 and "allows 300 s" in late.text, late.text
        stream = client.post("/v1/completions", json={**long, "stream": True})
        assert stream.status_code == 200, stream.text
        assert '"type": "timeout"' in stream.text.splitlines()[-2], stream.text[-500:]
        greedy = client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": real_model.NEW, "temperature": 0,
            "messages": [{"role": "user", "content": real_model.CHAT[0]}]})
        tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
        want = tokenizer.decode(smollm2_greedy.tokens[0], skip_special_tokens=True)
        assert greedy.status_code == 200, greedy.text
        assert greedy.json()["choices"][0]["message"]["content"] == want
        metrics = client.get("/metrics").text
        assert re.search(r'workbench_requests_total\{route="/v1/completions",status="504"\} '
                         r"[2-9]", metrics), metrics
        assert client.get("/health").status_code == 200
        client.close()
    assert served_cli.proc.returncode == 0, served_cli.output
    assert "Traceback" not in served_cli.output, served_cli.output
