"""The link between the HTTP server and the ranks: a ZeroMQ ROUTER socket in the server that
each replica's leader rank connects to (``rank_side.py``).

Requests go to the replica with the fewest requests in flight; what a leader sends back (each
changed request's new tokens and text, ``kernels_runtime.inference.service``) is handed to that
request's queue on the server's event loop. One thread owns the socket (ZeroMQ sockets are not
thread-safe): it sends what the event loop queued and receives what the leaders sent. It
sleeps in one poll of the socket and a wake-up socket pair until a message arrives, the event loop
queues one (``_wake``) or a heartbeat is due: no periodic wake-ups, each of which would take the
GIL from the event loop serving the clients. Messages are JSON, never pickle. A leader's
message holds one step's deltas; they reach the event loop with one wake-up (``_hand_over``),
not one per delta.

Why each guard (issue 26, item 4): the socket listens on a TCP port any process of the host
(or, on a multi-node pool, of the network) can reach, so nothing it receives is trusted.
- Every received message is handled on its own: one of a wrong part count, not UTF-8, not a
  JSON object, a hello without the session's secret (compared as bytes, ``hmac``), from a peer
  that never said hello, or of an unknown kind is logged once per kind, counted in
  ``dropped`` and dropped; the loop goes on. ``MAXMSGSIZE`` makes ZeroMQ refuse a message past
  ``MAX_MESSAGE`` before it is buffered.
- Each leader connects under a fixed routing id, ``leader-<replica>`` (``leader_identity``), so
  a restarted replica is found under the same name and a peer cannot say hello as a replica it
  is not. ``ROUTER_MANDATORY`` turns a send to a gone leader, or to one whose queue is full
  (``SEND_HWM``), into an error: the request gets that error instead of being dropped
  silently, and a gone leader's replica leaves the rotation (``lost``).
- The thread is supervised: if it dies, ``failure`` says why, requests in flight end with it
  and the server's ``/health`` is a 503 naming it (``Server.unavailable``).
- Beyond loopback (a multi-node pool) the socket is a CURVE server: the traffic is encrypted
  with a key pair made per bridge, whose public half (``server_key``) reaches the leaders with
  the secret, in the code that starts their loop. On loopback it stays plain.
- The requests waiting to be sent are bounded (``MAX_PENDING``): past it ``submit`` raises
  ``Unavailable`` (a 503 with ``Retry-After``), never a queue without end. A request's delta
  queue holds at most one delta per generated token, so its length is bounded by its
  ``max_tokens``.

Every ``HEARTBEAT_S`` the thread also sends each leader a heartbeat: a leader that hears nothing
for longer than its miss limit (``rank_side.HEARTBEAT_MISS_S``) knows the server (or the kernel
holding it) is gone, aborts its requests and stops its replica, instead of polling a dead
socket forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from kernels_runtime.inference.commands import Command

log = logging.getLogger("workbench.serving.bridge")

HEARTBEAT_S = 1.0
HEARTBEAT = {"heartbeat": True}
MAX_MESSAGE = 16 * 2**20  # bytes: a request body is at most 8 MiB (app.MAX_BODY), JSON grows it
SEND_HWM = 1000  # messages queued for one leader before sending it more is an error (busy)
MAX_PENDING = 4096  # requests the event loop queued that the thread has not sent yet
RETRY_AFTER_S = 1


class Unavailable(RuntimeError):
    """The bridge cannot take a request now; the message says why (a 503)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Dropped(Exception):
    """A received message that is dropped: ``kind`` names what is wrong with it."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def leader_identity(replica: int) -> bytes:
    """The fixed ZeroMQ routing id of replica ``replica``'s leader."""
    return f"leader-{replica}".encode()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond this host
        return False


