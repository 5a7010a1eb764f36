"""A pipeline stage made from the user's unchanged model: its blocks kept, the rest stubbed.

The stage runs the model's own forward, so every piece of glue between the blocks (causal
masks, position ids, rotary tables, dropout) is computed by the model's code on every stage,
exactly as in one process: this is why HF GPT-2 and LLaMA run unchanged, where a traced or
hand-written sequential wrapper breaks on rotary embeddings. Three edits make the forward a
stage's:

- the block container (``transformer.h``, ``model.layers``, or an ``nn.Sequential`` model
  itself) keeps only this rank's blocks, under their original indices, so parameter names
  and checkpoints are the same as in one process; during a chunk's forward it holds only that
  chunk's blocks (``StageBlocks.running``);
- on a rank without the first stage, the modules before the blocks that hold parameters (token
  and position embeddings) become ``ZeroEmbedding``s of the right shape (a composite embedding
  module keeps its code with its parameters hollowed into zeros, ``hollow``), and a pre-hook on
  the chunk's first block replaces its input with the activation received from the previous
  stage;
- on a rank without the last stage, the modules after the blocks (final norm, heads) become
  ``DroppedModule``s, and a hook on the chunk's last block ends the forward there by raising
  ``StageExit`` with that block's output, which the executor sends on.

A parameter tied between a module before and one after the blocks (GPT-2's token embedding and
LM head) stays on the first and the last stage under its canonical name; the executor sums its
gradient over the two (the context's ``embedding`` group) so both copies stay identical.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kernels_runtime.parallel.pipeline.dropout_seeds import BlockSeeds


class StageExit(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by the hook on a chunk's last block: the forward of this stage ends here."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.output = output


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding on later stages: zeros of the embedding's output shape (the
    next block's input is replaced anyway). Keeps a tied ``weight`` so its name is canonical."""

    def __init__(self, dim: int, dtype: torch.dtype, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype
        if weight is not None:
            self.weight = weight

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class DroppedModule(nn.Module):
    """A module of another pipeline stage; its forward is never reached on this one."""

    def __init__(self, original: nn.Module, stage: str) -> None:
        super().__init__()
        self.what, self.stage = type(original).__name__, stage
        for key, value in vars(original).items():  # flags other code sets (gather_output)
            if not key.startswith("_") and isinstance(value, (bool, int, float, str)):
                setattr(self, key, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.what} runs on the {self.stage} pipeline stage, not this one")


class StageBlocks:
    """This rank's blocks inside their container, per chunk, with the hooks that cut the
    forward to one chunk."""

    def __init__(self, container: nn.Module, chunks: list[list[int]],
                 seeds: BlockSeeds | None = None, carry: Any = None) -> None:
        # carry: packs what else a stage passes on behind its activation and unpacks it on
        # the next (``pack(hidden)``, ``unpack(incoming, placeholder)``; ep's router sums)
        self.container, self.seeds, self.carry = container, seeds, carry
        every = container._modules
        keys = list(every)
        self.chunks: list[OrderedDict[str, nn.Module]] = [
            OrderedDict((keys[i], every[keys[i]]) for i in chunk) for chunk in chunks]
        self.local: OrderedDict[str, nn.Module] = OrderedDict(
            kv for chunk in self.chunks for kv in chunk.items())
        container._modules = OrderedDict(self.local)
        self._incoming: torch.Tensor | None = None
        self._entry: nn.Module | None = None
        self._exit: nn.Module | None = None
        if seeds is not None:  # every block seeds its dropout from its index (dropout_seeds)
            for key, block in self.local.items():
                block.register_forward_pre_hook(functools.partial(_seed, seeds, keys.index(key)))
        for chunk in self.chunks:
            first, last = next(iter(chunk.values())), next(reversed(chunk.values()))
            first.register_forward_pre_hook(self._replace_input, with_kwargs=True)
            last.register_forward_hook(self._end_stage)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.local.values())

    @contextlib.contextmanager
    def running(self, chunk: int, incoming: torch.Tensor | None, exits: bool) -> Iterator[None]:
        """Within the block, the container iterates chunk ``chunk`` only; its first block takes
        ``incoming`` (None: the stage's own embeddings) and with ``exits`` its last ends the
        forward (``StageExit``)."""
        blocks = self.chunks[chunk]
        self.container._modules = OrderedDict(blocks)
        self._incoming = incoming
        self._entry = next(iter(blocks.values()))
        self._exit = next(reversed(blocks.values())) if exits else None
        try:
            yield
        finally:
            self.container._modules = OrderedDict(self.local)
            self._incoming = self._entry = self._exit = None

    def _replace_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if module is not self._entry or self._incoming is None:
            return None
        incoming, self._incoming = self._incoming, None
        if self.carry is not None:
            incoming = self.carry.unpack(incoming, args[0] if args else
                                         kwargs.get("hidden_states", incoming))
        if args:
            return (incoming, *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": incoming}
        return (incoming,), kwargs

    def _end_stage(self, module: nn.Module, args: tuple, output: Any) -> None:
        if module is self._exit:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(hidden, torch.Tensor):
                raise TypeError(f"a pipeline stage ends at a block that returned "
                                f"{type(hidden).__name__}; stages pass one tensor between them")
            raise StageExit(self.carry.pack(hidden) if self.carry is not None else hidden)


def _seed(seeds: BlockSeeds, index: int, module: nn.Module, args: tuple) -> None:
    seeds.seed_block(index)


def find_container(model: nn.Module, blocks: list[nn.Module]) -> tuple[str, nn.Module] | None:
    """The module whose children are exactly ``blocks`` (a ModuleList or Sequential)."""
    ids = [id(b) for b in blocks]
    for name, module in model.named_modules():
        children = list(module._modules.values())
        if children and [id(c) for c in children] == ids:
            return name, module
    return None


def stub_before(model: nn.Module, paths: list[str], keep: dict[int, nn.Parameter],
                dtype: torch.dtype) -> list[str]:
    """Replace the modules at ``paths`` that hold parameters by ``ZeroEmbedding``s; a tied
    weight in ``keep`` (by id) stays on the stub. Returns the paths replaced."""
    replaced = []
    for path in paths:
        module = model.get_submodule(path)
        weight = getattr(module, "weight", None)
        if not any(True for _ in module.parameters()):
            continue
        if isinstance(weight, nn.Parameter):
            tied = keep.get(id(weight))
            _set(model, path, ZeroEmbedding(int(weight.shape[-1]), dtype, tied))
        else:
            hollow(module, keep, dtype)
        replaced.append(path)
    return replaced


def hollow(module: nn.Module, keep: dict[int, nn.Parameter], dtype: torch.dtype) -> None:
    """Turn the parameters of a composite embedding (BERT's word, position and token-type
    embeddings with their norm; ViT's patch projection, class token and positions) into zeros
    that take no memory: non-persistent buffers of one element expanded to the parameter's
    shape. The module's own forward still runs, so its output has exactly the shape and dtype
    the model's glue code reads (masks are built from it), and attributes the model reads
    (``patch_embeddings.projection.weight.dtype``) are still there; the parameters are gone
    from this stage, as other stages' blocks are. A tied parameter in ``keep`` stays."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or id(p) in keep:
                continue
            del sub._parameters[name]
            zeros = torch.zeros((), dtype=dtype, device=p.device).expand(p.shape)
            sub.register_buffer(name, zeros, persistent=False)


def drop_after(model: nn.Module, paths: list[str], stage: str) -> list[str]:
    for path in paths:
        _set(model, path, DroppedModule(model.get_submodule(path), stage))
    return list(paths)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def tied_across(model: nn.Module, before: list[str], after: list[str]) -> dict[int, str]:
    """Parameters used both by a module before the blocks and one after them (id -> the
    canonical name, the first under which the model lists it)."""
    def owned(paths: list[str]) -> dict[int, str]:
        out = {}
        for path in paths:
            for name, p in model.get_submodule(path).named_parameters(remove_duplicate=False):
                out[id(p)] = f"{path}.{name}"
        return out

    first, last = owned(before), owned(after)
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {pid: canonical[pid] for pid in first if pid in last and pid in canonical}
