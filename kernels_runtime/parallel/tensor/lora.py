"""LoRA adapters under tensor parallelism (1D and the 2D / 2.5D grids): a peft LoRA layer
whose frozen base is split.

A LoRA layer computes y = x W + s (x A) B, W frozen, A (in -> r) and B (r -> out) trained, s
the adapter's scaling. Its factors split with W, so each rank's adapter adds to exactly the
base output it holds:

- column-parallel W (output columns split): A whole, B split by the same output columns (a
  fused projection's parts and key/value heads alike). The input is replicated, entered once
  with the layer's neighbours (``layers.SharedEntry``): y_i = x W_i + s (x A) B_i. Rank i's
  gradient of A, x^T (dy_i B_i^T), is its own columns' share, so A enters through
  ``copy_to_group``: its (r, in) gradient is summed over tp in backward.
- row-parallel W (input rows split): A split by the same input rows, B whole. x_i A_i is a
  partial sum of x A, so (x_i A_i) B is one of (x A) B: it is added to the partial x_i W_i
  before the layer's one all-reduce (or reduce-scatter under sequence parallelism), no extra
  collective in forward. B's gradient (x_i A_i)^T dy is rank i's share: summed over tp.

So the only extra collectives sum an r x in or out factor gradient per layer, never an
activation.

On the 2D / 2.5D grid (``grid/``) every base is a ``Linear2D``: rank (k, i, j) holds input
block X[k,i,j] (b/(d*q), s, in/q) and output block Y[k,i,j] (.., out/q), and both factors split
by the features the rank holds: A by input columns, chunk j (r, in/q), B by output rows, chunk
j of each fused part (out/q, r), like the base's bias. X[k,i,j] A_j^T is column j's part of
x A^T for batch block (k, i): one all-reduce of (.., r) over the row joins it, and its
backward sums the row's partial gradients (each column uses it with its own B_j). Every row
and depth holds the same A_j and B_j for other batch rows, so their gradients are summed down
the column and over the depths (``GridLoraForward``).

Layouts (``ParamLayout``) say which factor is split where, so data parallelism shards the
adapters further and checkpoints write them whole.

peft's layer stays in the model: its ``base_layer`` becomes the column- or row-parallel layer
(or ``Linear2D``), its factors hold their shards, and its forward is this file's
(``SplitLoraForward`` / ``GridLoraForward``, set on the instance: the class's would add the
adapter after the base's all-reduce, or to the wrong block). So names stay peft's
(``base_layer.weight``, ``lora_A.<adapter>.weight``), and peft's switches (``disable_adapter()``,
``set_adapter``) still act on it. What it cannot run split (DoRA and other variants, factor
biases, adapters on embeddings, heads or key/value heads replicated across tp, mixed-adapter
batches) is refused (``refusals``) before anything changes.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels_runtime.comm import Collectives
from kernels_runtime.comm.autograd import copy_to_group, reduce_from_group
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.tensor.grid import Grid, split_features
from kernels_runtime.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    enter_column,
)
from kernels_runtime.parallel.tensor.sharding import split_dim
from kernels_runtime.policies import ParamSpec

TP1 = "or use tp=1 (LoRA trains under dp, every ZeRO stage, pp and sp)"


def _active(layer: nn.Module, args: tuple, kwargs: dict, split: frozenset[str]) -> list[str]:
    """The adapters peft's own forward would add now (none while disabled or merged); every
    one must be among those split with the layer (``split``)."""
    if args or kwargs:
        raise ValueError(f"a tensor-parallel LoRA layer takes only its input, got "
                         f"{sorted(kwargs) or len(args)} more (mixed-adapter batches "
                         "are not supported under tensor parallelism)")
    if layer.disable_adapters and layer.merged:
        layer.unmerge()  # as peft's own forward does
    active = [] if layer.disable_adapters or layer.merged else \
        [a for a in layer.active_adapters if a in layer.lora_A]
    late = [a for a in active if a not in split]
    if late:
        raise ValueError(
            f"LoRA adapter {late[0]!r} was added after parallelize: its factors are whole "
            "while this layer's base is split; add every adapter (peft's add_adapter or "
            "load_adapter) before parallelize, or parallelize a freshly built model")
    return active


class SplitLoraForward:
    """The forward of a peft LoRA layer over a column- or row-parallel base (module
    docstring), read live from the layer: its active adapters, scalings and switches. A class,
    not a closure, holding the layer itself as ``pipeline/weight_grad.py``'s does, so a deep
    copy of the model gets a forward of its own copy."""

    def __init__(self, layer: nn.Module, comm: Collectives, group) -> None:
        self.layer, self.comm, self.group = layer, comm, group
        self.split = frozenset(layer.lora_A)  # the adapters cut with the base

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        layer = self.layer
        adapters = _active(layer, args, kwargs, self.split)
        if isinstance(layer.base_layer, RowParallelLinear):
            return self._row(layer, x, adapters)
        return self._column(layer, x, adapters)

    def _column(self, layer: nn.Module, x: torch.Tensor, adapters: list[str]) -> torch.Tensor:
        base = layer.base_layer
        x = enter_column(base, x)  # (b, s, in), replicated (gathered along s under SP)
        y = base.project(x)  # (b, s, out/tp)
        if base.bias is not None:
            y = y + base.bias
        for adapter in adapters:
            a = copy_to_group(layer.lora_A[adapter].weight, self.comm, self.group)  # (r, in)
            h = layer.lora_dropout[adapter](x.to(a.dtype)) @ a.t()  # (b, s, r), replicated
            b = layer.lora_B[adapter].weight  # (out/tp, r)
            y = y + ((h @ b.t()) * layer.scaling[adapter]).to(y.dtype)  # (b, s, out/tp)
        return y

    def _row(self, layer: nn.Module, x: torch.Tensor, adapters: list[str]) -> torch.Tensor:
        base = layer.base_layer
        partial = base.project(x)  # (b, s, out): this rank's share, x is (b, s, in/tp)
        for adapter in adapters:
            a = layer.lora_A[adapter].weight  # (r, in/tp)
            h = layer.lora_dropout[adapter](x.to(a.dtype)) @ a.t()  # (b, s, r), partial
            b = copy_to_group(layer.lora_B[adapter].weight, self.comm, self.group)  # (out, r)
            partial = partial + ((h @ b.t()) * layer.scaling[adapter]).to(partial.dtype)
        return base.reduce(partial)  # (b, s, out), or (b, s/tp, out) under SP


class GridLoraForward:
    """The forward of a peft LoRA layer over a ``Linear2D`` base on the 2D / 2.5D grid
    (module docstring), read live from the layer as ``SplitLoraForward``."""

    def __init__(self, layer: nn.Module, grid: Grid) -> None:
        self.layer, self.grid = layer, grid
        self.split = frozenset(layer.lora_A)  # the adapters cut with the base

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        layer, grid = self.layer, self.grid
        adapters = _active(layer, args, kwargs, self.split)
        y = layer.base_layer(x)  # (b/(d*q), s, out/q): X[k,i,j] in, Y[k,i,j] out
        for adapter in adapters:
            a = _held_by_rows(layer.lora_A[adapter].weight, grid)  # (r, in/q): A[:, chunk j]
            h = layer.lora_dropout[adapter](x.to(a.dtype)) @ a.t()  # (.., r): column j's part
            h = copy_to_group(reduce_from_group(h, grid.comm, grid.row), grid.comm, grid.row)
            b = _held_by_rows(layer.lora_B[adapter].weight, grid)  # (out/q, r): B[chunk j]
            y = y + ((h @ b.t()) * layer.scaling[adapter]).to(y.dtype)  # (.., out/q)
        return y


def _held_by_rows(factor: torch.Tensor, grid: Grid) -> torch.Tensor:
    """A factor chunk every row and depth holds, each using it on other batch rows: its
    gradient is summed down the column and over the depths."""
    factor = copy_to_group(factor, grid.comm, grid.col)
    return copy_to_group(factor, grid.comm, grid.dep) if grid.dep is not None else factor


def split_grid_lora(layer: nn.Module, grid: Grid, parts: int) -> dict[str, ParamLayout]:
    """Cut peft LoRA ``layer``'s factors to match its base, already a ``Linear2D`` (``parts``
    fused outputs), and install the grid forward; returns the factors' layouts, by their names
    under the layer."""
    layouts: dict[str, ParamLayout] = {}
    for factor, dim, factor_parts in (("A", 1, 1), ("B", 0, parts)):
        for adapter, module in getattr(layer, f"lora_{factor}").items():
            local, layout = split_features(module.weight.detach(), grid, factor_parts, dim)
            _shard(module, local)
            layouts[f"lora_{factor}.{adapter}.weight"] = layout
    layer.forward = GridLoraForward(layer, grid)
    return layouts


def is_split_lora(module: nn.Module) -> bool:
    """A LoRA layer whose base this file split: it owns its parts (nothing inside it is
    wrapped or swapped again)."""
    return isinstance(getattr(module, "forward", None), (SplitLoraForward, GridLoraForward))


def _shard(module: nn.Module, local: torch.Tensor) -> None:
    """Give a factor (peft's own ``nn.Linear``) its shard, trainable as the whole was."""
    old = module.weight
    module.weight = nn.Parameter(local, requires_grad=old.requires_grad)
    module.out_features, module.in_features = local.shape


def split_lora(layer: nn.Module, base: ColumnParallelLinear | RowParallelLinear,
               spec: ParamSpec, rank: int, tp: int, comm: Collectives, group,
               ) -> dict[str, ParamLayout]:
    """Put the already split ``base`` under peft LoRA ``layer``, cut its factors to match
    (``spec``: the base weight's) and install the split forward; returns the split factors'
    layouts, by their names under the layer (the whole factors keep the replicated default)."""
    layouts: dict[str, ParamLayout] = {}
    row = isinstance(base, RowParallelLinear)
    for adapter, module in (layer.lora_A if row else layer.lora_B).items():
        weight = module.weight.detach()  # (r, in) for A, (out, r) for B
        parts = 1 if row else max(1, len(spec.fused))
        local, layout = split_dim(weight, 1 if row else 0, rank, tp, parts)
        _shard(module, local)
        layouts[f"lora_{'A' if row else 'B'}.{adapter}.weight"] = layout
    layer.base_layer = base
    layer.forward = SplitLoraForward(layer, comm, group)
    return layouts


def refusals(layer: nn.Module, spec: ParamSpec, replicated_heads: bool) -> list[str]:
    """Why ``layer`` cannot run split (the applier names the layers), one reason each; its
    base goes through the checks of every swapped module (``attributes.py``)."""
    out = []
    if spec.style not in ("column", "row"):
        out.append(f"LoRA adapters on a {spec.style}-parallel module are not supported under "
                   f"tensor parallelism; leave it out of target_modules {TP1}")
    if replicated_heads:
        out.append("LoRA on key/value heads replicated across tp (tp exceeds the key/value "
                   f"heads) is not supported; use a tp dividing them {TP1}")
    if getattr(layer, "lora_variant", None) or any(getattr(layer, "use_dora", {}).values()):
        out.append("a LoRA variant (DoRA, ...) does not split under tensor parallelism, "
                   f"only plain LoRA does; drop the variant {TP1}")
    if any(getattr(m, "bias", None) is not None for m in [*layer.lora_A.values(),
                                                          *layer.lora_B.values()]):
        out.append("adapter biases (lora_bias=True) are not supported under tensor "
                   f"parallelism; drop them {TP1}")
    if type(layer).__name__ != "Linear":
        out.append(f"only peft's LoRA Linear splits under tensor parallelism {TP1}")
    return out
