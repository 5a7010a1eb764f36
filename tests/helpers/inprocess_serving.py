"""An endpoint served inside the test process: the real HTTP app, ``Server`` and ``Bridge``, and
one replica's leader running the real serving loop (``rank_side.serve_engine``) in a thread,
on a tiny engine of one gloo rank. No ipyparallel, no pool: what the bridge and the request
path do is on trial, fast enough for make test-fast.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from helpers.distributed import process_comm

KEY = "sk-test"


def tiny_engine() -> Any:
    """A 1-layer GPT-2 of random weights on byte tokens: thousands of tokens a second, with
    room for 4,000 of them (a request that runs for seconds when asked to)."""
    from kernels_runtime.data.corpus import ByteTokenizer
    from kernels_runtime.inference import Engine

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=4096, n_embd=32, n_layer=1,
                                       n_head=2)).eval()
    return Engine(model, comm=process_comm(), tokenizer=ByteTokenizer(), kv_mem="8MiB",
                  verbose=False)


def wait_until(condition: Any, timeout_s: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.01)


@contextmanager
def leader(engine: Any, bridge: Any) -> Iterator[dict[str, Any]]:
    """The engine's serving loop connected to ``bridge`` in a thread; yields what it ended with
    (``{"returned": ...}`` or ``{"raised": exception}``) once it has, stopping it at exit."""
    from workbench.serving import rank_side

    ended: dict[str, Any] = {}

    def run() -> None:
        try:
            ended["returned"] = rank_side.serve_engine(engine, bridge.address, bridge.secret,
                                                       bridge.server_key)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            ended["raised"] = err

    thread = threading.Thread(target=run, daemon=True)
    before = bridge.connected
    thread.start()
    wait_until(lambda: bridge.connected > before or ended, what="the leader's hello")
    ended["thread"] = thread
    try:
        yield ended
    finally:
        if thread.is_alive():
            bridge.stop_replicas()
            thread.join(30)
        assert not thread.is_alive(), "the leader did not leave its loop"


def server(bridge: Any, **kwargs: Any) -> Any:
    """A ``Server`` in front of ``bridge`` that takes requests (never started: no pool)."""
    from workbench.serving.server import Server

    out = Server(None, "tiny", api_key=KEY, **kwargs)
    out.bridge, out.accepting, out.replicas = bridge, True, 1
    return out


@asynccontextmanager
async def client(server: Any) -> Any:
    """An HTTP client of ``server``'s app, in this event loop (the bridge delivers to it)."""
    from workbench.serving.app import create_app

    server.bridge.loop = asyncio.get_running_loop()
    transport = httpx.ASGITransport(app=create_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60,
                                 headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c
