"""``Server``: an OpenAI-compatible endpoint in front of an engine that lives on the pool's ranks.

Lifecycle: ``start`` checks the port, binds the bridge the replica leaders connect to
(``bridge.py``), starts the serving loop on every rank as one long task (``rank_side.py``: the
pool belongs to the server from then on), starts uvicorn in a thread of this process, and waits
until every replica has connected. A watcher thread follows the ranks: a rank that dies or a
loop that fails makes the endpoint answer 503 with the reason (requests in flight end with it),
and it feeds ``/metrics`` and the dashboard from the ranks' telemetry. ``resume`` starts the
loop again on a restarted pool. ``stop`` drains: new requests get 503, requests in flight
finish, then the ranks leave their loop and uvicorn shuts down. A request that takes longer
than ``request_timeout_s`` (or the shorter ``timeout`` its body asks for) is aborted on its
replica and answered 504 (``app.py``), so a stuck request never holds a client forever.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

from workbench.errors import PoolError
from workbench.serving.bridge import Bridge
from workbench.serving.metrics import Metrics
from workbench.serving.profile import ServingProfile

_RUNNING: list[Server] = []
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # workbench serve --request-timeout
# workbench serve --stream-interval: a request's tokens go out at most this often, its first
# and its end at once (kernels_runtime/inference/stream_pacing.py says why and what it saves).
# By default paced on CPU ranks only, which share the host's cores with the server; GPU ranks
# leave the host's cores to it, so every step streams there.
CPU_STREAM_INTERVAL_S = 0.04
MAX_STREAM_INTERVAL_S = 10.0  # beyond it a stream is no stream: ask without "stream"


def running_servers() -> list[Server]:
    return [s for s in _RUNNING if s.running]


def check_port(host: str, port: int) -> None:
    """A clear error for a port in use (before anything else starts)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as uvicorn binds: the connections of an endpoint just stopped on this port (TIME_WAIT)
    # do not make it busy, a listener does
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((host, port))
    except OSError as err:
        raise PoolError(f"cannot serve on {host}:{port}: {err.strerror}; the port is in use "
                        "(another endpoint or program): choose another with --port") from None
    finally:
        probe.close()


