"""Deferred parameters: build a model larger than memory, materialize it one unit at a time.

A model whose parameters do not fit in RAM cannot be built and then offloaded: building it is
already too much. Under ``deferred_parameters()`` every parameter a module registers lives on
PyTorch's ``meta`` device (shape and dtype, no storage) while buffers stay real, since
non-persistent buffers (causal masks, rotary frequencies) are computed at construction and
nothing could recompute them later. The offload applier then materializes one unit (a block,
or the modules outside the blocks) right before packing its chunks and moves those chunks to
their tier before the next unit is built, so no more than one unit's parameters exist in
memory at once beyond what the budgets keep.

Initialization is the model's own: a Hugging Face model's ``_init_weights`` applied over the
unit's modules (children first, so a parent's scaled initialization of an output projection
wins), else each module's ``reset_parameters()``. A module with meta parameters and neither is
an error naming it. Across data-parallel ranks the chunk values are broadcast from the first
rank, as built models' parameters are.

A model ``mark_to_be_loaded`` (``checkpoint.pretrained``) is different: a loader fills every
piece after ``parallelize`` from a file all ranks read, so under any plan the appliers give
storage only to what the rank holds (zeros: no initialization, no broadcast), and the data
applier accepts it without an offloading plan.

Why here, a module of its own low in the layers: the data appliers (``parallel/data``), the
offload applier (``memory/chunk_sync.py``) and the pretrained loader (``checkpoint``) all read
it, and ``parallel`` sits below ``memory``, so it cannot live in ``memory/``; it imports
nothing of the runtime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn


@contextlib.contextmanager
def deferred_parameters() -> Iterator[None]:
    """``with deferred_parameters(): model = GPT2LMHeadModel(config)``: parameters on the meta
    device, buffers real; ``parallelize`` under an offloading plan materializes them."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def has_deferred(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


_TO_BE_LOADED = "_deferred_to_be_loaded"


def mark_to_be_loaded(model: nn.Module) -> None:
    """Say that a loader fills every parameter of ``model`` after ``parallelize`` (each rank
    its own pieces, from a file): the appliers then give deferred parameters storage only
    where this rank holds them, as zeros, with no initialization and no broadcast."""
    model.__dict__[_TO_BE_LOADED] = True


def to_be_loaded(model: nn.Module) -> bool:
    return bool(model.__dict__.get(_TO_BE_LOADED))


def allocate(params: Iterable[nn.Parameter], device: torch.device) -> None:
    """Zeros in place of each meta parameter (the same ``Parameter`` object, so optimizers,
    tied modules and layouts keep pointing at it, and its attributes: ``swap_tensors`` swaps
    ``__dict__`` too, which would drop marks such as the expert applier's); real ones are left
    alone."""
    for p in params:
        if p.is_meta:
            real = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                requires_grad=p.requires_grad)
            real.__dict__.update(p.__dict__)
            torch.utils.swap_tensors(p, real)


def move_real(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)`` for whatever has storage: meta parameters stay where they are."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.is_meta and p.device != device:
                p.data = p.data.to(device)
        for name, b in module.named_buffers(recurse=False):
            if b.device != device:
                module._buffers[name] = b.to(device)


def materialize(root: nn.Module, modules: Iterable[nn.Module], device: torch.device) -> None:
    """Give storage to the meta parameters owned by ``modules`` and initialize them the way
    ``root`` initializes itself (see the module docstring); a model ``to_be_loaded`` gets
    zeros, which its loader overwrites."""
    modules = list(modules)
    owners = [m for m in modules if any(p.is_meta for p in m.parameters(recurse=False))]
    if not owners:
        return
    for m in owners:  # the same Parameter objects: the optimizer and layouts know them
        allocate(m.parameters(recurse=False), device)
    if to_be_loaded(root):
        return
    init = getattr(root, "_init_weights", None)
    with torch.no_grad():
        for m in reversed(modules):  # children (registered after their parent) first
            if init is not None:
                init(m)
            elif m in owners:
                reset = getattr(m, "reset_parameters", None)
                if reset is None:
                    raise TypeError(
                        f"{type(m).__name__} has parameters on the meta device and no "
                        "reset_parameters() to initialize them: build this model without "
                        "deferred_parameters(), or give the module a reset_parameters()")
                reset()
