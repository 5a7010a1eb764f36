"""The serving bridge stays up whatever reaches its port, and says so when it cannot.

What is protected (issue 26, item 4, its Must-show): the bridge fed each kind of malformed
message (a wrong part count, bytes that are not UTF-8, not JSON, JSON that is not an object, a
hello whose secret is not a string, a wrong or non-ASCII secret, a hello posing as another
replica, a message from a peer that never said hello, an unknown kind, a bad delta, a message
past ``MAXMSGSIZE``) logs each kind once, drops it and serves on: a later request completes
with the text the engine generates alone, plain and over CURVE. A leader without the bridge's
CURVE key cannot say hello. A leader that goes away ends its requests with an error
(``ROUTER_MANDATORY``) and leaves the rotation; one whose queue is full makes a request an
error, not a silent drop; the bridge's own full send queue is a 503 with ``Retry-After``.
With the bridge's thread killed, ``/health`` is a 503 naming why and a request in flight
ends with it. An engine step that raises ends the replica's requests with
a 500 naming the cause and takes the replica out (``/health`` 503), never a hang.

In-process (``helpers/inprocess_serving.py``): the real bridge, app and serving loop on a
tiny engine; hostile peers are raw ZeroMQ DEALER sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import zmq

from kernels_runtime.inference import SamplingParams
from kernels_runtime.inference.commands import Command
from workbench.serving import bridge as bridge_module
from workbench.serving.bridge import MAX_MESSAGE, Bridge, is_loopback

from helpers import inprocess_serving as served
from helpers.inprocess_serving import wait_until

PROMPT = "def f(x"


@pytest.fixture(scope="module")
def engine():
    return served.tiny_engine()


@pytest.fixture(autouse=True)
def quick_heartbeat(monkeypatch):
    monkeypatch.setattr(bridge_module, "HEARTBEAT_S", 0.05)  # a gone peer is seen at once


def _peer(bridge: Bridge, identity: bytes, server_key: str | None = None,
          rcvhwm: int | None = None) -> zmq.Socket:
    """A raw DEALER connected to the bridge as ``identity`` (CURVE with ``server_key``)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        socket.setsockopt(zmq.RCVHWM, rcvhwm)
    socket.setsockopt(zmq.ROUTING_ID, identity)
    if server_key is not None:
        public, private = zmq.curve_keypair()
        socket.curve_publickey, socket.curve_secretkey = public, private
        socket.curve_serverkey = server_key.encode()
    socket.connect(bridge.address)
    return socket


def _got_request(peer: zmq.Socket, rid: str | None = None) -> bool:
    """Whether a request (``rid``, or any) has reached ``peer``; heartbeats are skipped."""
    while peer.poll(0):
        message = json.loads(peer.recv())
        if message.get("kind") in ("completion", "chat") and rid in (None,
                                                                     message["request_id"]):
            return True
    return False


def _hello(secret: object, replica: object = 7) -> bytes:
    return json.dumps({"hello": secret, "replica": replica}).encode()


