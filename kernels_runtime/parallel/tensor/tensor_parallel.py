"""1D tensor parallelism applied to a model by its policy's plan: modules swapped in place.

The policy's ``resolve`` gives one ``ParamSpec`` per parameter (column, row, vocab,
replicated; fused parts; ``Conv1D`` storage). Each module whose parameters are split is
replaced, at the same attribute of the same parent, by the tensor-parallel layer holding this
rank's shard (``layers.py``), so parameter names and ``state_dict`` keys do not change and the
model's own forward runs unmodified. What the swap must also keep:

- tied weights stay tied: a head whose weight is the embedding's reuses the embedding's new
  local parameter;
- the embedding's ``padding_idx`` (its row gets no gradient); what a swap cannot carry (an
  embedding's ``max_norm``, a hook, a forward of its own) is refused by the applier's
  ``check`` before anything is swapped (``attributes.py``);
- attention modules learn their local widths (the policy lists the attributes, e.g. GPT-2's
  ``split_size``): heads are split, so each rank attends over its own heads;
- the LM head gathers its vocabulary-parallel logits, so the model's outputs keep their HF type
  and full shape on every rank;
- replicated activations see the same dropout masks on every tp rank: the ranks of a tp group
  start from one random state.

Each split parameter gets its ``ParamLayout`` in the model's ``ParallelState``, so data
parallelism shards it further and checkpoints store it whole.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.comm.autograd import copy_to_group
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.shards import ParamLayout
from kernels_runtime.parallel.tensor.layers import (
    ColumnParallelLinear,
    PartialGradModule,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    SharedEntry,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from kernels_runtime.parallel.tensor.lora import is_split_lora, split_lora
from kernels_runtime.parallel.tensor.sharding import split_dim, split_vocab, vocab_range
from kernels_runtime.policies import ParamSpec, ResolvedLayout, find_module, is_lora_layer
from kernels_runtime.policies.specs import AttentionSpec

SPLIT = ("column", "row", "vocab")


def parent_of(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (model.get_submodule(head) if head else model), name


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


class _Swapper:
    def __init__(self, model: nn.Module, ctx: ParallelContext, kv_heads: int | None) -> None:
        self.model, self.ctx, self.kv_heads = model, ctx, kv_heads
        self.comm, self.group = ctx.comm, ctx.group("tp")
        self.rank, self.tp = ctx.coord("tp"), ctx.size("tp")
        self.layouts: dict[str, ParamLayout] = {}
        self.swapped: dict[int, nn.Parameter] = {}  # id of an old parameter -> its new one
        self._old: list[torch.Tensor] = []  # keeps the old ones alive: ids stay unique
        self.replaced: list[tuple[str, str]] = []  # (module path, what it became)

    def swap(self, path: str, specs: dict[str, ParamSpec]) -> None:
        old = self.model.get_submodule(path)
        holder, name = parent_of(self.model, path)
        if name == "base_layer" and is_lora_layer(holder):
            return self._lora(path.rpartition(".")[0], holder, specs["weight"])
        style = specs["weight"].style
        if style == "vocab" and isinstance(old, nn.Embedding):
            new, layouts = self._embedding(old)
        elif specs["weight"].kv and self.kv_heads and self.kv_heads % self.tp:
            new, layouts = self._replicated_heads(old)
            style = "key/value heads replicated"
        elif style == "vocab" or style == "column":
            new, layouts = self._column(old, specs["weight"])
        else:
            new, layouts = self._row(old, specs["weight"])
        parent, name = parent_of(self.model, path)
        setattr(parent, name, new)
        for attribute, layout in layouts.items():
            self.layouts[f"{path}.{attribute}"] = layout
        self.replaced.append((path, f"{type(old).__name__} -> {type(new).__name__} ({style})"))

    def _remember(self, new: nn.Module, old: nn.Module) -> None:
        """Map each of ``old``'s own parameters to its replacement in ``new``."""
        for attribute, tensor in old.named_parameters(recurse=False):
            replacement = getattr(new, attribute, None)
            if isinstance(replacement, nn.Parameter):
                self._map(tensor, replacement)

    def _map(self, tensor: torch.Tensor, replacement: nn.Parameter) -> None:
        """``replacement`` stands for ``tensor`` and trains only if it did (a frozen base
        stays frozen under its LoRA adapters)."""
        if replacement is not tensor and id(tensor) not in self.swapped:
            replacement.requires_grad_(tensor.requires_grad)
            self.swapped[id(tensor)] = replacement
            self._old.append(tensor)

    def retie(self) -> None:
        """Point every remaining alias of a replaced parameter (a module that only shares it,
        as BERT's prediction head shares its decoder's bias) at the replacement."""
        for module in self.model.modules():
            for attribute, tensor in list(module.named_parameters(recurse=False)):
                replacement = self.swapped.get(id(tensor))
                if replacement is not None and replacement is not tensor:
                    setattr(module, attribute, replacement)

    def _embedding(self, old: nn.Embedding) -> tuple[nn.Module, dict[str, ParamLayout]]:
        start, held, _ = vocab_range(old.num_embeddings, self.rank, self.tp)
        weight, layout = split_vocab(old.weight.detach(), self.rank, self.tp)
        new = VocabParallelEmbedding(weight, start, held, self.comm, self.group,
                                     old.padding_idx)
        self._tie(new, old, "weight")
        self._remember(new, old)
        return new, {"weight": layout}

    def _column(self, old: nn.Module, spec: ParamSpec) -> tuple[nn.Module, dict[str, ParamLayout]]:
        weight = old.weight.detach()
        vocab = spec.style == "vocab"
        dim = 1 if spec.transposed else 0
        parts = max(1, len(spec.fused))
        if vocab:
            local, layout = split_vocab(weight, self.rank, self.tp)
        else:
            local, layout = split_dim(weight, dim, self.rank, self.tp, parts)
        bias = _bias(old)
        layouts = {"weight": layout}
        local_bias = None
        if bias is not None:
            local_bias, layouts["bias"] = (split_vocab(bias, self.rank, self.tp) if vocab else
                                           split_dim(bias, 0, self.rank, self.tp, parts))
        if vocab:
            start, held, _ = vocab_range(weight.shape[0], self.rank, self.tp)
            new = VocabParallelHead(local, local_bias, self.comm, self.group, start, held,
                                    weight.shape[0], spec.transposed)
        else:
            new = ColumnParallelLinear(local, local_bias, self.comm, self.group,
                                       spec.transposed)
        self._tie(new, old, "weight")
        self._remember(new, old)
        return new, layouts

    def _replicated_heads(self, old: nn.Module) -> tuple[nn.Module, dict[str, ParamLayout]]:
        """tp is a multiple of the key/value heads: rank r keeps head r * kv // tp, whole."""
        weight = old.weight.detach()
        width = weight.shape[0] // self.kv_heads  # head_dim
        start = (self.rank * self.kv_heads // self.tp) * width
        bias = _bias(old)
        new = ReplicatedHeadsLinear(weight.clone(), bias.clone() if bias is not None else None,
                                    self.comm, self.group, start, width)
        self._remember(new, old)
        return new, {}

    def _row(self, old: nn.Module, spec: ParamSpec) -> tuple[nn.Module, dict[str, ParamLayout]]:
        weight = old.weight.detach()
        local, layout = split_dim(weight, 0 if spec.transposed else 1, self.rank, self.tp)
        bias = _bias(old)
        new = RowParallelLinear(local, bias.clone() if bias is not None else None, self.comm,
                                self.group, spec.transposed)
        self._remember(new, old)
        return new, {"weight": layout}

    def _lora(self, path: str, layer: nn.Module, spec: ParamSpec) -> None:
        """A peft LoRA layer: its base split by ``spec``, its factors to match (``lora.py``)."""
        old_params = dict(layer.named_parameters())  # the factors are changed in place
        split = self._column if spec.style == "column" else self._row
        base, layouts = split(layer.base_layer, spec)
        factor_layouts = split_lora(layer, base, spec, self.rank, self.tp, self.comm,
                                    self.group)
        for attribute, layout in layouts.items():
            self.layouts[f"{path}.base_layer.{attribute}"] = layout
        for attribute, layout in factor_layouts.items():
            self.layouts[f"{path}.{attribute}"] = layout
        for attribute, tensor in old_params.items():
            self._map(tensor, layer.get_parameter(attribute))
        self.replaced.append((path, f"LoRA {type(layer).__name__} over {type(base).__name__} "
                                    f"({spec.style}; adapters split to match)"))

    def _tie(self, new: nn.Module, old: nn.Module, attribute: str) -> None:
        previous = self.swapped.get(id(getattr(old, attribute)))
        if previous is not None:
            setattr(new, attribute, previous)


def modules_to_split(resolved: ResolvedLayout) -> dict[str, dict[str, ParamSpec]]:
    """{module path: {attribute: spec}} of every module with a split parameter, a tied head
    included (swapped too, onto the same tensor)."""
    by_module: dict[str, dict[str, ParamSpec]] = defaultdict(dict)
    for spec in resolved.specs.values():
        if spec.style in SPLIT and not spec.adapter:  # factors: swapped with their layer
            by_module[spec.module][spec.attribute] = spec
    for alias, canonical in resolved.tied:  # a tied head is swapped too, onto the same tensor
        spec = resolved.specs.get(canonical)
        module, _, attribute = alias.rpartition(".")
        if spec is not None and spec.style in SPLIT and attribute == "weight":
            by_module.setdefault(module, {})["weight"] = ParamSpec(
                module, "weight", spec.style, spec.transposed, spec.fused, spec.block, spec.kv)
    return by_module


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext, resolved: ResolvedLayout,
                          attention: AttentionSpec | None, blocks_path: str | None,
                          heads: int | None = None, kv_heads: int | None = None,
                          ) -> tuple[dict[str, ParamLayout], list, dict, str | None]:
    """Swap every split module of ``model`` (collective over tp: same shards everywhere);
    returns the new parameters' layouts, a (module, what it became) list, the map from each
    replaced parameter's id to its new shard, and the path of the vocabulary-parallel LM head
    (None without one)."""
    by_module = modules_to_split(resolved)
    same_random_state(ctx)
    swapper = _Swapper(model, ctx, kv_heads)
    # a module only holding an alias of a split parameter (no weight) is re-pointed, not swapped
    order = sorted((p for p in by_module if "weight" in by_module[p]),
                   key=lambda p: (by_module[p]["weight"].style != "vocab", p))
    head = None
    for path in order:
        swapper.swap(path, by_module[path])
        if isinstance(model.get_submodule(path), VocabParallelHead):
            head = path
    swapper.retie()
    layouts_for_aliases(model, swapper.layouts)
    if blocks_path is not None:
        _share_entries(model, model.get_submodule(blocks_path), ctx)
    if blocks_path is not None and attention is not None:
        for path in _local_head_counts(model.get_submodule(blocks_path), attention, ctx, heads,
                                       kv_heads):
            swapper.replaced.append((f"{blocks_path}.{path}", "-> PartialGradModule (this "
                                     "rank's heads: gradient summed over tp)"))
    return swapper.layouts, swapper.replaced, swapper.swapped, head


