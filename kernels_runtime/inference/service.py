"""Serving from the ranks: the loop every rank of a replica runs while an endpoint is up.

A front end (the HTTP server, ``workbench.serving``) talks to one rank per replica, its
*leader* (the first rank of its tensor and pipeline groups). Each turn of the loop the leader
takes what the front end sent (new requests, aborts, a stop), shares it with every rank of its
replica (the same commands in the same order, so every rank's scheduler stays identical), and
all of them apply it and run one engine step; the leader sends back what changed. Idle, the
leader waits up to ``idle_s`` for a command and shares an empty turn otherwise, so the other
ranks, waiting in the share, never reach their collective timeout.

What the front end gets per changed request is append-only: new token ids and new text (its
token counts and timings come with its last delta only). Text
is held back while it ends in an unfinished character (a byte token may be half of one) or could
be the start of a stop string, so streamed text is never taken back. A step that leaves a
request with no new text to show (and does not finish it) sends nothing for it: its tokens go
with the request's next delta, so the front end is not woken for a delta its client cannot see
(issue 30: every wake-up of the serving process takes CPU the ranks share). Without a
tokenizer (no text at all) every step's tokens are sent. With ``stream_interval_s`` a request's
deltas go out at most that often, its first and its last at once (``stream_pacing.py``).
``stop`` drains: requests already in the engine finish, then the loop returns.

A request's failure never ends the loop (``admit``); a failure of the step itself does: the
leader ends every request of the replica with the cause (status 500) and the loop raises
``ReplicaFailed``, which the rank side reports to the bridge so the replica leaves the
rotation, instead of a loop that hangs or goes on from an unknown state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kernels_runtime.inference.chat import chat_prompt
from kernels_runtime.inference.commands import Command
from kernels_runtime.inference.params import RequestOutput, SamplingParams
from kernels_runtime.inference.stream_pacing import StreamPacer

REPLACEMENT = "\ufffd"


def replica_leader(ctx: Any) -> bool:
    return ctx.coord("tp") == 0 and ctx.coord("pp") == 0


class ReplicaFailed(RuntimeError):
    """An engine step raised: the replica's state is unknown, so its loop ends (its requests
    already ended with this error) rather than going on or hanging."""


def share(ctx: Any, commands: list[Command] | None) -> list[Command]:
    """The leader's commands on every rank of its replica: over the pipeline group of the
    leader's tensor column first, then each stage's tensor group. As JSON bytes in a tensor,
    never pickle: a rank unpickling what arrives over the network would run whatever it says."""
    payload = None if commands is None else \
        json.dumps([c.to_json() for c in commands]).encode() if commands else b""
    for axis in ("pp", "tp"):
        if ctx.size(axis) == 1 or (axis == "pp" and ctx.coord("tp") != 0):
            continue
        first = ctx.topology.group_of(ctx.rank, (axis,))[0]
        payload = _broadcast_bytes(payload, first, ctx.group(axis), ctx.device)
    if not payload:
        return []
    return [Command.from_json(c) for c in json.loads(payload.decode())]


def _broadcast_bytes(payload: bytes | None, src: int, group: Any, device: Any) -> bytes:
    """``payload`` (given on ``src`` only) on every rank of ``group``: its length, then its
    bytes when there are any (an idle turn costs one 8-byte broadcast)."""
    size = torch.tensor([len(payload or b"")], dtype=torch.long, device=device)  # (1,)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if n == 0:
        return b""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) \
        if payload else torch.empty(n, dtype=torch.uint8, device=device)  # (n,)
    dist.broadcast(data, src=src, group=group)
    return data.cpu().numpy().tobytes()


class DeltaTracker:
    """What each request has already been sent, to send only what is new."""

    def __init__(self, stops: Callable[[str], tuple[str, ...]]) -> None:
        self.stops = stops  # request id -> its stop strings
        self.sent: dict[str, tuple[int, int]] = {}  # request id -> (tokens, characters)

    def delta(self, out: RequestOutput) -> dict[str, Any] | None:
        """What is new for ``out``'s request, or None when there is nothing to show yet (no
        new text, not finished: its tokens go with its next delta)."""
        tokens, chars = self.sent.get(out.request_id, (0, 0))
        text = out.text
        stable = None
        if text is not None:
            stable = len(text)
            if not out.finished:
                while stable > chars and text[stable - 1] == REPLACEMENT:
                    stable -= 1
                longest = max((len(s) for s in self.stops(out.request_id)), default=0)
                stable = max(chars, min(stable, len(text) - max(0, longest - 1)))
        new_text = None if text is None else text[chars:stable]
        if new_text == "" and not out.finished and out.error is None:
            return None
        message = {"id": out.request_id, "token_ids": out.token_ids[tokens:], "text": new_text,
                   "finish_reason": out.finish_reason, "error": out.error}
        if out.finished:  # the counts and timings once, with the last: a step's message stays
            # small (the leader encodes it between steps, the front end decodes it)
            message.update(prompt_tokens=len(out.prompt_token_ids),
                           completion_tokens=len(out.token_ids), stop_reason=out.stop_reason,
                           first_token_s=out.first_token_s, finished_s=out.finished_s)
            self.sent.pop(out.request_id, None)
        else:
            self.sent[out.request_id] = (len(out.token_ids), stable or 0)
        return message


def admit(engine: Any, command: Command,
          stop_strings: dict[str, tuple[str, ...]]) -> RequestOutput | None:
    """Add one request to the engine; None, or its failure as a finished output. Guarded so a
    request that cannot run (a chat template that refuses its messages, parameters the engine
    cannot take) is that request's error and never ends the replica's loop; every rank of a
    replica fails the same command the same way, so their schedulers stay identical."""
    try:
        params = SamplingParams(**command.params)
        prompt = command.prompt if command.kind == "completion" \
            else chat_prompt(engine.tokenizer, command.prompt)
        stop_strings[command.request_id] = params.stop_strings \
            if isinstance(params.stop, (str, list, tuple)) else ()
        engine.add_request(prompt, params, request_id=command.request_id,
                           adapter=command.adapter)
    except Exception as err:  # noqa: BLE001 - whatever it is, it is this request's error
        stop_strings.pop(command.request_id, None)
        why = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        return RequestOutput(command.request_id, [], finish_reason="error",
                             error=f"the request could not be added: {why}", finished_s=0.0)
    return None


def serve(engine: Any, receive: Callable[[float], list[Command]] | None,
          send: Callable[[list[dict[str, Any]]], None] | None, idle_s: float = 0.05,
          profile: bool = False, stream_interval_s: float = 0.0) -> None:
    """Run until a ``stop`` command has drained the engine (see the module docstring).
    ``receive(timeout_s)`` and ``send(deltas)`` are the leader's link to the front end (None on
    the other ranks). ``profile``: the leader's step deltas carry ``t``, host timestamps of
    its loop turn and its step (``workbench/serving/profile.py``); no device sync is added.
    ``stream_interval_s``: a request's new tokens go out at most that often, its first and its
    end at once (``stream_pacing.py``); 0: every step's."""
    ctx = engine.ctx
    leader = replica_leader(ctx)
    stop_strings: dict[str, tuple[str, ...]] = {}
    tracker = DeltaTracker(lambda rid: stop_strings.get(rid, ()))
    pacer = StreamPacer(stream_interval_s)
    running: set[str] = set()  # requests added and not finished (a failed step ends them)
    stopping = idle_figures_due = False
    while True:
        turn_ns = time.monotonic_ns() if profile else 0
        commands = None
        if leader:
            commands = receive(0.0 if engine.has_unfinished() or stopping else idle_s)
        shared = share(ctx, commands)
        if idle_figures_due and not shared and not engine.has_unfinished():
            ctx.telemetry.flush()  # idle for a whole wait: its last figures must go out
            idle_figures_due = False
        for command in shared:
            if command.kind == "stop":
                stopping = True
            elif command.kind == "abort":
                engine.abort(command.request_id)
                pacer.drop(command.request_id)
            else:
                failed = admit(engine, command, stop_strings)
                if failed is None:
                    running.add(command.request_id)
                elif leader:
                    send([tracker.delta(failed)])
        if stopping and not engine.has_unfinished():
            if idle_figures_due:
                ctx.telemetry.flush()
            return
        if engine.has_unfinished():
            try:
                step_ns = time.monotonic_ns() if profile else 0
                changed = engine.step()
            except Exception as err:  # noqa: BLE001 - the step's failure ends the replica
                why = f"engine.step() failed on rank {ctx.rank}: {type(err).__name__}: {err}"
                if leader:  # every request of the replica ends with the cause
                    send([{**tracker.delta(RequestOutput(rid, [], finish_reason="error",
                                                         error=why, finished_s=0.0)),
                           "status": 500} for rid in sorted(running)])
                raise ReplicaFailed(why) from err
            step_end_ns = time.monotonic_ns() if profile else 0
            deltas = [d for d in map(tracker.delta, pacer.due(changed, tracker.sent))
                      if d is not None] if leader else []
            if deltas:
                if profile:  # one list shared by the step's deltas: the sender appends to it
                    stamps = [turn_ns, step_ns, step_end_ns]
                    for d in deltas:
                        d["t"] = stamps
                send(deltas)
            for out in changed:
                if out.finished:
                    stop_strings.pop(out.request_id, None)
                    running.discard(out.request_id)
            # Idle now, perhaps only until a client's next request: the figures go out once a
            # wait of idle_s brought nothing, so a flush of an idle moment between requests
            # (which restarts the publisher's interval) never hides a busy replica's figures.
            idle_figures_due = not engine.has_unfinished()
