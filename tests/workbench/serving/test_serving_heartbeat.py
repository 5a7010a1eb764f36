"""A replica's leader whose server went silent stops instead of polling a dead bridge.

When the kernel holding the HTTP server dies, nothing tells the ranks; the bridge's heartbeat
(``bridge.HEARTBEAT_S``) is what a live server sends even with no request. A leader that hears
nothing for ``rank_side.HEARTBEAT_MISS_S`` aborts what it runs and stops its replica. Here a
ROUTER socket plays the server: it admits the leader, sends one long request and then goes
silent (a heartbeat miss limit of 1 s keeps the test short); ``serve_engine`` must return and
the request end as aborted, the way every rank of a replica leaves the loop together.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import zmq
from transformers import GPT2Config, GPT2LMHeadModel

from kernels_runtime.data.corpus import ByteTokenizer
from kernels_runtime.inference import Engine
from kernels_runtime.inference.commands import Command
from workbench.serving import bridge as bridge_module
from workbench.serving import rank_side
from workbench.serving.bridge import Bridge

from helpers.distributed import process_comm


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=4096, n_embd=32, n_layer=1,
                                       n_head=2)).eval()
    return Engine(model, comm=process_comm(), tokenizer=ByteTokenizer(), kv_mem="8MiB",
                  verbose=False)


def _serve_in_thread(engine, address: str, secret: str, ended: list[str]) -> threading.Thread:
    leader = threading.Thread(target=lambda: ended.append(rank_side.serve_engine(
        engine, address, secret)), daemon=True)
    leader.start()
    return leader


def test_a_live_bridge_keeps_an_idle_leader_and_a_closed_one_stops_it(engine, monkeypatch):
    miss_s = 0.5  # with beats every 0.1 s: five in a miss limit, the test stays short
    monkeypatch.setattr(bridge_module, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(rank_side, "HEARTBEAT_MISS_S", miss_s)
    bridge = Bridge()
    ended: list[str] = []
    leader = _serve_in_thread(engine, bridge.address, bridge.secret, ended)
    try:
        deadline = time.monotonic() + 30
        while bridge.connected == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bridge.connected == 1
        leader.join(timeout=2 * miss_s)  # idle past the miss limit: the heartbeat keeps it
        assert leader.is_alive(), f"an idle leader of a live bridge stopped: {ended}"
    finally:
        bridge.close()
    leader.join(timeout=miss_s + 10)
    assert not leader.is_alive() and ended == ["stopped"]


def test_a_leader_that_misses_the_heartbeat_aborts_its_requests_and_stops(engine, monkeypatch):
    monkeypatch.setattr(rank_side, "HEARTBEAT_MISS_S", 1.0)
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    secret = "s3cret"
    ended: list[str] = []
    leader = _serve_in_thread(engine, f"tcp://127.0.0.1:{port}", secret, ended)
    try:
        assert server.poll(30_000), "the leader never said hello"
        identity, hello = server.recv_multipart()
        assert json.loads(hello)["hello"] == secret
        request = Command("completion", "r1", "def f(x", {"max_new_tokens": 4000,
                                                          "temperature": 0.0})
        server.send_multipart([identity, json.dumps(request.to_json()).encode()])
        # from here on the "server" is dead: it sends nothing, not even a heartbeat
        leader.join(timeout=60)
        assert not leader.is_alive(), "the leader still polls a silent server"
        assert ended == ["stopped"]
        # the leader's last messages may still be on their way when its thread has ended
        # (closing a socket does not wait for delivery): read until the finish came and
        # nothing more follows it
        finishes = []
        while server.poll(200 if finishes else 5_000):
            _, payload = server.recv_multipart()
            finishes += [d["finish_reason"] for d in json.loads(payload)["deltas"]
                         if d["id"] == "r1" and d["finish_reason"]]
        assert finishes == ["abort"], finishes
        assert not engine.has_unfinished()
    finally:
        server.close(0)
