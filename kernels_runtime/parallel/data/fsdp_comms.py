"""FSDP2's collectives routed through the instrumented ``Collectives``.

ZeRO-3 runs on FSDP2, which calls torch.distributed directly: without this its all-gathers and
reduce-scatters were invisible to the telemetry, so a ZeRO-3 step showed no communication and
counted the waits as compute. FSDP2 lets a module swap the callables it communicates with
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``); ours issue the same single-tensor
collectives through ``Collectives`` so calls, bytes, seconds and time blocked land in the same
per-(op, axis) counters as ZeRO 0-2, and a stuck peer fails with the bounded-wait error.

FSDP2 waits on an async all-gather only if it receives a ``dist.Work``, so the handle we return
is a ``dist.Work`` subclass whose ``wait`` is the bounded, recorded one.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.comm import Collectives
from kernels_runtime.comm.collectives import PendingOp

try:  # the custom-collective API of FSDP2 (torch >= 2.8); older torch: not instrumented
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - depends on the installed torch
    AllGather = ReduceScatter = None  # type: ignore[assignment,misc]


class _RecordedWork(dist.Work):
    """A ``dist.Work`` whose ``wait`` is ``PendingOp.wait`` (bounded, recorded)."""

    def __init__(self, pending: PendingOp) -> None:
        super().__init__()
        self.pending = pending

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.pending.wait()
        return True

    def is_completed(self) -> bool:
        return self.pending.work is None or self.pending.work.is_completed()


class _Recorded:
    """What both callables share: our allocation (plain ``torch.empty``, as FSDP2's default)
    and how an issued collective is handed back (a waited-on ``dist.Work``, or done)."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @staticmethod
    def _finish(pending: PendingOp, async_op: bool) -> dist.Work | None:
        if async_op:
            return _RecordedWork(pending)
        pending.blocking = True  # the caller was blocked since the issue
        pending.wait()
        return None


if AllGather is not None:

    class RecordedAllGather(_Recorded, AllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
            pending = self.comm.all_gather_async(output_tensor, input_tensor, group)
            return self._finish(pending, async_op)

    class RecordedReduceScatter(_Recorded, ReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: dist.ReduceOp,
                     async_op: bool = False) -> dist.Work | None:
            pending = self.comm.reduce_scatter_async(output_tensor, input_tensor, op, group)
            return self._finish(pending, async_op)


def record_fsdp_comms(modules: list[nn.Module], comm: Collectives) -> bool:
    """Route the collectives of every ``fully_shard``-ed module in ``modules`` through
    ``comm``; False where this torch has no custom-collective API (nothing changes then)."""
    if AllGather is None or not all(hasattr(m, "set_custom_all_gather") for m in modules):
        return False
    gather, scatter = RecordedAllGather(comm), RecordedReduceScatter(comm)
    for module in modules:
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    return True
