"""``BoostedOptimizer``: the optimizer a user gets back from ``parallelize``.

It keeps the familiar surface (``backward(loss)``, ``step()``, ``zero_grad()``,
``state_dict()``) while a strategy's ``GradSync`` decides where gradients and optimizer states
live. The step is the same for every strategy:

    finish gradient sync -> unscale (fp16) and agree on overflow across every rank that steps
    -> clip by the global norm across every shard and replica axis -> inner optimizer step on
    fp32 masters and publish parameters (``GradSync.optimizer_step``)

Learning-rate schedulers drive the rebuilt optimizer both ways round. ``torch.optim``'s
``LRScheduler`` accepts only an ``Optimizer`` and writes ``lr`` into ``optimizer.param_groups``
each step, so ``BoostedOptimizer`` is an ``Optimizer`` whose ``param_groups`` *are* the inner
optimizer's (built after ``parallelize``: ``get_scheduler("cosine", optimizer=boosted, ...)``),
and the user's optimizer is re-pointed at those same group dicts (a scheduler built on it before
``parallelize`` keeps working, its warm-up start already copied into the rebuilt groups).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.optim.norm import (
    any_rank_overflowed,
    global_grad_norm,
    global_grad_norm_tensor,
)
from kernels_runtime.optim.rebuild import rebuild_optimizer
from kernels_runtime.optim.state import StatePiece
from kernels_runtime.optim.sync import GradShard, GradSync
from kernels_runtime.precision.loss_scaler import DynamicLossScaler, NoLossScaler, has_inf_or_nan


class BoostedOptimizer(torch.optim.Optimizer):
    """Strategy-independent step logic over a ``GradSync``; see the module docstring.

    It subclasses ``torch.optim.Optimizer`` only so LR schedulers accept it: ``Optimizer.__init__``
    is deliberately not called (it would build groups over the model's parameters); the groups,
    defaults and state are the inner optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, sync: GradSync, ctx: ParallelContext,
                 precision: str, max_grad_norm: float | None) -> None:
        self.ctx, self.sync = ctx, sync
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.scaler = DynamicLossScaler() if precision == "fp16" else NoLossScaler()
        self.inner = rebuild_optimizer(optimizer, sync.master_groups())
        self._user = _share_groups(optimizer, self.inner)
        self.sync_grads = True
        self._last_norm: torch.Tensor | None = None  # on the device until someone reads it
        self.steps_taken = 0
        self.steps_skipped = 0
        sync.zero_grads()

    # ---- user surface ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's groups: change ``lr`` here, or build an LR scheduler on this
        optimizer (or on the one given to ``parallelize``: it shares these groups)."""
        return self.inner.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-tensor state (keyed by the runtime's master tensors)."""
        return self.inner.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "parameters cannot be added to an optimizer after parallelize (its tensors are the "
            "runtime's shards); give every param group to the optimizer before parallelize")

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16."""
        self.sync.prepare_backward(self.sync_grads)
        (loss * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches before the last) without communication."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def finish_grad_sync(self) -> None:
        """Wait for the gradient reductions of the last backward (``step`` does this first)."""
        self.sync.finish()

    def step(self) -> bool:
        """One optimizer step; returns False when fp16 overflow made it skip."""
        self.sync.finish()
        shards = self.sync.master_grads()
        grads = [s.tensor for s in shards]
        if isinstance(self.scaler, DynamicLossScaler):
            self.sync.scale_grads(shards, 1.0 / self.scaler.scale)
            if any_rank_overflowed(has_inf_or_nan(grads), self.ctx):
                self.scaler.update(True)
                self.steps_skipped += 1
                self.zero_grad()
                return False
            self.scaler.update(False)
        if self.max_grad_norm is not None:
            self._last_norm = self._clip(shards, self.max_grad_norm)
        self.sync.optimizer_step(self.inner)
        self.steps_taken += 1
        self._user._opt_called = True  # what a scheduler built on it checks (it never steps)
        self.zero_grad()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grads()

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last clipped step (read back from the device only
        when asked: ``train_step`` reads it after the step's one synchronization)."""
        return None if self._last_norm is None else float(self._last_norm.item())

    def global_grad_norm(self, shards: list[GradShard]) -> float:
        """L2 norm of the full gradient across every shard and replica axis."""
        return global_grad_norm(shards, self.ctx)

    def _clip(self, shards: list[GradShard], max_norm: float) -> torch.Tensor:
        """Scale gradients by min(1, max_norm / (norm + 1e-6)) on the device: no host sync."""
        norm = global_grad_norm_tensor(shards, self.ctx)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        self.sync.scale_grads(shards, coef)
        return norm

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (including fp32
        master copies, as the ZeRO paper counts them)."""
        return self.sync.memory_breakdown(self.inner)

    # ---- model state -------------------------------------------------------------------
    def pieces(self, saving: bool) -> list[StatePiece]:
        """This rank's model and optimizer state as n-D shard pieces (``optim/state.py``)."""
        return self.sync.pieces(saving, self.inner)

    def after_load(self) -> None:
        self.sync.after_load()

    def scalar_state(self) -> dict[str, Any]:
        """Step counters and loss scale: small, identical on every rank, saved as JSON."""
        self.sync.complete_step()
        groups = []
        for group in self.inner.param_groups:
            state = self.inner.state.get(group["params"][0], {}) if group["params"] else {}
            groups.append({k: float(v) for k, v in state.items()
                           if isinstance(v, torch.Tensor) and v.dim() == 0})
        return {"groups": groups, "scaler": self.scaler.state_dict(),
                "steps_taken": self.steps_taken, "steps_skipped": self.steps_skipped}

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        for group, saved in zip(self.inner.param_groups, state["groups"]):
            for p in group["params"]:
                for k, v in saved.items():
                    if k in self.inner.state.get(p, {}):
                        self.inner.state[p][k].fill_(v)
        self.scaler.load_state_dict(state["scaler"])
        self.steps_taken = state["steps_taken"]
        self.steps_skipped = state["steps_skipped"]

    def materialize_state(self) -> None:
        """Create the inner optimizer's lazily built state (zeros) without changing anything,
        so loading has tensors to fill (``GradSync.materialize_state``)."""
        self.sync.materialize_state(self.inner)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, copied: every piece it holds and the scalar state. It loads back
        only under the same plan on the same rank; ``kernels_runtime.checkpoint`` saves and
        reshards across plans."""
        pieces = [(_shard_dict(p), {k: v.detach().clone() for k, v in p.values.items()})
                  for p in self.pieces(saving=False)]
        return {"pieces": pieces, "scalar": self.scalar_state(),
                "has_state": bool(self.inner.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned on this rank under the same plan."""
        saved = {_shard_key(d): values for d, values in state["pieces"]}
        self.materialize_state()
        with torch.no_grad():
            for piece in self.pieces(saving=False):
                key = (piece.shard.name, piece.shard.offsets, piece.shard.sizes)
                if key not in saved:
                    raise ValueError(
                        f"{piece.shard} is not in this state dict: it loads only under the plan "
                        "and on the rank that made it; use kernels_runtime.checkpoint.save/load "
                        "to change plans")
                for k, view in piece.values.items():
                    if k in saved[key]:
                        view.copy_(saved[key][k])
        if not state.get("has_state", True):
            self.inner.state.clear()
        self.load_scalar_state(state["scalar"])
        self.after_load()


def _share_groups(optimizer: torch.optim.Optimizer,
                  inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Point the user's optimizer at the inner optimizer's group dicts, so whatever a scheduler
    built on it writes (``lr``, momentum, ...) is what the rebuilt optimizer steps with. The
    user's optimizer must not step itself any more: its groups now hold the runtime's tensors."""
    optimizer.param_groups = inner.param_groups
    return optimizer


def _shard_dict(piece: StatePiece) -> dict[str, Any]:
    s = piece.shard
    return {"name": s.name, "shape": s.shape, "offsets": s.offsets, "sizes": s.sizes}


def _shard_key(d: dict[str, Any]) -> tuple:
    return d["name"], tuple(d["offsets"]), tuple(d["sizes"])