def free_port(host: str = "127.0.0.1") -> int:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind((host, 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


class Server:
    def __init__(self, pool: Any, engine: str, *, model_id: str | None = None,
                 host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 stream_interval_s: float | None = None,
                 profile: bool = False) -> None:
        """``profile``: split each streamed token's time into its hops (``profile.py``), read
        from ``self.profile`` once the requests are answered; off, nothing is stamped.
        ``stream_interval_s``: how often at most a request's new tokens are streamed
        (``stream_pacing.py``); None: ``CPU_STREAM_INTERVAL_S`` where the ranks are CPU ranks,
        else every step."""
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be a number of seconds > 0, got "
                             f"{request_timeout_s!r}")
        if stream_interval_s is not None and not 0 <= stream_interval_s <= MAX_STREAM_INTERVAL_S:
            raise ValueError(f"stream_interval_s must be between 0 and "
                             f"{MAX_STREAM_INTERVAL_S:g} seconds, got {stream_interval_s!r}")
        self.stream_interval_s = stream_interval_s  # resolved by start() where None
        self.pool, self.engine, self.host, self.port = pool, engine, host, port
        self.request_timeout_s = request_timeout_s  # the most a request may take (app.py)
        self.model_id = model_id or engine
        self.adapters: list[str] = []  # LoRA adapters' names, read from the engine at start
        self.api_key = api_key
        self.created = int(time.time())
        self.metrics = Metrics()
        self.profile = ServingProfile() if profile else None
        self.bridge: Bridge | None = None
        self.task: Any = None  # the ranks' serving loop (an ipyparallel AsyncResult)
        self.failure: str | None = None  # why the ranks cannot serve now
        self.accepting = False
        self.active = 0  # HTTP requests being answered (streams until their last event)
        self.max_inflight: int | None = None  # the most answered at once (None: app.py's)
        self.running = False
        self.replicas = 0
        self.rebuild: tuple[str, str] | None = None  # (magic line, code) that built the engine
        self.telemetry: dict[int, dict[str, Any]] = {}  # rank -> its latest published data
        self._uvicorn: Any = None
        self._threads: list[threading.Thread] = []
        self._stop_watch = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def unavailable(self) -> str | None:
        if not self.accepting:
            return f"the endpoint {self.url} is stopping and takes no new requests"
        if self.failure:
            return self.failure
        problem = self.bridge.problem() if self.bridge is not None else None
        if problem:  # its thread died, or every replica's leader is gone or failed
            return problem
        if self.bridge is None or self.bridge.connected == 0:
            return "the ranks' serving loop is not connected yet"
        return None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, connect_timeout_s: float = 120.0) -> Server:
        import uvicorn

        from workbench.serving.app import create_app

        check_port(self.host, self.port)
        self.replicas = self._check_engine()
        self.bridge = Bridge(self.pool.launcher.controller_ip)
        self.bridge.on_delta = self._on_delta
        bridge = self.bridge
        self.metrics.in_flight.set_function(lambda: len(bridge.queues))
        config = uvicorn.Config(create_app(self), host=self.host, port=self.port,
                                log_level="warning", lifespan="off")
        self._uvicorn = uvicorn.Server(config)
        web = threading.Thread(target=self._serve_http, name="workbench-serving-http",
                               daemon=True)
        web.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not web.is_alive() or time.monotonic() > deadline:
                self.bridge.close()
                raise PoolError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.running = True
        _RUNNING.append(self)
        watch = threading.Thread(target=self._watch, name="workbench-serving-watch", daemon=True)
        watch.start()
        self._threads = [web, watch]
        self.resume(connect_timeout_s)
        return self

    def _check_engine(self) -> int:
        """Every rank holds an ``Engine`` under the name; how many replicas it has. The LoRA
        adapters it serves become ``adapters`` (the names clients give as ``model``)."""
        from workbench.serving.rank_side import describe_engine

        found = self.pool.view().apply_sync(describe_engine, self.engine)
        wrong = [(r, what) for r, what in enumerate(found) if isinstance(what, str)]
        if wrong:
            rank, what = wrong[0]
            raise PoolError(f"`{self.engine}` on rank {rank} is {what}; serve an inference "
                            f"Engine with a tokenizer, built in a %%colossal cell first "
                            f"({self.engine} = Engine(model, plan, tokenizer=...))")
        self.adapters = list(found[0]["adapters"])
        if self.stream_interval_s is None:  # paced where the ranks share the host's cores
            cpu = any(f["device"] == "cpu" for f in found)
            self.stream_interval_s = CPU_STREAM_INTERVAL_S if cpu else 0.0
        return max(f["replica"] for f in found) + 1

    def pacing(self) -> str:
        """How the endpoint streams, for its start line."""
        every = self.stream_interval_s or 0.0
        return ("tokens streamed as each step makes them" if every == 0 else
                f"tokens streamed at most every {every * 1e3:g} ms, first and last at once "
                f"(--stream-interval 0: every step)")

    def _serve_http(self) -> None:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        self.bridge.loop = loop
        loop.run_until_complete(self._uvicorn.serve())

    def resume(self, connect_timeout_s: float = 120.0) -> None:
        """Start the serving loop on the pool's ranks (again, after a restart) and wait until
        every replica has connected."""
        assert self.bridge is not None
        self.bridge.forget_replicas()
        self.failure = None
        code = (f"import workbench.serving.rank_side as _wb_serving\n"
                f"_wb_serving.serve_engine({self.engine}, {self.bridge.address!r}, "
                f"{self.bridge.secret!r}, {self.bridge.server_key!r}, "
                f"profile={self.profile is not None}, "
                f"stream_interval_s={self.stream_interval_s!r})\n")
        self.task = self.pool.view().execute(code, silent=True, block=False)
        replicas = self.replicas
        deadline = time.monotonic() + connect_timeout_s
        while self.bridge.connected < replicas:
            if self.task.done() or time.monotonic() > deadline:
                self.accepting = False
                error = _task_error(self.task) or "the ranks did not connect in time"
                self.failure = f"the ranks could not start serving {self.engine}: {error}"
                raise PoolError(self.failure)
            time.sleep(0.02)
        self.accepting = True

    def stop(self, drain_timeout_s: float = 300.0) -> None:
        """Refuse new requests, let the ones in flight finish, then stop the ranks' loop and
        the HTTP server."""
        if not self.running:
            return
        self.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while (self.active or self.bridge.queues) and self.failure is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.failure is None and self.task is not None and not self.task.done():
            self.bridge.stop_replicas()
            self.task.wait(max(1.0, deadline - time.monotonic()))
        self._stop_watch.set()
        self._uvicorn.should_exit = True
        for t in self._threads:
            t.join(timeout=10)
        self.bridge.close()
        self.running = False
        if self in _RUNNING:
            _RUNNING.remove(self)

    # ---- watching the ranks ---------------------------------------------------------------
    def _on_delta(self, delta: dict[str, Any]) -> None:
        if delta.get("token_ids"):
            self.metrics.generation_tokens.inc(len(delta["token_ids"]))
        if delta.get("finish_reason") is not None:
            self.metrics.finished(delta)

    def _watch(self) -> None:
        from kernels_runtime.telemetry import TELEMETRY_KEY

        while not self._stop_watch.wait(0.2):
            task = self.task
            if task is None:
                continue
            dead = self.pool.dead_ranks()
            if (dead or task.done()) and self.accepting and self.failure is None:
                why = _task_error(task) if task.done() else None
                if dead:
                    hosts = ", ".join(f"rank {r} on {self.pool.host_of(r)}" for r in dead)
                    why = f"{hosts} died ({why or 'engine lost'}); run `%colossal restart`"
                self.failure = f"the ranks serving {self.engine} failed: {why or 'the loop ended'}"
                self.bridge.fail_all(self.failure)
            try:
                data = task.data
                data = [data] if isinstance(data, dict) else data
            except Exception:  # noqa: BLE001 - a lost engine's data is not worth failing on
                continue
            self.telemetry = {r: d for r, d in enumerate(data or []) if d}
            blocks = [d[TELEMETRY_KEY].get("inference") for d in self.telemetry.values()
                      if TELEMETRY_KEY in d]
            self.metrics.engines([b for b in blocks if b and b.get("leader", True)])


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed, else asyncio's. Why: on a machine whose cores
    the ranks fill, the serving thread's CPU is the ranks' loss, and uvloop (with httptools,
    which uvicorn picks by itself where installed) takes about a third off it per streamed
    token (issue 30: 0.12 to 0.08 CPU-seconds for 3,954 streamed tokens, no ranks).
    This thread's own loop: never the process's policy, which a kernel's loop also reads."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _task_error(task: Any) -> str | None:
    if not task.done():
        return None
    try:
        task.get(0)
    except Exception as err:  # noqa: BLE001 - whatever a rank raised is the reason
        return f"{type(err).__name__}: {err}"
    return None
