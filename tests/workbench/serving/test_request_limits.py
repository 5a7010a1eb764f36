"""The endpoint's limits, each a clear 4xx decided before a request reaches the ranks.

What is protected (issue 26, item 3): a body past 8 MiB is a 413 (from its Content-Length,
unread, or once a chunked body passes the limit), JSON nested 10,000 deep a 400, a non-ASCII
or wrong key a 401 (never the 500 ``compare_digest`` gave on non-ASCII ``str``), requests past
``max_inflight`` a 429 with ``Retry-After``; in the body, a seed outside a signed 64-bit
range, more than 4 stop strings or one past 256 characters, and a content part whose text is
not a string are 400s naming the parameter. These run in-process against the real app of an
unstarted ``Server`` (none of them reaches the bridge); ``test_hostile_clients.py`` sends the
same requests to ``workbench serve`` of a real model with good streams running.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

KEY = "sk-test"


def _post(server, body: bytes | None = None, key: str | bytes = KEY, chunks=None,
          path: str = "/v1/chat/completions") -> httpx.Response:
    from workbench.serving.app import create_app

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            auth = key if isinstance(key, bytes) else f"Bearer {key}".encode()
            content = body
            if chunks is not None:
                async def stream():
                    for c in chunks:
                        yield c
                content = stream()
            return await client.post(path, content=content, headers={
                "Authorization": auth, "Content-Type": "application/json"})

    return asyncio.run(go())


@pytest.fixture
def server():
    from workbench.serving.server import Server

    return Server(None, "engine", api_key=KEY)


def test_bodies_past_the_limit_or_too_deep_are_refused(server):
    from workbench.serving.app import MAX_BODY

    big = b'{"messages": "' + b"a" * (MAX_BODY + 10) + b'"}'
    r = _post(server, big)
    assert r.status_code == 413 and "8 MiB" in r.json()["error"]["message"], r.text
    chunked = _post(server, chunks=[b'{"messages": "'] + [b"a" * 2**20] * 9 + [b'"}'])
    assert chunked.status_code == 413, chunked.text
    deep = _post(server, b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]


@pytest.mark.parametrize("auth", ["Bearer cl\u00e9-\u4e2d".encode(), b"Bearer \xff\xfe",
                                  b"Bearer wrong", b"Basic abc", b""])
def test_a_wrong_or_non_ascii_key_is_401(server, auth):
    r = _post(server, b"{}", key=auth)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert r.headers["WWW-Authenticate"] == "Bearer"


def test_requests_past_max_inflight_get_429_with_retry_after(server):
    server.max_inflight, server.active = 3, 3
    r = _post(server, b"{}")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
    assert "maximum of 3 requests" in r.json()["error"]["message"]


def _chat(**extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **extra}).encode()


@pytest.mark.parametrize("extra, param, says", [
    ({"seed": 2**64}, "seed", "seed must be an integer in [0, 9223372036854775807]"),
    ({"seed": -1}, "seed", "got -1"),
    ({"stop": [f"s{i}" for i in range(1000)]}, "stop", "at most 4 strings, got 1000"),
    ({"stop": "x" * 257}, "stop", "at most 256 characters"),
    ({"stop": [["nested"]]}, "stop", "list of non-empty strings"),
    ({"ignore_eos": "yes"}, "ignore_eos", "ignore_eos must be true or false"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
     'needs a string "text"'),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     'needs a string "text"'),
])
def test_bad_fields_are_400_naming_the_parameter(extra, param, says):
    from workbench.serving.openai_api import ApiError, chat_request

    with pytest.raises(ApiError) as err:
        chat_request(json.loads(_chat(**extra)))
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert says in err.value.message, err.value.message


def test_limits_at_their_edge_are_accepted():
    from workbench.serving.openai_api import chat_request

    messages, params = chat_request(json.loads(_chat(seed=2**63 - 1, stop=["x" * 256] * 4)))
    assert params["seed"] == 2**63 - 1 and len(params["stop"]) == 4
    messages, _ = chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert messages == [{"role": "user", "content": "ab"}]