async def _complete(bridge: Bridge, rid: str, prompt: str = PROMPT,
                    params: dict | None = None) -> tuple[dict, str]:
    """Submit a request through the bridge; its last delta and its whole text."""
    bridge.loop = asyncio.get_running_loop()
    queue = bridge.submit(Command("completion", rid, prompt, params or {"max_new_tokens": 8}))
    text = ""
    while True:
        delta = await asyncio.wait_for(queue.get(), 30)
        text += delta.get("text") or ""
        if delta["finish_reason"] is not None:
            return delta, text


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_each_malformed_message_kind_is_dropped_and_a_later_request_completes(
        engine, curve, caplog):
    alone = engine.generate([PROMPT], SamplingParams(max_new_tokens=8))[0].text
    bridge = Bridge(curve=curve)
    assert (bridge.server_key is not None) == curve
    assert bridge.socket.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE
    caplog.set_level(logging.WARNING, logger="workbench.serving.bridge")
    try:
        with served.leader(engine, bridge) as ended:
            hostile = _peer(bridge, b"leader-7", bridge.server_key)
            garbage = {  # kind -> messages of it (each kind twice: logged once)
                "parts": [[b"a", b"b"], [b"", b"", b""]],
                "not UTF-8": [[b"\xff\xfe{}"], [b'{"hello": "\xc3"}']],
                "not JSON": [[b"{not json"], [b"[" * 100_000]],
                "not an object": [[b"[1, 2]"], [b'"hello"']],
                "hello": [[_hello(5)], [_hello(None)]],
                "secret": [[_hello("cl\u00e9-\u4e2d")], [_hello("\ud800")],
                           [_hello("0" * 32)]],
                "identity": [[_hello(bridge.secret, 0)], [_hello(bridge.secret, "7")]],
                "stranger": [[json.dumps({"deltas": [{"id": "x"}]}).encode()]] * 2,
            }
            for messages in garbage.values():
                for frames in messages:
                    hostile.send_multipart(frames)
            # admitted as the replica it says it is, it sends what no leader sends
            hostile.send(_hello(bridge.secret, 7))
            wait_until(lambda: bridge.connected == 2, what="the hostile peer's admission")
            after_hello = {
                "kind": [[b'{"what": 1}'], [b'{"deltas": "all"}']],
                "delta": [[b'{"deltas": [5]}'], [b'{"deltas": [{"id": 3}]}']],
            }
            for messages in after_hello.values():
                for frames in messages:
                    hostile.send_multipart(frames)
            garbage.update(after_hello)
            want = {kind: len(messages) for kind, messages in garbage.items()}
            wait_until(lambda: dict(bridge.dropped) == want, 10,
                       what=f"dropping {want} (dropped {dict(bridge.dropped)})")
            hostile.close(0)  # gone: the next heartbeat to it fails, it leaves the rotation
            wait_until(lambda: bridge.connected == 1, what="the gone peer's removal")
            big = _peer(bridge, b"leader-8", bridge.server_key)
            big.send(b"x" * (MAX_MESSAGE + 1))  # ZeroMQ drops its connection unread
            big.close(2000)

            last, text = asyncio.run(_complete(bridge, "later"))
            assert last["finish_reason"] == "length" and text == alone, (last, text)
            assert dict(bridge.dropped) == want  # the big one never reached the bridge
            assert bridge.failure is None and not ended.get("raised")
    finally:
        bridge.close()
    logged = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(logged) == len(want), logged  # each kind once, however often it came
    assert {kind for kind in want if any(f"({kind}:" in m for m in logged)} == set(want)


def test_a_leader_without_the_bridges_curve_key_cannot_say_hello():
    bridge = Bridge(curve=True)
    other_server_key = zmq.curve_keypair()[0].decode()
    peers = [_peer(bridge, b"leader-0", other_server_key),  # the wrong server key
             _peer(bridge, b"leader-1"),  # plain text to a CURVE server
             _peer(bridge, b"leader-2", bridge.server_key)]
    try:
        for replica, peer in enumerate(peers):
            peer.send(_hello(bridge.secret, replica))
        wait_until(lambda: bridge.connected == 1, what="the keyed leader's admission")
        assert peers[2].poll(5000), "the admitted leader hears no heartbeat"
        assert json.loads(peers[2].recv()) == bridge_module.HEARTBEAT
        assert not peers[0].poll(300) and not peers[1].poll(0)
        assert list(bridge.replicas) == [b"leader-2"] and not bridge.dropped
    finally:
        for peer in peers:
            peer.close(0)
        bridge.close()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.1.2.3") and not is_loopback("0.0.0.0")