def _share_entries(model: nn.Module, blocks: nn.Module, ctx: ParallelContext) -> None:
    """Column-parallel layers of the blocks fed the same input (q, k, v; gate, up) share one
    ``copy_to_group``: one all-reduce of their summed input gradient in backward."""
    comm, group = ctx.comm, ctx.group("tp")
    entry = SharedEntry(lambda x: copy_to_group(x, comm, group))  # (b, s, h), replicated
    for block in blocks:
        block.register_forward_pre_hook(entry.clear)
        for module in block.modules():
            if isinstance(module, (ColumnParallelLinear, ReplicatedHeadsLinear)):
                module.enter = entry
    model.register_forward_hook(entry.clear)


TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, ReplicatedHeadsLinear,
             VocabParallelEmbedding, PartialGradModule)


def _owns_parts(module: nn.Module) -> bool:
    return isinstance(module, TP_LAYERS) or is_split_lora(module)


def wrap_partial_modules(root: nn.Module, comm, group) -> list[str]:
    """Wrap every replicated module with parameters under ``root`` (not a tensor-parallel
    layer) in a ``PartialGradModule``: its input differs across tp (this rank's heads or
    tokens), so its gradient is summed over tp. Returns their paths under ``root``."""
    wrapped, inside = [], []  # inside: paths of tensor-parallel layers, whose parts they own
    for path, module in list(root.named_modules()):
        if _owns_parts(module):
            inside.append(path + ".")
        if not path or _owns_parts(module) or path.startswith(tuple(inside)) or not any(
                True for _ in module.parameters(recurse=False)):
            continue
        if any(any(True for _ in child.parameters()) for child in module.children()):
            raise ValueError(f"{path} ({type(module).__name__}) holds parameters and submodules "
                             "with parameters; its policy must name the parts")
        parent, name = parent_of(root, path)
        setattr(parent, name, PartialGradModule(module, comm, group))
        wrapped.append(path)
    return wrapped


