"""Splitting a backward into its input-gradient part (B) and its weight-gradient part (W).

Zero-bubble schedules (Qi et al. 2024) send the input gradient upstream as soon as it exists
and compute weight gradients later, in what would be bubbles. Almost all of a transformer's
weight-gradient work is in its linear layers (``x @ W.T``: the weight gradient is
``g.T @ x``), so those are the ones deferred. ``install`` gives every linear layer of a stage
(``nn.Linear``, transformers' ``Conv1D`` with its (in, out) weight, and the local matmul of
the tensor-parallel layers, their ``project``) a forward that, while a zbv forward records,
runs through ``DeferrableLinear``: its backward returns the input gradient and queues the
weight and bias gradients under the micro-batch's key. The ``W`` action runs the queue: each
gradient goes into its parameter through autograd (``torch.autograd.backward`` on the leaf),
so gradient hooks (data parallelism's buckets) fire as in an ordinary backward. Other
parameters (norms, embeddings) get their gradients in B. An activation-checkpoint replay inside
a B records the same way (it must save what the forward saved); outside a zbv forward or B
(other schedules, evaluation) the layers run as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

Key = tuple[int, int]  # (chunk, micro-batch)


class DeferredGrads:
    """The queued weight-gradient work of one step, per (chunk, micro-batch)."""

    def __init__(self) -> None:
        self.queues: dict[Key, list[Callable[[], None]]] = {}
        self.recording_key: Key | None = None
        self.deferring_key: Key | None = None
        self.ran = 0  # weight-gradient computations W has run (the deferred work, counted)

    @contextlib.contextmanager
    def recording(self, chunk: int, mb: int) -> Iterator[None]:
        """During a forward: the installed linear layers become deferrable."""
        self.recording_key = (chunk, mb)
        try:
            yield
        finally:
            self.recording_key = None

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

        owner, key, params = ctx.owner, ctx.key, ctx.params
        if not wants_weight:
            return grad_x, None, None, None, None, None
        if owner.deferring_key != key:  # an ordinary backward (tests, a full B)
            gw, gb = weight_grads()
            return grad_x, gw, gb, None, None, None

        def work() -> None:
            gw, gb = weight_grads()
            pairs = [(p, g) for p, g in zip(params, (gw, gb))
                     if isinstance(p, torch.Tensor) and p.requires_grad]
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])

        owner.queues.setdefault(key, []).append(work)
        return grad_x, None, None, None, None, None


class _Deferring:
    """A layer's replacement ``forward`` (or ``project``): the original outside a recording
    forward, ``DeferrableLinear`` inside one. A class, not a closure, so copies stay apart."""

    def __init__(self, module: nn.Module, original: Callable[..., Any], owner: DeferredGrads,
                 transposed: bool, with_bias: bool) -> None:
        self.module, self.original, self.owner = module, original, owner
        self.transposed, self.with_bias = transposed, with_bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # a B's activation-checkpoint replay takes the same path as the forward it replays
        key, m = self.owner.recording_key or self.owner.deferring_key, self.module
        if key is None or not torch.is_grad_enabled() or not m.weight.requires_grad:
            return self.original(x)
        bias = m.bias if self.with_bias else None
        return DeferrableLinear.apply(x, m.weight, bias, self.transposed, self.owner, key)


def install(model: nn.Module, owner: DeferredGrads) -> int:
    """Make the stage's linear layers deferrable; returns how many were."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        if isinstance(module, nn.Linear):
            module.forward = _Deferring(module, module.forward, owner, False, True)
        elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers'
            module.forward = _Deferring(module, module.forward, owner, True, True)
        elif callable(getattr(module, "project", None)) and hasattr(module, "transposed"):
            module.project = _Deferring(module, module.project, owner,
                                        bool(module.transposed), False)
        else:
            continue
        count += 1
    return count
