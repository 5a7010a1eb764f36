"""The collectives of data parallelism over flat buckets, started asynchronously.

Reductions run in fp32 whatever the model dtype (sums of 16-bit gradients over many ranks lose
precision), and the result is averaged over the dp ranks. Each ``start_*`` returns a callable
that waits for the op and applies its result, so the caller decides how far to overlap.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels_runtime.comm import Collectives
from kernels_runtime.parallel.data.buckets import Bucket

Finish = Callable[[], None]


def start_all_reduce(comm: Collectives, group, grad: torch.Tensor, dp: int) -> Finish:
    """ZeRO-0 (DDP): every rank gets the averaged full gradient, written back into ``grad``."""
    g32 = grad.float()  # (padded,); aliases ``grad`` when it is already fp32
    op = comm.all_reduce_async(g32, group=group)

    def finish() -> None:
        op.wait()
        g32.mul_(1.0 / dp)
        if g32 is not grad:
            grad.copy_(g32)

    return finish


def start_reduce_scatter(
    comm: Collectives, group, grad: torch.Tensor, dp: int, out: torch.Tensor, accumulate: bool
) -> Finish:
    """ZeRO-1/2: this rank gets the averaged gradient of its shard only, copied (ZeRO-1) or
    added (ZeRO-2, accumulating micro-batches) into ``out``."""
    g32 = grad.float()  # (padded,)
    shard = torch.empty(g32.numel() // dp, dtype=torch.float32, device=g32.device)  # (padded/dp,)
    op = comm.reduce_scatter_async(shard, g32, group=group)

    def finish() -> None:
        op.wait()
        shard.mul_(1.0 / dp)
        if accumulate:
            out.add_(shard.to(out.dtype))
        else:
            out.copy_(shard)

    return finish


def start_param_all_gather(comm: Collectives, group, bucket: Bucket, dp_rank: int) -> Finish:
    """After a sharded step: every rank's updated shard of the parameters goes to every rank."""
    start, end = bucket.shard_range(dp_rank)
    mine = bucket.flat_param[start:end].clone()  # (padded/dp,) input must not alias the output
    op = comm.all_gather_async(bucket.flat_param, mine, group=group)
    return op.wait


def flatten_grads(bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
    """The bucket's parameter gradients as one padded flat tensor (missing grads as zeros)."""
    flat = torch.zeros(bucket.padded, dtype=dtype, device=bucket.flat_param.device)
    for p, off in zip(bucket.params, bucket.offsets):
        if p.grad is not None:
            flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
    return flat
