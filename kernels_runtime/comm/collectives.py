"""The engine's collectives: counted, timed, and never blocking forever.

A notebook user runs cells on every rank by hand, so a rank that skips a collective is an
everyday mistake, not a crash. Plain torch.distributed calls would then hang the kernel until
the group's timeout (30 minutes by default for subgroups). Here every call is issued with
`async_op=True` and waited on with `work.wait(timeout=...)`; a failed wait becomes a
`CollectiveTimeoutError` that names the op and the group, and the pool re-creates the group.

Timeout: min(`Collectives.timeout_s`, the group's own timeout). Whichever is smaller fires first
(the gloo transport enforces the group's timeout itself; `wait` enforces ours), and the error
reports that value.

Bytes: the logical payload this rank hands to the op, i.e. numel * element_size of the input
(all_reduce, all_gather, reduce_scatter, all_to_all, send), of the buffer (broadcast, recv), and
0 for barrier. It is not wire traffic, which depends on the algorithm (a ring all_reduce sends
about twice the payload). Only completed calls are counted.

Blocked time: the seconds this rank spent waiting for an op, i.e. inside ``PendingOp.wait``
(for a synchronous collective the whole call, issue included: lazy NCCL communicator set-up
blocks there). The telemetry's step split counts it as communication time.

Each ``Collectives`` carries the rank's ``Telemetry`` (over its own stats): every strategy and
``ParallelContext`` already receives the collectives, so steps they record and the
communication they do end up in the same place without another argument.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from kernels_runtime.comm.stats import CommStats
from kernels_runtime.telemetry import Telemetry

# torch 2.13 renamed the tensor-in/tensor-out variants; older versions only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}
Group = dist.ProcessGroup | None
Work = dist.Work
ReduceOp = dist.ReduceOp
SUM = dist.ReduceOp.SUM


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a peer skipped it, died or is stuck."""

    def __init__(self, op: str, group: str, timeout_s: float, cause: str = "") -> None:
        self.op, self.group, self.timeout_s, self.cause = op, group, timeout_s, cause
        super().__init__(
            f"{op} on process group '{group}' did not complete within {timeout_s:.1f} s: a peer "
            "rank skipped it, died or is stuck. The process group is now unusable; re-create it "
            f"(the pool does this before the next cell). Original error: {cause}"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, float, str]]:
        """Keep it picklable with its fields: engines ship exceptions back to the client."""
        return type(self), (self.op, self.group, self.timeout_s, self.cause)


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_timeout_s(group: dist.ProcessGroup | None) -> float | None:
    """The timeout the group was created with, or None where torch does not expose it."""
    try:
        pg = group if group is not None else dist.group.WORLD
        device = torch.device(_DEVICE_OF_BACKEND[dist.get_backend(pg)])
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # private API: absent or shaped differently in other torch versions
        return None


def _is_unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return isinstance(err, NotImplementedError) or "not support" in text


class PendingOp:
    """A collective in flight. ``wait`` blocks at most the timeout, then records the op."""

    def __init__(self, stats: CommStats, op: str, group: str, nbytes: int, timeout_s: float,
                 start: float, work: Work | None, blocking: bool = False) -> None:
        self.stats, self.op, self.group, self.nbytes = stats, op, group, nbytes
        self.timeout_s, self.start, self.work = timeout_s, start, work
        self.blocking = blocking  # a synchronous call: the caller was blocked since `start`

    def wait(self) -> None:
        if self.work is None:  # this rank is not a member of the group: nothing happened
            return
        entered = self.start if self.blocking else time.perf_counter()
        try:
            self.work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            self.work = None  # a pending gloo work pins the group and its store's port
            raise CollectiveTimeoutError(self.op, self.group, self.timeout_s, str(err)) from err
        self.work = None
        done = time.perf_counter()
        self.stats.record(self.op, self.group, self.nbytes, done - self.start, done - entered)


