"""2D and 2.5D tensor parallelism (SUMMA on a q x q grid; Tesseract: d such grids) applied to a
model by its policy's plan.

The same policy data as 1D (``tensor_parallel.py``) decides which module is which; on the grid
the split is different: every linear layer, column- or row-parallel in 1D, is a ``Linear2D``
(SUMMA over the grid's rows and columns), the embedding and a tied LM head share one block of
the vocabulary, norms are ``LayerNorm2D`` / ``RMSNorm2D`` over the hidden chunk, and learned
position embeddings keep their hidden chunk (``ChunkEmbedding``). Hidden states between them
are blocks (b/(d*q), s, h/q): the model's input is cut by batch rows on the way in
(``scatter_ids``), and the outputs are gathered on the way out (``gather_hidden``: the LM
head's logits, or the blocks' output when a replicated head such as a classifier follows), so
HF outputs keep their type and full shape; ``causal_lm_loss`` computes the loss on the blocks
instead (``grid_cross_entropy``). Attention runs unchanged on this rank's batch rows and heads
(the heads split over the q columns; the policy's ``local_attributes`` are divided by q). A
peft LoRA layer stays in place: its frozen base becomes the ``Linear2D`` and its factors are
cut to the features the rank holds (``lora.split_grid_lora``); frozen parameters stay frozen.

Under 2.5D the d grids work on other batch rows with the same weight blocks, whose gradients
the kernels sum over the depth; layouts mark those copies (``ParamLayout.replica``), so the
gradient norm counts them once and checkpoints write them once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kernels_runtime.comm.autograd import copy_to_group
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.tensor.grid import (
    Embedding2D,
    Grid,
    LayerNorm2D,
    Linear2D,
    LMHead2D,
    RMSNorm2D,
    chunk_replica,
    gather_hidden,
    grid_cross_entropy,
    scatter_ids,
    split_features,
)
from kernels_runtime.parallel.tensor.layers import PartialGradModule
from kernels_runtime.parallel.tensor.lora import split_grid_lora
from kernels_runtime.parallel.tensor.tensor_parallel import (
    layouts_for_aliases,
    modules_to_split,
    parent_of,
    same_random_state,
)
from kernels_runtime.policies import ResolvedLayout, find_module, is_lora_layer
from kernels_runtime.policies.specs import AttentionSpec

BATCH_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class ChunkEmbedding(nn.Module):
    """A learned position (or token-type) embedding keeping hidden chunk j, (n, h/q): every
    row (and depth) of the grid looks up its own batch rows, so its gradient is summed down the
    column and over the depths. ``padding_idx`` is the replaced ``nn.Embedding``'s (its row
    gets no gradient); its other attributes are refused before the swap (``attributes.py``)."""

    def __init__(self, weight: torch.Tensor, grid: Grid, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (n, h/q)
        self.grid, self.padding_idx = grid, padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        grid = self.grid
        weight = copy_to_group(self.weight, grid.comm, grid.col)  # grads summed down the column
        if grid.dep is not None:
            weight = copy_to_group(weight, grid.comm, grid.dep)  # and over the depths
        return nn.functional.embedding(ids, weight, self.padding_idx)  # (.., s, h/q)


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight")


def rebuilt_kind(module: nn.Module, hidden: int | None) -> str | None:
    """What a replicated module inside the grid becomes (``_GridSwapper.replicated``): a new
    module built from it ("layer_norm", "rms_norm", "embedding", "conv", "linear": a SUMMA
    layer, as every linear layer on the grid), its own parameters
    cut in place ("own"), or None (left whole)."""
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if _is_rms_norm(module):
        return "rms_norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Conv2d) and module.out_channels == hidden:
        return "conv"
    if isinstance(module, nn.Linear) and module.in_features == hidden:
        return "linear"  # a hidden-to-hidden layer the 1D plan replicates (BERT's MLM transform)
    if any(p.shape[-1] == hidden for p in module.parameters(recurse=False)):
        return "own"
    return None


def rms_norm_eps(module: nn.Module) -> float | None:
    """An RMSNorm's epsilon (LlamaRMSNorm's ``variance_epsilon``, else ``eps``); None if it
    has neither (``nn.RMSNorm(eps=None)``: the dtype's), which the grid refuses."""
    eps = getattr(module, "variance_epsilon", None)
    return eps if eps is not None else getattr(module, "eps", None)


def on_grid(resolved: ResolvedLayout, blocks_path: str | None, head_path: str | None,
            after: tuple[str, ...] = ()) -> Callable[[str], bool]:
    """Whether the module at a path runs on hidden chunks: all but those run after the blocks
    on the joined hidden states (the policy's pipeline glue, when the head is not split)."""
    body = blocks_path.rpartition(".")[0] if blocks_path else ""
    grid_head = head_path in modules_to_split(resolved) if head_path else False

    def chunks(path: str) -> bool:
        outside = bool(body) and not path.startswith(body + ".")
        return grid_head or not outside or not any(path == a or path.startswith(a + ".")
                                                   for a in after)
    return chunks


def grid_replicated(resolved: ResolvedLayout, blocks_path: str | None, head_path: str | None,
                    after: tuple[str, ...] = ()) -> list[str]:
    """Paths of the replicated modules put on the grid, deepest first (the order
    ``apply_grid_parallel`` swaps them in): every one not split that runs on hidden chunks."""
    split = set(modules_to_split(resolved))
    chunks = on_grid(resolved, blocks_path, head_path, after)
    paths = []
    for spec in sorted(resolved.specs.values(), key=lambda s: -s.module.count(".")):
        if spec.adapter:  # a LoRA factor: cut with its layer's base (``_GridSwapper.lora``)
            continue
        if spec.style == "replicated" and spec.module not in split and chunks(spec.module):
            split.add(spec.module)
            paths.append(spec.module)
    return paths


def _chunk(full: torch.Tensor, dim: int, grid: Grid) -> tuple[torch.Tensor, ParamLayout]:
    """Hidden chunk j along ``dim`` of a parameter every row and depth holds (a class token,
    position table, patch projection), with its layout."""
    width = full.shape[dim] // grid.side
    local = full.narrow(dim, grid.j * width, width).contiguous()
    offsets = tuple(grid.j * width if d == dim else 0 for d in range(full.dim()))
    box = ParamLayout.box(tuple(full.shape), offsets, tuple(local.shape), frozenset({"tp"}))
    return local, replace(box, replica=chunk_replica(grid))


class _GridSwapper:
    def __init__(self, model: nn.Module, grid: Grid, hidden: int | None) -> None:
        self.model, self.grid, self.hidden = model, grid, hidden
        self.layouts: dict[str, ParamLayout] = {}
        self.swapped: dict[int, nn.Parameter] = {}
        self._old: list[torch.Tensor] = []
        self.replaced: list[tuple[str, str]] = []

    def put(self, path: str, old: nn.Module, new: nn.Module, layouts: dict[str, ParamLayout],
            how: str) -> None:
        parent, name = parent_of(self.model, path)
        setattr(parent, name, new)
        for attribute, tensor in old.named_parameters(recurse=False):
            replacement = getattr(new, attribute, None)
            if isinstance(replacement, nn.Parameter) and id(tensor) not in self.swapped:
                replacement.requires_grad_(tensor.requires_grad)  # frozen stays frozen (peft)
                self.swapped[id(tensor)] = replacement
                self._old.append(tensor)
        for attribute, layout in layouts.items():
            self.layouts[f"{path}.{attribute}"] = layout
        self.replaced.append((path, f"{type(old).__name__} -> {type(new).__name__} ({how})"))

    def split(self, path: str, spec_style: str, transposed: bool, parts: int) -> None:
        old, grid = self.model.get_submodule(path), self.grid
        if self._lora_layer(path) is not None:
            self.lora(path, transposed, parts)
            return
        if spec_style == "vocab" and isinstance(old, nn.Embedding):
            new = Embedding2D.from_full(old.weight, grid, old.padding_idx)
            self.put(path, old, new, new.layouts, "vocabulary x hidden block")
            return
        if spec_style == "vocab":
            embedding = self.swapped.get(id(old.weight))
            owner = next((m for m in self.model.modules() if isinstance(m, Embedding2D)
                          and m.weight is embedding), None)
            if owner is not None:
                new = LMHead2D.tied(owner, getattr(old, "bias", None))
            else:
                new = LMHead2D.untied(old.weight, grid, getattr(old, "bias", None))
            new.gather_output = True
            self.put(path, old, new, new.layouts, "vocabulary x hidden block, tied"
                     if owner is not None else "vocabulary x hidden block")
            return
        new = Linear2D.from_full(old.weight, getattr(old, "bias", None), grid, transposed, parts)
        self.put(path, old, new, new.layouts, "SUMMA block")

    def replicated(self, path: str) -> None:
        """Norms and learned positions inside the grid: their hidden chunk."""
        old, grid = self.model.get_submodule(path), self.grid
        kind = rebuilt_kind(old, self.hidden)
        if kind in ("layer_norm", "rms_norm") and self.hidden is not None \
                and old.weight.shape[-1] != self.hidden:
            # a norm over each head's vector (Qwen3's q/k norms): whole on every rank, whose
            # batch rows and heads differ, so its gradient is summed over the whole grid
            self.put(path, old, PartialGradModule(old, grid.comm, grid.tp), {},
                     "whole, gradient summed over the grid")
            return
        if kind == "layer_norm":
            weight, w_layout = split_features(old.weight.detach(), grid)
            bias, b_layout = (split_features(old.bias.detach(), grid) if old.bias is not None
                              else (None, None))
            new = LayerNorm2D(weight, bias, grid, old.eps)
            layouts = {"weight": w_layout, **({"bias": b_layout} if b_layout else {})}
        elif kind == "rms_norm":
            weight, w_layout = split_features(old.weight.detach(), grid)
            new, layouts = RMSNorm2D(weight, grid, rms_norm_eps(old)), {"weight": w_layout}
        elif kind == "embedding":
            chunk, layout = _chunk(old.weight.detach(), 1, grid)
            new, layouts = ChunkEmbedding(chunk, grid, old.padding_idx), {"weight": layout}
        elif kind == "conv":
            new, layouts = self._conv(old)
        elif kind == "linear" and self._lora_layer(path) is not None:
            self.lora(path, False, 1)
            return
        elif kind == "linear":
            new = Linear2D.from_full(old.weight, old.bias, grid)
            layouts = new.layouts
        elif kind == "own":
            new, layouts = self._own_parameters(old)  # ViT's class token and positions
        else:
            return
        self.put(path, old, new, layouts, "hidden chunk")

    def _lora_layer(self, path: str) -> nn.Module | None:
        """The peft LoRA layer whose ``base_layer`` is at ``path``, if it is one."""
        holder, name = parent_of(self.model, path)
        return holder if name == "base_layer" and is_lora_layer(holder) else None

    def lora(self, path: str, transposed: bool, parts: int) -> None:
        """A peft LoRA layer's base (at ``path``) as a ``Linear2D``, its factors cut to match
        (``lora.split_grid_lora``); the layer stays, with peft's names and switches."""
        layer = self._lora_layer(path)
        layer_path = path.rpartition(".")[0]
        old_factors = {n: p for n, p in layer.named_parameters() if n.startswith("lora_")}
        old = layer.base_layer
        base = Linear2D.from_full(old.weight, getattr(old, "bias", None), self.grid,
                                  transposed, parts)
        self.put(path, old, base, base.layouts, "SUMMA block")
        for attribute, layout in split_grid_lora(layer, self.grid, parts).items():
            self.layouts[f"{layer_path}.{attribute}"] = layout
        for attribute, tensor in old_factors.items():
            new = layer.get_parameter(attribute)
            if new is not tensor and id(tensor) not in self.swapped:
                self.swapped[id(tensor)] = new
                self._old.append(tensor)
        self.replaced.append((layer_path, f"LoRA {type(layer).__name__} over Linear2D "
                                          "(SUMMA block; adapters split to match)"))

    def _summed(self, module: nn.Module) -> nn.Module:
        """Every row and depth sees other batch rows: gradients summed down the column and
        over the depths."""
        grid = self.grid
        groups = (grid.col, grid.dep) if grid.dep is not None else (grid.col,)
        return PartialGradModule(module, grid.comm, groups)

    def _conv(self, old: nn.Conv2d) -> tuple[nn.Module, dict[str, ParamLayout]]:
        """A patch projection keeping output channels (hidden features) chunk j."""
        weight, w_layout = _chunk(old.weight.detach(), 0, self.grid)  # (h/q, c, p, p)
        conv = nn.Conv2d(old.in_channels, weight.shape[0], old.kernel_size, old.stride,
                         old.padding, old.dilation, old.groups, old.bias is not None,
                         old.padding_mode)
        layouts = {"weight": w_layout}
        with torch.no_grad():
            conv.weight.copy_(weight)
            if old.bias is not None:
                bias, layouts["bias"] = _chunk(old.bias.detach(), 0, self.grid)
                conv.bias.copy_(bias)
        for name, p in conv.named_parameters():
            p.requires_grad_(getattr(old, name).requires_grad)  # frozen stays frozen (peft)
        return self._summed(conv), layouts

    def _own_parameters(self, old: nn.Module) -> tuple[nn.Module, dict[str, ParamLayout]]:
        """A module's own hidden-wide parameters cut to chunk j, in place."""
        layouts = {}
        for name, p in list(old.named_parameters(recurse=False)):
            if p.shape[-1] == self.hidden:
                local, layouts[name] = _chunk(p.detach(), p.dim() - 1, self.grid)
                new = nn.Parameter(local, requires_grad=p.requires_grad)
                setattr(old, name, new)
                self.swapped[id(p)] = new  # the user's optimizer holds the old one
                self._old.append(p)
        return self._summed(old), layouts


def apply_grid_parallel(model: nn.Module, ctx: ParallelContext, resolved: ResolvedLayout,
                        attention: AttentionSpec | None, blocks_path: str | None,
                        head_path: str | None, hidden: int | None = None,
                        after: tuple[str, ...] = (),
                        ) -> tuple[dict[str, ParamLayout], list, dict, str | None]:
    """Swap ``model``'s modules for grid ones (module docstring); ``after``: the paths of the
    modules run after the blocks (the policy's pipeline glue). Returns the layouts, the
    replaced-module lines, the old-to-new parameter map and the grid LM head's path."""
    grid = Grid.of(ctx)
    same_random_state(ctx)
    swapper = _GridSwapper(model, grid, hidden)
    by_module = modules_to_split(resolved)
    order = sorted((p for p in by_module if "weight" in by_module[p]),
                   key=lambda p: (by_module[p]["weight"].style != "vocab",
                                  not isinstance(model.get_submodule(p), nn.Embedding), p))
    for path in order:
        spec = by_module[path]["weight"]
        swapper.split(path, spec.style, spec.transposed, max(1, len(spec.fused)))
    for path in grid_replicated(resolved, blocks_path, head_path, after):
        swapper.replicated(path)
    for module in model.modules():  # aliases of swapped parameters (none in these families)
        for attribute, tensor in list(module.named_parameters(recurse=False)):
            replacement = swapper.swapped.get(id(tensor))
            if replacement is not None and replacement is not tensor:
                setattr(module, attribute, replacement)
    layouts_for_aliases(model, swapper.layouts)
    if blocks_path is not None and attention is not None:
        for block in model.get_submodule(blocks_path):
            found = find_module(block, attention.path)
            for attribute in attention.local_attributes if found else ():
                value = getattr(found[1], attribute, None)
                if isinstance(value, int):
                    setattr(found[1], attribute, value // grid.side)
    head = head_path if head_path and isinstance(model.get_submodule(head_path), LMHead2D) \
        else None
    _cut_inputs_and_join_outputs(model, grid, head, blocks_path)
    return swapper.layouts, swapper.replaced, swapper.swapped, head


def _cut_inputs_and_join_outputs(model: nn.Module, grid: Grid, head: str | None,
                                 blocks_path: str | None) -> None:
    main = getattr(model, "main_input_name", "input_ids")

    def cut(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        if args:
            kwargs.setdefault(main, args[0])
            args = args[1:]
        first = kwargs.get(main)
        batch = first.shape[0] if isinstance(first, torch.Tensor) else None
        for key in (*BATCH_KEYS, main, "position_ids"):
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
                kwargs[key] = scatter_ids(value, grid)  # (b/q, s): this row's batch rows
        return args, kwargs

    model.register_forward_pre_hook(cut, with_kwargs=True)
    if head is not None:
        lm_head = model.get_submodule(head)
        vocab = lm_head.vocab_size

        def join_logits(module: nn.Module, args: tuple, out: torch.Tensor) -> Any:
            return gather_hidden(out, grid, vocab) if module.gather_output else out

        lm_head.register_forward_hook(join_logits)
    elif blocks_path is not None:
        body = model.get_submodule(blocks_path.rpartition(".")[0]) if "." in blocks_path \
            else model

        def join_hidden(module: nn.Module, args: tuple, output: Any) -> Any:
            if isinstance(output, torch.Tensor):
                return gather_hidden(output, grid)
            output.last_hidden_state = gather_hidden(output.last_hidden_state, grid)
            return output

        body.register_forward_hook(join_hidden)


def causal_lm_loss_grid(model: nn.Module, head: LMHead2D, input_ids: torch.Tensor,
                        labels: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """Next-token loss from each rank's logits block (its batch rows, its vocabulary chunk):
    the (b, s, V) logits are never gathered."""
    previous, head.gather_output = head.gather_output, False
    try:
        output = model(input_ids=input_ids, **inputs)
    finally:
        head.gather_output = previous
    logits = output.logits if hasattr(output, "logits") else output  # (b/q, s, V/q)
    target = scatter_ids(labels, head.grid)[:, 1:]  # (b/q, s - 1): this row's labels
    return grid_cross_entropy(logits[:, :-1], target, head.grid, head.vocab_size)
