"""Splitting a backward into its input-gradient part (B) and its weight-gradient part (W).

Zero-bubble schedules (Qi et al. 2024) send the input gradient upstream as soon as it exists
and compute weight gradients later, in what would be bubbles. Almost all of a transformer's
weight-gradient work is in its linear layers (``x @ W.T``: the weight gradient is
``g.T @ x``), so those are the ones deferred: while a zbv forward runs, a torch function mode
routes every linear op on a trainable parameter (``F.linear``: ``nn.Linear`` and the
tensor-parallel layers; ``torch.addmm`` or ``x @ W`` with the weight as the second matrix:
GPT-2's ``Conv1D`` and its tensor-parallel shards) through ``DeferrableLinear``, whose
backward returns the input gradient and queues the weight and bias gradients under the
micro-batch's key. The ``W`` action runs the queue:
each gradient goes into its parameter through autograd (``torch.autograd.backward`` on the
leaf), so gradient hooks (data parallelism's buckets) fire exactly as in an ordinary backward.
Other parameters (norms, embeddings) get their gradients in B, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

Key = tuple[int, int]  # (chunk, micro-batch)


class DeferredGrads:
    """The queued weight-gradient work of one step, per (chunk, micro-batch)."""

    def __init__(self) -> None:
        self.queues: dict[Key, list[Callable[[], None]]] = {}
        self.deferring_key: Key | None = None
        self.ran = 0  # weight-gradient computations W has run (the deferred work, counted)

    @contextlib.contextmanager
    def recording(self, chunk: int, mb: int) -> Iterator[None]:
        """During a forward: linear ops on trainable weights become deferrable."""
        with _DeferrableLinearMode(self, (chunk, mb)):
            yield

    @contextlib.contextmanager
    def deferring(self, chunk: int, mb: int) -> Iterator[None]:
        """During a B: the recorded linear ops queue their weight gradients."""
        self.deferring_key = (chunk, mb)
        try:
            yield
        finally:
            self.deferring_key = None

    def run(self, chunk: int, mb: int) -> None:
        """The W action: every queued weight gradient of this chunk and micro-batch."""
        for work in self.queues.pop((chunk, mb), []):
            work()
            self.ran += 1

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())


class DeferrableLinear(torch.autograd.Function):
    """``x @ W.T + b`` (``transposed``: ``x @ W + b``, W stored (in, out)) whose backward
    defers the weight and bias gradients when its owner is deferring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transposed: bool, owner: DeferredGrads, key: Key) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.transposed, ctx.owner, ctx.key = bias is not None, transposed, owner, key
        ctx.params = (weight, bias)  # the leaves themselves: W adds their gradients
        w = weight.t() if transposed else weight
        return nn.functional.linear(x, w, bias)  # (..., out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        w = weight.t() if ctx.transposed else weight  # (out, in)
        grad_x = grad @ w if ctx.needs_input_grad[0] else None  # (..., in)
        wants_weight = ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2])

        def weight_grads() -> tuple[torch.Tensor, torch.Tensor | None]:
            g2 = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
            gw = g2.t() @ x.reshape(-1, x.shape[-1])  # (out, in)
            gb = g2.sum(0) if ctx.has_bias else None
            return (gw.t() if ctx.transposed else gw), gb

        owner, key = ctx.owner, ctx.key
        if not wants_weight:
            return grad_x, None, None, None, None, None
        if owner.deferring_key != key:  # an ordinary backward (checkpoint replay, tests)
            gw, gb = weight_grads()
            return grad_x, gw, gb, None, None, None
        params = ctx.params

        def work() -> None:
            gw, gb = weight_grads()
            tensors = [p for p in params if p is not None and p.requires_grad]
            grads = [g for p, g in zip(params, (gw, gb)) if p is not None and p.requires_grad]
            torch.autograd.backward(tensors, grads)

        owner.queues.setdefault(key, []).append(work)
        return grad_x, None, None, None, None, None


def _trainable(t: Any) -> bool:
    return isinstance(t, nn.Parameter) and t.requires_grad


def _leaf_or_constant(bias: Any) -> bool:
    """A bias whose gradient W can add: none, a parameter, or a tensor needing no gradient."""
    return bias is None or isinstance(bias, nn.Parameter) or not bias.requires_grad


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class _DeferrableLinearMode(TorchFunctionMode):
    def __init__(self, owner: DeferredGrads, key: Key) -> None:
        super().__init__()
        self.owner, self.key = owner, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            if func is nn.functional.linear and len(args) >= 2 and _trainable(args[1]):
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                if _leaf_or_constant(bias):
                    return self._apply(args[0], args[1], bias, False)
            if func is torch.addmm and len(args) == 3 and not kwargs and _trainable(args[2]) \
                    and _leaf_or_constant(args[0]):
                return self._apply(args[1], args[2], args[0], True)
            if func in _MATMULS and len(args) == 2 and not kwargs and _trainable(args[1]) \
                    and args[1].dim() == 2:
                return self._apply(args[0], args[1], None, True)
        return func(*args, **kwargs)

    def _apply(self, x: torch.Tensor, weight: nn.Parameter, bias: Any,
               transposed: bool) -> torch.Tensor:
        return DeferrableLinear.apply(x, weight, bias, transposed, self.owner, self.key)
