"""The communication of ring attention: one all-gather of the key masks, then a ring of p2p.

Ring attention (Liu et al. 2023) moves key/value blocks one step around the sp group per block
of compute: each rank sends to the next rank and receives from the previous one, so after sp
steps every query has met every key. The transfer of the next block is started before the
current block is computed (``Ring.shift`` returns at once, ``Shift.wait`` takes the arrival),
which hides communication behind compute.

The key masks (positions and padding) are tiny next to K and V: ``gather_keys`` all-gathers
them once before the ring turns, so which blocks are fully masked is known on the host from the
start (read there once, not once per block) and only K, V and, in backward, their gradient
accumulators travel the ring. Over the whole ring this moves the same mask bytes a per-step
transfer would, in one message.

p2p in ``Collectives`` takes global ranks, so the neighbours are translated from the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from kernels_runtime.comm.collectives import Collectives, PendingOp
from kernels_runtime.comm.groups import Group


class Shift:
    """Tensors on their way from the previous rank; ``wait`` returns them once arrived."""

    def __init__(self, received: list[Tensor], pending: list[PendingOp],
                 sent: list[Tensor]) -> None:
        self.received, self.pending = received, pending
        self.sent = sent  # keep the send buffers alive and unchanged until the ops complete

    def wait(self) -> list[Tensor]:
        for op in self.pending:
            op.wait()
        self.sent = []
        return self.received


class Ring:
    """This rank's place on the ring of ``group``: it sends to ``next``, receives from ``prev``."""

    def __init__(self, comm: Collectives, group: Group) -> None:
        self.comm, self.group = comm, group
        ring = group if group is not None else dist.group.WORLD
        self.size, self.rank = dist.get_world_size(ring), dist.get_rank(ring)
        self.next = dist.get_global_rank(ring, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(ring, (self.rank - 1) % self.size)

    def owner(self, step: int) -> int:
        """The group rank whose keys this rank holds after ``step`` shifts."""
        return (self.rank - step) % self.size

    def shift(self, tensors: Sequence[Tensor]) -> Shift:
        """Start sending ``tensors`` to the next rank and receiving same-shaped ones from the
        previous rank, all in one batch (no send/receive order can deadlock)."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [("send", t, self.next) for t in sent] + [("recv", t, self.prev) for t in received]
        return Shift(received, self.comm.batch_p2p(ops, group=self.group), sent)

    def gather_keys(self, k_positions: Tensor, key_valid: Tensor | None,
                    device: torch.device) -> tuple[Tensor, Tensor | None]:
        """Every rank's key positions (P, s_local) and padding mask (P, b, s_local) or None.

        Packed into one int64 message: gloo does not all-gather bool tensors."""
        positions = k_positions.to(device=device, dtype=torch.int64).reshape(1, -1)  # (1, s)
        rows = [positions]
        if key_valid is not None:
            rows.append(key_valid.to(device=device, dtype=torch.int64))  # (b, s)
        mine = torch.cat(rows)  # (1 + b, s)
        every = mine.new_empty((self.size, *mine.shape))  # (P, 1 + b, s)
        if self.size > 1:
            self.comm.all_gather(every.view(-1, mine.shape[-1]), mine, group=self.group)
        else:
            every.copy_(mine[None])
        valid = every[:, 1:].bool() if key_valid is not None else None  # (P, b, s)
        return every[:, 0], valid
