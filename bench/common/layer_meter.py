"""Counters read at a transformer block's boundaries, forward and backward.

``LayerMeter`` reads two counters: the instrumented collectives' calls and bytes on the "tp"
group (``comm.stats``), and what the process wrote to file descriptors (``wchar`` of
``/proc/self/io``). gloo sends with ``writev`` on TCP sockets, which ``wchar`` counts (its
receives use ``recv``, which ``rchar`` does not see), and ``/proc/self/io`` sums every thread of
the process, gloo's own included. Forward boundaries are forward (pre-)hooks; backward ones are
hooks on the gradients of the block's output (its backward starts) and input (it has ended).
Our collectives are synchronous, so each op lands in the block that issued it; DTensor's are
asynchronous, and gloo's writes for an op issued just before a block may land in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kernels_runtime.memory.saved_activations import SavedActivations, is_parameter

Reading = tuple[int, dict[str, tuple[int, int]]]  # (wchar, {op: (calls, bytes)} on "tp")


def wchar() -> int:
    """Bytes this process (all its threads) has passed to write/writev so far."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def _read(stats) -> Reading:
    counts: dict[str, tuple[int, int]] = {}
    if stats is not None:
        for op, groups in stats.snapshot().items():
            if "tp" in groups:
                counts[op] = (int(groups["tp"]["calls"]), int(groups["tp"]["bytes"]))
    return wchar(), counts


def _delta(start: Reading, end: Reading) -> dict:
    ops = {}
    for op, (calls, nbytes) in end[1].items():
        c0, b0 = start[1].get(op, (0, 0))
        if calls - c0:
            ops[op] = (calls - c0, nbytes - b0)
    return {"wchar": end[0] - start[0], "ops": ops}


class LayerMeter:
    """``with LayerMeter(blocks, stats) as meter:`` one forward and backward; then
    ``meter.blocks[i][pass]`` and ``meter.passes[pass]`` are ``{"wchar", "ops"}`` deltas."""

    def __init__(self, blocks: list[nn.Module], stats=None) -> None:
        self.modules, self.stats = blocks, stats
        self._marks: dict[tuple[int, str], list[Reading]] = {}
        self._handles: list = []
        self._points: list[Reading] = []

    def read(self) -> Reading:
        """One reading of the counters (a subclass may read other groups)."""
        return _read(self.stats)

    def mark(self) -> None:
        """A pass boundary: call before forward, between forward and backward, after backward."""
        self._points.append(self.read())

    def _at(self, i: int, pass_: str) -> Callable:
        def hook(*_: Any) -> None:
            self._marks.setdefault((i, pass_), []).append(self.read())
        return hook

    def __enter__(self) -> LayerMeter:
        for i, block in enumerate(self.modules):
            def pre(module, args, kwargs, i=i):
                self._at(i, "forward")()
                x = args[0] if args else kwargs["hidden_states"]
                if x.requires_grad:  # fires once its gradient is complete: block i's backward ends
                    x.register_hook(lambda g, i=i: self._at(i, "backward")())

            def post(module, args, output, i=i):
                self._at(i, "forward")()
                out = output[0] if isinstance(output, tuple) else output
                out.register_hook(lambda g, i=i: self._at(i, "backward")())  # it starts

            self._handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(block.register_forward_hook(post))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()

    @property
    def blocks(self) -> list[dict[str, dict]]:
        return [{p: _delta(*self._marks[(i, p)]) for p in ("forward", "backward")}
                for i in range(len(self.modules))]

    @property
    def passes(self) -> dict[str, dict]:
        start, mid, end = self._points
        return {"forward": _delta(start, mid), "backward": _delta(mid, end)}


class LocalSavedActivations(SavedActivations):
    """``SavedActivations`` that counts a DTensor (or funcol's ``AsyncCollectiveTensor``) by
    the plain tensors inside it: what this rank holds."""

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not is_parameter(t):  # parameters are model state, as in SavedActivations
            for inner in _plain_tensors(t):
                super()._pack(inner)
        return t


def layer_delta(blocks: list[dict], pass_: str) -> dict:
    """One layer's reading from a ``LayerMeter``'s ``blocks``: the block with the fewest
    collective bytes (then wchar). A block can only hold more than a layer: hooks of the first
    and last blocks split and gather the sequence under SP, and then count in them."""
    return min((b[pass_] for b in blocks),
               key=lambda d: (sum(n for _, n in d["ops"].values()), d["wchar"]))


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, name) for name in names]
    return [p for x in inner if isinstance(x, torch.Tensor) for p in _plain_tensors(x)]

