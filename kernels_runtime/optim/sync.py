"""``GradSync``: what one data-parallel strategy does around the shared optimizer step.

The boosted optimizer's step is the same for every strategy (``boosted.py``); what differs is
where gradients are reduced, which fp32 tensors the inner optimizer updates and how updated
values get back into the model. A strategy supplies one ``GradSync`` object with those answers
instead of subclassing the optimizer, so a strategy is one object with one job and the step
logic exists once. The same object lays out the model state (``ModelState``), so checkpoints
see every strategy through the same pieces.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels_runtime.optim.state import StatePiece


@dataclass(frozen=True)
class GradShard:
    """An fp32 gradient tensor and the axes along which ranks hold different parts of it
    (dp for ZeRO shards, tp for tensor-parallel weights, pp for a stage's parameters). Along
    the other axes it is replicated: a global norm counts it once there."""

    tensor: torch.Tensor
    sharded: frozenset[str] = frozenset()
    primary: bool = True  # False: another rank of the sharded axes holds the same values


class GradSync(ABC):
    """One strategy's gradient reduction, master tensors and parameter publication."""

    @abstractmethod
    def master_groups(self) -> list[list[torch.Tensor]]:
        """The fp32 tensors the inner optimizer updates, per optimizer param group."""

    def micro_batch(self) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward: a strategy that places memory
        measures what the micro-batch keeps on the device (offload's activation reserve)."""
        return contextlib.nullcontext()

    def prepare_backward(self, sync: bool) -> None:  # noqa: B027 - optional hook
        """Called before each backward; ``sync=False`` inside ``no_sync()``."""

    def reduce_now(self) -> None:
        """Reduce every gradient accumulated so far and wait (a pipeline calls it once its
        stage's backwards are all done, having run them without sync)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reduce on demand")

    @abstractmethod
    def finish(self) -> None:
        """Wait for every gradient reduction started in backward."""

    @abstractmethod
    def master_grads(self) -> list[GradShard]:
        """fp32 gradients, set as ``.grad`` of the masters, with their sharding."""

    @abstractmethod
    def publish(self) -> None:
        """Updated masters into the model's parameters (copies, all-gathers)."""

    @abstractmethod
    def zero_grads(self) -> None:
        """Drop gradients (and the masters' ``.grad``)."""

    @abstractmethod
    def memory_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds for params, grads and optimizer (fp32 masters included)."""

    @abstractmethod
    def pieces(self, saving: bool, optimizer: torch.optim.Optimizer | None) -> list[StatePiece]:
        """The ``ModelState`` pieces: "param" is the master, states come from ``optimizer``."""

    def after_load(self) -> None:
        """Loaded masters into the parameters."""
        self.publish()

    def scale_grads(self, shards: list[GradShard], factor: torch.Tensor | float) -> None:
        """Multiply the gradients ``master_grads`` returned (fp16 unscaling, clipping); a
        strategy whose shards are stand-ins applies the factor where the gradients live."""
        for s in shards:
            s.tensor.mul_(factor)

    def complete_step(self) -> None:  # noqa: B027 - optional hook
        """Finish whatever part of the last optimizer step is still pending, before the inner
        optimizer's state is read (offload defers a disk chunk's step to its next use,
        ``memory/deferred_step.py``)."""

    def optimizer_step(self, inner: torch.optim.Optimizer) -> None:
        """The inner optimizer's step on the masters, then the parameters published; a
        strategy that streams its masters through memory steps them piece by piece."""
        inner.step()
        self.publish()

    def materialize_state(self, inner: torch.optim.Optimizer) -> None:
        """Create ``inner``'s lazily built state (zeros) without changing anything: one step
        with zero gradients at learning rate 0. Loading then overwrites it."""
        params = [p for g in inner.param_groups for p in g["params"]]
        if all(p in inner.state for p in params):
            return
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None