def _local_head_counts(blocks: nn.Module, attention: AttentionSpec, ctx: ParallelContext,
                       heads: int | None, kv_heads: int | None) -> list[str]:
    """Each attention module's widths and head counts become this rank's share; replicated
    modules inside it (Qwen3's per-head q/k norms) see only this rank's heads, so their
    gradient is summed over tp. Returns the wrapped modules' paths."""
    tp, wrapped = ctx.size("tp"), []
    for i, block in enumerate(blocks):
        found = find_module(block, attention.path)
        if found is None:
            continue
        module = found[1]
        wrapped += [f"{i}.{found[0]}.{p}" for p in
                    wrap_partial_modules(module, ctx.comm, ctx.group("tp"))]
        for attribute in attention.local_attributes:
            value = getattr(module, attribute, None)
            if isinstance(value, int):
                setattr(module, attribute, value // tp)
        if attention.groups_attribute and heads and kv_heads:
            local_kv = max(1, kv_heads // tp)  # one replicated head when tp exceeds them
            setattr(module, attention.groups_attribute, heads // tp // local_kv)
    return wrapped


def layouts_for_aliases(model: nn.Module, layouts: dict[str, ParamLayout]) -> None:
    """Every name of a split tensor gets its layout (the canonical name may be an alias's)."""
    names = list(model.named_parameters(remove_duplicate=False))
    by_tensor = {id(p): layouts[n] for n, p in names if n in layouts}
    for name, p in names:
        if name not in layouts and id(p) in by_tensor:
            layouts[name] = by_tensor[id(p)]


def same_random_state(ctx: ParallelContext) -> None:
    """Seed every rank of a tp group with one seed drawn by its first rank (host and device
    generators alike), so dropout on replicated activations agrees across the group."""
    group = ctx.group("tp")
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(ctx.device)
    ctx.comm.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    torch.manual_seed(int(seed.item()))