class Collectives:
    """torch.distributed collectives with per-(op, group) stats and a bounded wait."""

    def __init__(self, stats: CommStats | None = None, timeout_s: float = 60.0) -> None:
        self.stats = stats if stats is not None else CommStats()
        self.timeout_s = timeout_s
        self.telemetry = Telemetry(self.stats)  # the session installs probes and a publisher
        self._world_name = "world"
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._native_reduce_scatter: dict[str, bool] = {}  # backend name -> supported

    def name_group(self, group: dist.ProcessGroup | None, name: str) -> None:
        """Label `group` in stats and errors ("dp", "tp", ...); None means the default group."""
        if group is None or group is dist.group.WORLD:
            self._world_name = name
        else:
            self._names[group] = name

    def group_name(self, group: dist.ProcessGroup | None) -> str:
        """The label of `group`; unnamed subgroups are labelled by their global ranks."""
        if group is None or group is dist.group.WORLD:
            return self._world_name
        if group in self._names:
            return self._names[group]
        try:
            return "ranks" + ",".join(map(str, dist.get_process_group_ranks(group)))
        except (ValueError, RuntimeError):  # this rank is not a member of `group`
            return "non-member"

    def _issue(
        self, op: str, group: Group, nbytes: int, issue: Callable[[], Work | None],
        blocking: bool = False,
    ) -> PendingOp:
        """Issue one async op; the returned handle's ``wait`` is bounded and records stats.
        Issue-time errors (bad shapes, unsupported ops) pass through unchanged: the group is
        still healthy then."""
        name = self.group_name(group)
        group_timeout = _group_timeout_s(group)
        timeout_s = min(self.timeout_s, group_timeout or self.timeout_s)
        start = time.perf_counter()
        return PendingOp(self.stats, op, name, nbytes, timeout_s, start, issue(), blocking)

    def _run(self, op: str, group: Group, nbytes: int, issue: Callable[[], Work | None]) -> None:
        self._issue(op, group, nbytes, issue, blocking=True).wait()

    def all_reduce_async(
        self, tensor: Tensor, op: ReduceOp = SUM, group: Group = None
    ) -> PendingOp:
        """Start an in-place all_reduce; ``.wait()`` on the handle before reading `tensor`.

        Used to overlap gradient reduction with the rest of backward."""
        return self._issue(
            "all_reduce", group, _nbytes(tensor),
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        )

    def reduce_scatter_async(
        self, output: Tensor, input: Tensor, op: ReduceOp = SUM, group: Group = None
    ) -> PendingOp:
        """Start a native reduce_scatter (no fallback); ``.wait()`` before reading `output`."""
        return self._issue(
            "reduce_scatter", group, _nbytes(input),
            lambda: _reduce_scatter_single(output, input, op, group, async_op=True),
        )

    def all_gather_async(self, output: Tensor, input: Tensor, group: Group = None) -> PendingOp:
        """Start an all_gather into `output`; ``.wait()`` before reading it."""
        return self._issue(
            "all_gather", group, _nbytes(input),
            lambda: _all_gather_single(output, input, group=group, async_op=True),
        )

    def all_reduce(self, tensor: Tensor, op: ReduceOp = SUM, group: Group = None) -> Tensor:
        """Reduce `tensor` across the group, in place; returns it."""
        self._run(
            "all_reduce",
            group,
            _nbytes(tensor),
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        )
        return tensor

    def all_gather(self, output: Tensor, input: Tensor, group: Group = None) -> Tensor:
        """Concatenate every rank's `input` along dim 0 into `output` (group size x input)."""
        self._run(
            "all_gather",
            group,
            _nbytes(input),
            lambda: _all_gather_single(output, input, group=group, async_op=True),
        )
        return output

    def reduce_scatter(
        self, output: Tensor, input: Tensor, op: ReduceOp = SUM, group: Group = None
    ) -> Tensor:
        """Reduce `input` across the group; this rank keeps its dim-0 slice in `output`.

        Backends without a native reduce_scatter (gloo in some torch versions) fall back to
        all_reduce of a copy plus a slice; that moves more on the wire, but the recorded bytes
        stay the input's, as for the native op.
        """
        if dist.get_rank(group) < 0:  # not a member: a no-op, as in torch
            return output
        backend = dist.get_backend(group)
        if self._native_reduce_scatter.get(backend, True):
            try:
                self._run(
                    "reduce_scatter",
                    group,
                    _nbytes(input),
                    lambda: _reduce_scatter_single(output, input, op, group, async_op=True),
                )
                return output
            except (RuntimeError, NotImplementedError) as err:
                if isinstance(err, CollectiveTimeoutError) or not _is_unsupported(err):
                    raise
                self._native_reduce_scatter[backend] = False
        return self._reduce_scatter_via_all_reduce(output, input, op, group)

    def _reduce_scatter_via_all_reduce(
        self, output: Tensor, input: Tensor, op: dist.ReduceOp, group: Group
    ) -> Tensor:
        reduced = input.clone()  # (group size * n,) in the same flat layout as the native op
        self._run(
            "reduce_scatter",
            group,
            _nbytes(input),
            lambda: dist.all_reduce(reduced, op=op, group=group, async_op=True),
        )
        n, index = output.numel(), dist.get_rank(group)
        output.copy_(reduced.reshape(-1)[index * n : (index + 1) * n].view_as(output))
        return output

    def broadcast(self, tensor: Tensor, src: int, group: Group = None) -> Tensor:
        """Copy `tensor` from global rank `src` to every rank of the group, in place."""
        self._run(
            "broadcast",
            group,
            _nbytes(tensor),
            lambda: dist.broadcast(tensor, src=src, group=group, async_op=True),
        )
        return tensor

    def all_to_all(self, output: Tensor, input: Tensor, group: Group = None) -> Tensor:
        """Rank i sends its j-th dim-0 chunk of `input` to rank j (all_to_all_single)."""
        self._run(
            "all_to_all",
            group,
            _nbytes(input),
            lambda: dist.all_to_all_single(output, input, group=group, async_op=True),
        )
        return output

    def send(self, tensor: Tensor, dst: int, group: Group = None) -> None:
        """Send `tensor` to global rank `dst`; returns once the send has completed."""
        self._run("send", group, _nbytes(tensor), lambda: dist.isend(tensor, dst, group=group))

    def recv(self, tensor: Tensor, src: int, group: Group = None) -> Tensor:
        """Receive into `tensor` from global rank `src`; returns it."""
        self._run("recv", group, _nbytes(tensor), lambda: dist.irecv(tensor, src, group=group))
        return tensor

    def barrier(self, group: Group = None) -> None:
        """Wait until every rank of the group reaches this point."""
        self._run("barrier", group, 0, lambda: dist.barrier(group=group, async_op=True))