def test_a_gone_leader_ends_its_requests_and_a_busy_one_is_an_error(monkeypatch):
    bridge = Bridge()
    peer = _peer(bridge, b"leader-0")
    try:
        peer.send(_hello(bridge.secret, 0))
        wait_until(lambda: bridge.connected == 1, what="the peer's admission")

        async def gone() -> dict:
            bridge.loop = asyncio.get_running_loop()
            queue = bridge.submit(Command("completion", "r-gone", PROMPT))
            await asyncio.to_thread(wait_until, lambda: _got_request(peer, "r-gone"), 10,
                                    "the request's arrival")
            peer.close(0)
            return await asyncio.wait_for(queue.get(), 30)

        delta = asyncio.run(gone())
        assert delta["finish_reason"] == "error" and delta["status"] == 503, delta
        assert "replica 0 is gone" in delta["error"], delta
        assert bridge.connected == 0 and "replica 0 is gone" in bridge.problem()
    finally:
        bridge.close()

    monkeypatch.setattr(bridge_module, "SEND_HWM", 1)
    bridge = Bridge()
    peer = _peer(bridge, b"leader-0", rcvhwm=1)
    try:
        peer.send(_hello(bridge.secret, 0))
        wait_until(lambda: bridge.connected == 1, what="the peer's admission")

        async def busy() -> list[dict]:  # the peer reads nothing: its queues fill up
            bridge.loop = asyncio.get_running_loop()
            big = "x" * 2**20
            queues = [bridge.submit(Command("completion", f"r{i}", big)) for i in range(48)]
            for _ in range(1000):  # until the first refusal is back (10 s at most)
                if any(not q.empty() for q in queues):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the rest of that turn's sends
            return [q.get_nowait() for q in queues if not q.empty()]

        refused = asyncio.run(busy())
        assert refused and all(d["status"] == 503 and "is busy" in d["error"]
                               for d in refused), refused
        assert bridge.failure is None and bridge.connected == 1
    finally:
        peer.close(0)
        bridge.close()


def test_a_killed_bridge_thread_fails_health_and_its_request_in_flight():
    bridge = Bridge()
    peer = _peer(bridge, b"leader-0")  # a leader that takes requests and never answers
    server = served.server(bridge)

    async def scenario() -> tuple:
        async with served.client(server) as client:
            healthy = await client.get("/health")
            post = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi"}))
            await asyncio.to_thread(wait_until, lambda: _got_request(peer), 10,
                                    "the request's arrival")
            bridge.inject_fault(RuntimeError("injected by the test"))
            answer = await post
            return healthy, answer, await client.get("/health")

    try:
        peer.send(_hello(bridge.secret, 0))
        wait_until(lambda: bridge.connected == 1, what="the peer's admission")
        healthy, answer, health = asyncio.run(scenario())
        assert healthy.status_code == 200, healthy.text
        assert answer.status_code == 503 and "thread died" in answer.text, answer.text
        assert health.status_code == 503, health.text
        reason = health.json()["error"]["message"]
        assert "thread died" in reason and "injected by the test" in reason, reason
    finally:
        peer.close(0)
        bridge.close()


def test_a_failing_engine_step_is_a_500_naming_it_and_takes_the_replica_out(monkeypatch):
    engine = served.tiny_engine()  # its own: a failed step leaves it unusable

    def broken(batch):
        raise RuntimeError("CUDA error: an illegal memory access (injected)")

    monkeypatch.setattr(engine.runner, "forward", broken)
    bridge = Bridge()
    server = served.server(bridge)

    async def scenario() -> tuple:
        async with served.client(server) as client:
            answer = await client.post("/v1/completions", json={"prompt": PROMPT})
            await asyncio.to_thread(wait_until, lambda: bridge.connected == 0, 10,
                                    "the replica's removal")
            return answer, await client.get("/health")

    try:
        with served.leader(engine, bridge) as ended:
            answer, health = asyncio.run(scenario())
            wait_until(lambda: not ended["thread"].is_alive(), what="the loop's end")
        assert answer.status_code == 500, answer.text
        message = answer.json()["error"]["message"]
        assert "engine.step() failed" in message and "illegal memory access" in message
        assert type(ended["raised"]).__name__ == "ReplicaFailed", ended
        assert health.status_code == 503 and "replica 0 failed" in health.text, health.text
        assert bridge.connected == 0 and bridge.failure is None
    finally:
        bridge.close()


def test_a_full_send_queue_is_a_503_with_retry_after(monkeypatch):
    monkeypatch.setattr(bridge_module, "MAX_PENDING", 0)  # every request finds it full
    bridge = Bridge()
    peer = _peer(bridge, b"leader-0")

    async def post() -> object:
        async with served.client(served.server(bridge)) as client:
            return await client.post("/v1/completions", json={"prompt": "hi"})

    try:
        peer.send(_hello(bridge.secret, 0))
        wait_until(lambda: bridge.connected == 1, what="the peer's admission")
        r = asyncio.run(post())
    finally:
        peer.close(0)
        bridge.close()
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
    assert "requests waiting to be sent" in r.json()["error"]["message"], r.text
    assert not bridge.queues and not bridge.owner and bridge.replicas == {b"leader-0": 0}
