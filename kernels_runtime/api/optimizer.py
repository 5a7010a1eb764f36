"""``BoostedOptimizer``: the optimizer a user gets back from ``parallelize``.

It keeps the familiar surface (``backward(loss)``, ``step()``, ``zero_grad()``,
``state_dict()``) while the strategy underneath decides where gradients and optimizer states
live. The step is the same for every strategy:

    finish gradient sync -> unscale (fp16) and agree on overflow across ranks -> clip by the
    global norm across shards -> inner optimizer step on fp32 masters -> publish parameters

Strategies implement the four hooks ``_finish_grad_sync``, ``_master_grads``,
``_publish_params`` and ``_zero_grads``; ``_grads_sharded`` says whether the norm needs a sum
over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.precision.loss_scaler import DynamicLossScaler, NoLossScaler, has_inf_or_nan

# Optimizers whose update of each element depends only on that element's own history: exact
# on flattened, sharded parameters. Others (LAMB, Adafactor, Shampoo, Muon) need whole tensors.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "RMSprop", "Adagrad", "NAdam",
                          "RAdam", "ASGD", "Rprop")


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if name not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(
            f"{name} is not element-wise: data parallelism here runs the optimizer on flattened "
            f"parameter shards, which is exact only for {', '.join(ELEMENTWISE_OPTIMIZERS)}"
        )


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]]
) -> torch.optim.Optimizer:
    """The same optimizer class and per-group hyperparameters, over new tensors."""
    new_groups = []
    for group, tensors in zip(optimizer.param_groups, groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        new_groups.append({"params": tensors, **settings})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(new_groups, **defaults)


@dataclass(frozen=True)
class Segment:
    """A flat range [start, end) of one parameter (flattened in row-major order): the unit in
    which sharded states are saved and loaded, independent of any plan's sharding."""

    name: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


SegmentValues = dict[str, torch.Tensor]  # "master" -> fp32 values, plus optimizer state keys


class BoostedOptimizer:
    """Strategy-independent step logic; see the module docstring.

    Checkpoints see every strategy through the same four methods: ``saved_segments`` (what this
    rank writes), ``needed_segments`` (what its storage needs on load), ``load_segments`` and
    ``scalar_state``/``load_scalar_state``.
    """

    _grads_sharded = False

    def __init__(self, ctx: ParallelContext, precision: str, max_grad_norm: float | None) -> None:
        self.ctx = ctx
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.scaler = DynamicLossScaler() if precision == "fp16" else NoLossScaler()
        self.inner: torch.optim.Optimizer  # set by the strategy
        self.sync_grads = True
        self.last_grad_norm: float | None = None
        self.steps_taken = 0
        self.steps_skipped = 0

    # ---- user surface ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups: change ``lr`` here, or wrap ``self.inner`` in an LR
        scheduler."""
        return self.inner.param_groups

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16."""
        (loss * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches before the last) without communication."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def step(self) -> bool:
        """One optimizer step; returns False when fp16 overflow made it skip."""
        self._finish_grad_sync()
        grads = self._master_grads()
        if isinstance(self.scaler, DynamicLossScaler):
            inv = 1.0 / self.scaler.scale
            for g in grads:
                g.mul_(inv)
            found = has_inf_or_nan(grads)
            self.ctx.comm.all_reduce(found, op=dist.ReduceOp.MAX, group=self.ctx.dp_group)
            if found.item() > 0:
                self.scaler.update(True)
                self.steps_skipped += 1
                self.zero_grad()
                return False
            self.scaler.update(False)
        if self.max_grad_norm is not None:
            self.last_grad_norm = self._clip(grads, self.max_grad_norm)
        self.inner.step()
        self._publish_params()
        self.steps_taken += 1
        self.zero_grad()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grads()

    def global_grad_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm of the full gradient, summing squares over shards when they are sharded."""
        sq = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self._grads_sharded:
            self.ctx.comm.all_reduce(sq, group=self.ctx.dp_group)
        return math.sqrt(sq.item())

    def _clip(self, grads: list[torch.Tensor], max_norm: float) -> float:
        norm = self.global_grad_norm(grads)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    # ---- strategy hooks ----------------------------------------------------------------
    def _finish_grad_sync(self) -> None:
        raise NotImplementedError

    def _master_grads(self) -> list[torch.Tensor]:
        """fp32 gradient tensors, set as ``.grad`` of the inner optimizer's tensors."""
        raise NotImplementedError

    def _publish_params(self) -> None:
        raise NotImplementedError

    def _zero_grads(self) -> None:
        raise NotImplementedError

    # ---- checkpoint surface ------------------------------------------------------------
    def saved_segments(self) -> list[tuple[Segment, SegmentValues]]:
        raise NotImplementedError

    def needed_segments(self) -> list[Segment]:
        raise NotImplementedError

    def load_segments(self, fetch: Callable[[Segment], SegmentValues]) -> None:
        raise NotImplementedError

    def scalar_state(self) -> dict[str, Any]:
        """Step counters and loss scale: small, identical on every rank, saved as JSON."""
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
        """Create the inner optimizer's lazily built state (zeros) without changing anything:
        one step with zero gradients at learning rate 0. Loading then overwrites it."""
        params = [p for g in self.inner.param_groups for p in g["params"]]
        if all(p in self.inner.state for p in params):
            return
        lrs = [g["lr"] for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.inner.step()
        for g, lr in zip(self.inner.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (including fp32
        master copies, as the ZeRO paper counts them)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """This rank's own share of the state, copied: ``{"segments": [(asdict(Segment),
        values), ...], "scalar": scalar_state()}``. It loads back only under the same plan on
        the same rank; ``kernels_runtime.checkpoint`` saves and reshards across plans."""
        import dataclasses  # local: this class may only grow by these two methods

        segments = [(dataclasses.asdict(seg), {k: v.detach().clone() for k, v in values.items()})
                    for seg, values in self.saved_segments()]
        return {"segments": segments, "scalar": self.scalar_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned on this rank under the same plan."""
        import collections
        saved = {Segment(d["name"], tuple(d["shape"]), d["start"], d["end"]): values
                 for d, values in state["segments"]}
        has_state = any(len(values) > 1 for values in saved.values())

        def fetch(seg: Segment) -> SegmentValues:
            if seg not in saved:
                raise ValueError(
                    f"{seg} is not in this state dict: it loads only under the plan and on the "
                    "rank that made it (and not for replicated zero=0 states with dp > 1, "
                    "whose saved share is smaller than what each rank holds); use "
                    "kernels_runtime.checkpoint.save/load to change plans")
            if has_state:
                return saved[seg]
            # saved before the first step: any state asked for is zeros, then dropped below
            return collections.defaultdict(lambda: torch.zeros(seg.numel), saved[seg])

        self.load_segments(fetch)
        if not has_state:
            self.inner.state.clear()
        self.load_scalar_state(state["scalar"])


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1]
