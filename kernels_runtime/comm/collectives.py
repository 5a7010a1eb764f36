"""The engine's collectives: counted, timed, and never blocking forever.

A notebook user runs cells on every rank by hand, so a rank that skips a collective is an
everyday mistake, not a crash. Plain torch.distributed calls would then hang the kernel until
the group's timeout (30 minutes by default for subgroups). Here every call is issued with
``async_op=True`` and returns a ``PendingOp`` (``comm/pending.py``): on host backends (gloo) its
wait is bounded and a failed wait becomes a ``CollectiveTimeoutError`` that names the op and
the group, and the pool re-creates the group; on device backends (nccl) the wait only orders
the current stream, and the group's own timeout and watchdog bound a hung op.

Timeout: min(``Collectives.timeout_s``, the group's own timeout). Whichever is smaller fires
first (the gloo transport enforces the group's timeout itself; ``wait`` enforces ours), and the
error reports that value.

Bytes: the logical payload this rank hands to the op, i.e. numel * element_size of the input
(all_reduce, all_gather, reduce_scatter, all_to_all, send), of the buffer (broadcast, recv), and
0 for barrier. It is not wire traffic, which depends on the algorithm (a ring all_reduce sends
about twice the payload). Only completed calls are counted.

Blocked time: the seconds this rank spent waiting for an op, i.e. inside ``PendingOp.wait``
(for a synchronous collective the whole call, issue included: lazy communicator set-up blocks
there). On a device backend it is the time the current stream stalled waiting, from events.
The telemetry's step split counts it as communication time.

Each ``Collectives`` carries the rank's ``Telemetry`` (over its own stats) and its cache of
meshes: every strategy and ``ParallelContext`` already receives the collectives, so steps they
record and the communication they do end up in the same place without another argument.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from kernels_runtime.comm.groups import Group, GroupRegistry
from kernels_runtime.comm.pending import CollectiveTimeoutError, PendingOp, issue_event
from kernels_runtime.comm.stats import CommStats
from kernels_runtime.telemetry import Telemetry

# torch 2.13 renamed the tensor-in/tensor-out variants; older versions only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
Work = dist.Work
ReduceOp = dist.ReduceOp
SUM = dist.ReduceOp.SUM

__all__ = ["Collectives", "CollectiveTimeoutError", "PendingOp", "ReduceOp", "SUM"]


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _is_unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return isinstance(err, NotImplementedError) or "not support" in text


class Collectives:
    """torch.distributed collectives with per-(op, group) stats and a bounded wait."""

    def __init__(self, stats: CommStats | None = None, timeout_s: float = 60.0) -> None:
        self.stats = stats if stats is not None else CommStats()
        self.timeout_s = timeout_s
        self.telemetry = Telemetry(self.stats)  # the session installs probes and a publisher
        self.groups = GroupRegistry()
        self.meshes: Any = None  # the session's MeshCache (kernels_runtime.mesh), set there
        self._native_reduce_scatter: dict[str, bool] = {}  # backend name -> supported

    def name_group(self, group: Group, name: str) -> None:
        """Label `group` in stats and errors ("dp", "tp", ...); None means the default group."""
        self.groups.name(group, name)

    def group_name(self, group: Group) -> str:
        """The label of `group`; unnamed subgroups are labelled by their global ranks."""
        return self.groups.label(group)

    # ---- issuing ------------------------------------------------------------------------
    def _issue(self, op: str, group: Group, nbytes: int, issue: Callable[[], Work | None],
               blocking: bool = False) -> PendingOp:
        """Issue one async op; the returned handle's ``wait`` records stats. Issue-time errors
        (bad shapes, unsupported ops) pass through unchanged: the group is still healthy."""
        info = self.groups.info(group)
        timeout_s = min(self.timeout_s, info.timeout_s or self.timeout_s)
        start, event = time.perf_counter(), issue_event(info)
        work = issue() if info.member else None
        return PendingOp(self.stats, op, info, nbytes, timeout_s, work, start, event, blocking)

    def _run(self, op: str, group: Group, nbytes: int, issue: Callable[[], Work | None]) -> None:
        self._issue(op, group, nbytes, issue, blocking=True).wait()

    # ---- asynchronous collectives: ``.wait()`` on the handle before reading the output ----
    def all_reduce_async(self, tensor: Tensor, op: ReduceOp = SUM,
                         group: Group = None) -> PendingOp:
        """Start an in-place all_reduce (used to overlap gradient reduction with backward)."""
        return self._issue("all_reduce", group, _nbytes(tensor),
                           lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))

    def reduce_scatter_async(self, output: Tensor, input: Tensor, op: ReduceOp = SUM,
                             group: Group = None) -> PendingOp:
        """Start a native reduce_scatter (no fallback)."""
        return self._issue(
            "reduce_scatter", group, _nbytes(input),
            lambda: _reduce_scatter_single(output, input, op, group, async_op=True))

    def all_gather_async(self, output: Tensor, input: Tensor, group: Group = None) -> PendingOp:
        """Start an all_gather of every rank's `input` along dim 0 into `output`."""
        return self._issue("all_gather", group, _nbytes(input),
                           lambda: _all_gather_single(output, input, group=group, async_op=True))

    def all_to_all_async(self, output: Tensor, input: Tensor, group: Group = None) -> PendingOp:
        """Start an all_to_all_single: rank i's j-th dim-0 chunk of `input` goes to rank j."""
        return self._issue("all_to_all", group, _nbytes(input),
                           lambda: dist.all_to_all_single(output, input, group=group,
                                                          async_op=True))

    def broadcast_async(self, tensor: Tensor, src: int, group: Group = None) -> PendingOp:
        """Start a broadcast of `tensor` from global rank `src`, in place."""
        return self._issue("broadcast", group, _nbytes(tensor),
                           lambda: dist.broadcast(tensor, src=src, group=group, async_op=True))

    # ---- synchronous collectives ----------------------------------------------------------
    def all_reduce(self, tensor: Tensor, op: ReduceOp = SUM, group: Group = None) -> Tensor:
        """Reduce `tensor` across the group, in place; returns it."""
        self._run("all_reduce", group, _nbytes(tensor),
                  lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))
        return tensor

    def all_gather(self, output: Tensor, input: Tensor, group: Group = None) -> Tensor:
        """Concatenate every rank's `input` along dim 0 into `output` (group size x input)."""
        self._run("all_gather", group, _nbytes(input),
                  lambda: _all_gather_single(output, input, group=group, async_op=True))
        return output

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = SUM,
                       group: Group = None) -> Tensor:
        """Reduce `input` across the group; this rank keeps its dim-0 slice in `output`.

        Backends without a native reduce_scatter (gloo in some torch versions) fall back to
        all_reduce of a copy plus a slice; that moves more on the wire, but the recorded bytes
        stay the input's, as for the native op.
        """
        if not self.groups.info(group).member:  # not a member: a no-op, as in torch
            return output
        backend = self.groups.info(group).backend
        if self._native_reduce_scatter.get(backend, True):
            try:
                self._run("reduce_scatter", group, _nbytes(input),
                          lambda: _reduce_scatter_single(output, input, op, group,
                                                         async_op=True))
                return output
            except (RuntimeError, NotImplementedError) as err:
                if isinstance(err, CollectiveTimeoutError) or not _is_unsupported(err):
                    raise
                self._native_reduce_scatter[backend] = False
        reduced = input.clone()  # (group size * n,) in the same flat layout as the native op
        self._run("reduce_scatter", group, _nbytes(input),
                  lambda: dist.all_reduce(reduced, op=op, group=group, async_op=True))
        n, index = output.numel(), dist.get_rank(group)
        output.copy_(reduced.reshape(-1)[index * n:(index + 1) * n].view_as(output))
        return output

    def broadcast(self, tensor: Tensor, src: int, group: Group = None) -> Tensor:
        """Copy `tensor` from global rank `src` to every rank of the group, in place."""
        self._run("broadcast", group, _nbytes(tensor),
                  lambda: dist.broadcast(tensor, src=src, group=group, async_op=True))
        return tensor

    def all_to_all(self, output: Tensor, input: Tensor, group: Group = None, *,
                   output_split_sizes: list[int] | None = None,
                   input_split_sizes: list[int] | None = None) -> Tensor:
        """Rank i sends its j-th dim-0 chunk of `input` to rank j (all_to_all_single); chunks
        are equal unless split sizes (rows per rank, as in torch) are given."""
        self._run("all_to_all", group, _nbytes(input),
                  lambda: dist.all_to_all_single(output, input, output_split_sizes,
                                                 input_split_sizes, group=group, async_op=True))
        return output

    def barrier(self, group: Group = None) -> None:
        """Wait until every rank of the group reaches this point."""
        self._run("barrier", group, 0, lambda: dist.barrier(group=group, async_op=True))

    # ---- point to point -----------------------------------------------------------------
    def isend(self, tensor: Tensor, dst: int, group: Group = None) -> PendingOp:
        """Start sending `tensor` to global rank `dst`; keep it unchanged until ``wait``."""
        return self._issue("send", group, _nbytes(tensor),
                           lambda: dist.isend(tensor, dst, group=group))

    def irecv(self, tensor: Tensor, src: int, group: Group = None) -> PendingOp:
        """Start receiving into `tensor` from global rank `src`; read it after ``wait``."""
        return self._issue("recv", group, _nbytes(tensor),
                           lambda: dist.irecv(tensor, src, group=group))

    def send(self, tensor: Tensor, dst: int, group: Group = None) -> None:
        """Send `tensor` to global rank `dst`; returns once the send has completed."""
        self._run("send", group, _nbytes(tensor), lambda: dist.isend(tensor, dst, group=group))

    def recv(self, tensor: Tensor, src: int, group: Group = None) -> Tensor:
        """Receive into `tensor` from global rank `src`; returns it."""
        self._run("recv", group, _nbytes(tensor), lambda: dist.irecv(tensor, src, group=group))
        return tensor

    def batch_p2p(self, ops: list[tuple[str, Tensor, int]],
                  group: Group = None) -> list[PendingOp]:
        """Start several sends and receives at once: ``[("send", t, dst), ("recv", t, src)]``.

        Issued together (``batch_isend_irecv``), so two neighbours that each send to and
        receive from the other cannot deadlock on the order, as a pipeline's stages do."""
        if not ops:
            return []
        bad = [kind for kind, _, _ in ops if kind not in ("send", "recv")]
        if bad:
            raise ValueError(f"batch_p2p takes ('send'|'recv', tensor, peer) items, got {bad}")
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group)
               for kind, t, peer in ops]
        works: list[Work] = []

        def issue_all() -> Work | None:
            works.extend(dist.batch_isend_irecv(p2p))
            return works[0]

        first = self._issue(ops[0][0], group, _nbytes(ops[0][1]), issue_all)
        rest = [self._issue(kind, group, _nbytes(t), lambda i=i: works[i])
                for i, (kind, t, _) in enumerate(ops[1:], start=1)]
        return [first, *rest]
