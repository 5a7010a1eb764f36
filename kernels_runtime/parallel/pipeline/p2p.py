"""Point-to-point traffic between pipeline stages: activations forward, their gradients back.

Sends are asynchronous (``Collectives.isend``, waited at the end of the step) and receives
block only when their tensor is needed, so a rank never waits on its own sends, and with a
valid schedule the blocking receives cannot deadlock. Both directions go through the
instrumented collectives, so their bytes and wait times appear per group ("pp") in telemetry.

Two details make this correct under every schedule and backend:

- Order. Device backends match a pair's messages in the order they were posted, and a zbv rank
  receives activations of one chunk and gradients of another on the same link, in its own
  order. Every rank knows the whole schedule, so it knows the order in which its peer sends
  on each link (``channel_orders``) and posts its receives in exactly that order, keeping
  early arrivals until their action runs.
- Shapes. A receive needs its tensor's shape and dtype. The first message of a kind on a link
  for a given micro-batch shape is preceded by a small header carrying them; both sides see
  the same micro-batches, so they agree without asking when a header is due.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels_runtime.comm import Collectives, CollectiveTimeoutError
from kernels_runtime.comm.pending import PendingOp
from kernels_runtime.parallel.pipeline.schedules import Schedule

Message = tuple[str, int, int]  # (kind "act" | "grad", receiving virtual stage, micro-batch)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10  # dtype code, ndim, up to 8 sizes


def channel_orders(schedule: Schedule) -> dict[tuple[int, int], list[Message]]:
    """For every link (sending pipeline rank, receiving one), its messages in send order."""
    place = schedule.placement
    out: dict[tuple[int, int], list[Message]] = {}
    for rank, order in enumerate(schedule.orders):
        for a in order:
            stage = place.stage(rank, a.chunk)
            if a.kind == "F" and stage + 1 < place.stages:
                message, peer = ("act", stage + 1, a.mb), place.owner(stage + 1)[0]
            elif a.kind == "B" and stage > 0:
                message, peer = ("grad", stage - 1, a.mb), place.owner(stage - 1)[0]
            else:
                continue
            if peer != rank:
                out.setdefault((rank, peer), []).append(message)
    return out


class StageLinks:
    """This rank's links to its pipeline peers for one schedule."""

    def __init__(self, comm: Collectives, group, pp_ranks: tuple[int, ...], me: int,
                 schedule: Schedule, signature: Callable[[int], tuple]) -> None:
        self.comm, self.group, self.ranks, self.me = comm, group, pp_ranks, me
        self.signature = signature  # micro-batch -> its input shapes (the header key)
        self.orders = {peer: msgs for (src, peer_to), msgs in channel_orders(schedule).items()
                       for peer in [src] if peer_to == me}
        self.posted: dict[Message, tuple[PendingOp, torch.Tensor]] = {}
        self.cursor = dict.fromkeys(self.orders, 0)
        self.sends: list[tuple[PendingOp, torch.Tensor]] = []
        self.local: dict[Message, torch.Tensor] = {}  # between two chunks of this rank
        self.bytes_sent = 0

    def send(self, message: Message, peer: int, tensor: torch.Tensor,
             headers: dict[tuple, tuple]) -> None:
        tensor = tensor.detach().contiguous()
        if peer == self.me:
            self.local[message] = tensor
            return
        key = (message[0], message[1], self.signature(message[2]))
        if key not in headers:
            headers[key] = (tensor.dtype, tuple(tensor.shape))
            self._isend(_header(tensor), peer)
        self._isend(tensor, peer)

    def _isend(self, tensor: torch.Tensor, peer: int) -> None:
        self.sends.append((self.comm.isend(tensor, self.ranks[peer], self.group), tensor))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def recv(self, message: Message, peer: int, headers: dict[tuple, tuple],
             device: torch.device) -> torch.Tensor:
        """The tensor of ``message`` from pipeline rank ``peer`` (blocking until it is here)."""
        if peer == self.me:
            return self.local.pop(message)
        order = self.orders.get(peer, [])
        while message not in self.posted:
            if self.cursor[peer] >= len(order):
                raise RuntimeError(f"pipeline rank {self.me} expects {message} from rank {peer}, "
                                   "which the schedule never sends (a schedule bug)")
            nxt = order[self.cursor[peer]]
            self.cursor[peer] += 1
            key = (nxt[0], nxt[1], self.signature(nxt[2]))
            if key not in headers:
                head = torch.empty(_HEADER, dtype=torch.int64, device=device)
                self.comm.irecv(head, self.ranks[peer], self.group).wait()
                headers[key] = _parse(head)
            dtype, shape = headers[key]
            buffer = torch.empty(shape, dtype=dtype, device=device)
            self.posted[nxt] = (self.comm.irecv(buffer, self.ranks[peer], self.group), buffer)
        op, buffer = self.posted.pop(message)
        try:
            op.wait()
        except CollectiveTimeoutError as err:
            what = "activation" if message[0] == "act" else "gradient"
            raise CollectiveTimeoutError(err.op, err.group, err.timeout_s, (
                f"pipeline rank {self.me} waited for the {what} of micro-batch {message[2]} "
                f"from pipeline rank {peer} (global rank {self.ranks[peer]}), which raised, "
                f"died or is stuck: its own error names the cause. {err.cause}")) from err
        return buffer

    def finish(self) -> None:
        """Wait for every send of the step (their buffers may be reused after)."""
        sends, self.sends = self.sends, []
        for op, _ in sends:
            op.wait()


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _DTYPES or tensor.dim() > _HEADER - 2:
        raise TypeError(f"pipeline stages pass float tensors of at most {_HEADER - 2} dims; "
                        f"got {tensor.dtype} of shape {tuple(tensor.shape)}")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    values += [0] * (_HEADER - len(values))
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def _parse(head: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    values = head.tolist()
    return _DTYPES[values[0]], tuple(values[2:2 + values[1]])