class Bridge:
    def __init__(self, host: str = "127.0.0.1", *, curve: bool | None = None) -> None:
        """Bind the ROUTER on ``host``; ``curve`` (default: when ``host`` is not loopback)
        encrypts the traffic with CURVE (tests force it on loopback)."""
        self.secret = secrets.token_hex(16)
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.server_key: str | None = None  # the CURVE public key leaders connect with
        if (not is_loopback(host)) if curve is None else curve:
            public, private = zmq.curve_keypair()
            self.socket.curve_secretkey = private
            self.socket.curve_publickey = public
            self.socket.curve_server = True
            self.server_key = public.decode("ascii")
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.replicas: dict[bytes, int] = {}  # leader identity -> requests in flight
        self.lost: dict[bytes, str] = {}  # leader identity -> why its replica left
        self.owner: dict[str, bytes] = {}  # request id -> its replica's leader
        self.queues: dict[str, asyncio.Queue] = {}  # request id -> its deltas
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outgoing: queue.Queue[tuple[bytes, dict[str, Any]]] = queue.Queue()
        self.on_delta: Callable[[dict[str, Any]], None] | None = None  # metrics
        self.dropped: Counter[str] = Counter()  # kind of malformed message -> how many
        self.failure: str | None = None  # why the thread died
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._fault: BaseException | None = None  # inject_fault's
        # written to wake the thread (a byte per wake, never blocking a writer: _wake); socket
        # objects, not raw fds: a wake after close fails on the object, never on a reused fd
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._supervised,
                                        name="workbench-serving-bridge", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------
    @property
    def connected(self) -> int:
        return len(self.replicas)

    def problem(self) -> str | None:
        """Why no request can be served through the bridge now, or None."""
        if self.failure:
            return self.failure
        if not self.replicas and self.lost:
            return "; ".join(self.lost.values())
        return None

    def submit(self, command: Command) -> asyncio.Queue:
        """Send a request to the least busy replica; the queue its deltas arrive on."""
        with self.lock:
            problem = self.problem()
            if problem:
                raise Unavailable(problem)
            if not self.replicas:
                raise Unavailable("no replica is connected")
            if self.outgoing.qsize() >= MAX_PENDING:
                raise Unavailable(f"the bridge to the ranks has {MAX_PENDING} requests waiting "
                                  f"to be sent: retry after {RETRY_AFTER_S} s", RETRY_AFTER_S)
            leader = min(self.replicas, key=lambda k: self.replicas[k])
            self.replicas[leader] += 1
            self.owner[command.request_id] = leader
        q: asyncio.Queue = asyncio.Queue()
        self.queues[command.request_id] = q
        self._queue(leader, command.to_json())
        return q

    def abort(self, request_id: str) -> None:
        leader = self.owner.get(request_id)
        if leader is not None:
            self._queue(leader, Command("abort", request_id).to_json())

    def stop_replicas(self) -> None:
        for leader in list(self.replicas):
            self._queue(leader, Command("stop").to_json())

    def _queue(self, leader: bytes, message: dict[str, Any]) -> None:
        self.outgoing.put((leader, message))
        self._wake()

    def _wake(self) -> None:
        """Make the thread's poll return now (any thread may call it)."""
        # full: a wake is pending anyway; closed: the bridge stopped
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")

    def fail_all(self, message: str, status: int = 503) -> None:
        """End every request in flight with ``message`` (a rank died)."""
        for rid in list(self.queues):
            self._deliver(_error_delta(rid, message, status))
        with self.lock:
            self.replicas.clear()

    def forget_replicas(self) -> None:
        with self.lock:
            self.replicas.clear()
            self.lost.clear()

    def inject_fault(self, error: BaseException) -> None:
        """Make the socket thread raise ``error`` on its next turn. For tests: the only way to
        kill the thread from outside, to check that its death fails ``/health``."""
        self._fault = error
        self._wake()

    # ---- the socket thread ----------------------------------------------------------------
    def _supervised(self) -> None:
        try:
            self._run()
        except BaseException as err:  # noqa: BLE001 - whatever killed it is the reason
            self.failure = (f"the serving bridge's thread died ({type(err).__name__}: {err}); "
                            "stop and start the endpoint again")
            log.error("%s", self.failure, exc_info=err)
            self.fail_all(self.failure)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = 0.0
        while not self._stop.is_set():
            if self._fault is not None:
                fault, self._fault = self._fault, None
                raise fault
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                with self.lock:
                    leaders = list(self.replicas)
                for leader in leaders:
                    self._send(leader, HEARTBEAT)
            try:
                while True:
                    self._send(*self.outgoing.get_nowait())
            except queue.Empty:
                pass
            wait_ms = max(0, int((next_beat - time.monotonic()) * 1000) + 1)
            ready = dict(poller.poll(wait_ms))
            if self._wake_r.fileno() in ready:  # the poller names a plain socket by its fd
                with contextlib.suppress(BlockingIOError):  # drained
                    while self._wake_r.recv(4096):
                        pass
            if self.socket not in ready:
                continue
            while self.socket.poll(0):
                frames = self.socket.recv_multipart()
                try:
                    self._received(frames)
                except Exception as err:  # noqa: BLE001 - one message never ends the loop
                    kind = err.kind if isinstance(err, _Dropped) else type(err).__name__
                    self.dropped[kind] += 1
                    if self.dropped[kind] == 1:
                        log.warning("the serving bridge dropped a message (%s: %s); further "
                                    "ones of this kind are dropped silently", kind, err)

    def _send(self, leader: bytes, message: dict[str, Any]) -> None:
        try:
            self.socket.send_multipart([leader, json.dumps(message).encode()], zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: the leader is not reading
            self._unsent(leader, message, f"the leader of {_name(leader)} is busy ({SEND_HWM} "
                                          "messages wait for it): retry later")
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            self._leader_gone(leader, f"the leader of {_name(leader)} is gone (its connection "
                                      "to the server closed)")

    def _unsent(self, leader: bytes, message: dict[str, Any], why: str) -> None:
        rid = message.get("request_id")
        if message.get("kind") in ("completion", "chat") and rid:
            self._deliver(_error_delta(rid, why, 503))
        elif message is not HEARTBEAT:
            log.warning("the serving bridge could not send %s: %s", message.get("kind"), why)

    def _leader_gone(self, leader: bytes, why: str) -> None:
        """Take ``leader``'s replica out of the rotation and end its requests with ``why``."""
        with self.lock:
            known = self.replicas.pop(leader, None) is not None
            if known:
                self.lost[leader] = why
            orphans = [rid for rid, owner in self.owner.items() if owner == leader]
        if known:
            log.warning("%s", why)
        for rid in orphans:
            self._deliver(_error_delta(rid, why, 503))

    def _received(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise _Dropped("parts", f"{len(frames) - 1} frames after the routing id, not 1")
        leader, payload = frames
        try:
            message = json.loads(payload.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise _Dropped("not UTF-8", str(err)) from None
        except (ValueError, RecursionError) as err:
            raise _Dropped("not JSON", str(err)[:200]) from None
        if not isinstance(message, dict):
            raise _Dropped("not an object", f"a JSON {type(message).__name__}")
        if "hello" in message:
            self._hello(leader, message)
        elif leader not in self.replicas:
            raise _Dropped("stranger", f"{_name(leader)} sent a message before a hello with "
                                       "the secret")
        elif isinstance(message.get("deltas"), list):
            puts = []  # one wake of the event loop per message (a step), not per delta
            try:
                for delta in message["deltas"]:
                    if not (isinstance(delta, dict) and isinstance(delta.get("id"), str)):
                        raise _Dropped("delta", "a delta that is not an object with a string id")
                    q = self._book(delta)
                    if q is not None:
                        puts.append((q, delta))
            finally:
                self._hand_over(puts)
        elif isinstance(message.get("failed"), str):  # its engine failed: rank_side.py
            self._leader_gone(leader, f"{_name(leader)} failed: {message['failed'][:2000]}")
        else:
            raise _Dropped("kind", f"unknown message with keys {sorted(message)[:5]}")

    def _hello(self, leader: bytes, message: dict[str, Any]) -> None:
        given = message["hello"]
        if not isinstance(given, str):
            raise _Dropped("hello", f"a hello whose secret is a {type(given).__name__}")
        # as bytes: compare_digest refuses a non-ASCII str (and lone surrogates cannot encode)
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self.secret.encode()):
            raise _Dropped("secret", "a hello with a wrong secret")
        replica = message.get("replica")
        if not isinstance(replica, int) or leader != leader_identity(replica):
            raise _Dropped("identity", f"a hello from {_name(leader)} as replica {replica!r}, "
                                       f"whose leader connects as {leader_identity(0)[:-1]!r}N")
        with self.lock:
            self.replicas.setdefault(leader, 0)
            self.lost.pop(leader, None)

    def _deliver(self, delta: dict[str, Any]) -> None:
        q = self._book(delta)
        self._hand_over([] if q is None else [(q, delta)])

    def _book(self, delta: dict[str, Any]) -> asyncio.Queue | None:
        """Account for ``delta`` (its replica's load, the metrics); the queue it goes to, if
        its request still has one."""
        rid = delta["id"]
        if isinstance(delta.get("t"), list):  # profiled (profile.py): when the bridge decoded it
            delta["t"].append(time.monotonic_ns())
        if delta.get("finish_reason") is not None:
            with self.lock:
                leader = self.owner.pop(rid, None)
                if leader in self.replicas:
                    self.replicas[leader] -= 1
        if self.on_delta is not None:
            self.on_delta(delta)
        q = self.queues.get(rid)
        if delta.get("finish_reason") is not None:
            self.queues.pop(rid, None)
        return q

    def _hand_over(self, puts: list[tuple[asyncio.Queue, dict[str, Any]]]) -> None:
        """Put each delta on its queue in the event loop's thread, with one wake-up for all."""
        if puts and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_put_all, puts)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2)
        self.socket.close(0)
        if not self._thread.is_alive():  # else it may still poll the pair: leave it open
            self._wake_r.close()
            self._wake_w.close()


def _put_all(puts: list[tuple[asyncio.Queue, dict[str, Any]]]) -> None:
    for q, delta in puts:
        q.put_nowait(delta)


def _error_delta(rid: str, message: str, status: int) -> dict[str, Any]:
    """A request's last delta when it ends with ``message``; ``status`` is its HTTP status."""
    return {"id": rid, "token_ids": [], "text": "", "finish_reason": "error", "error": message,
            "status": status, "prompt_tokens": 0, "completion_tokens": 0}


def _name(leader: bytes) -> str:
    text = leader.decode("ascii", "replace")
    return f"replica {text[7:]}" if text.startswith("leader-") else f"peer {text[:40]!r}"
