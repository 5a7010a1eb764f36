"""A family's ``ModelLayout`` applied to one model: a ``ParamSpec`` for every parameter.

Rules name modules; what tensor parallelism needs is a decision per parameter, made exactly
once. ``resolve`` walks the layout's outer rules and, in every block, its block rules, and
attaches each rule to the parameters its module holds directly. A parameter no rule names, or
two rules name differently, is reported (``uncovered``, ``conflicts``), so a policy that does
not fit a model says so instead of leaving a weight whole by accident. Tied parameters (an LM
head sharing the embedding's weight) appear once, under the name ``named_parameters`` gives
them, with their aliases in ``tied``. A module peft wrapped in a LoRA layer is still the
module its rule names: the rule covers the layer's base and adapter factors (``lora_specs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from kernels_runtime.policies.specs import ModelLayout, ParamSpec, Paths, Rule


@dataclass
class ResolvedLayout:
    specs: dict[str, ParamSpec] = field(default_factory=dict)  # canonical parameter name ->
    uncovered: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    missing_modules: list[str] = field(default_factory=list)
    tied: list[tuple[str, str]] = field(default_factory=list)  # (alias, canonical name)

    @property
    def complete(self) -> bool:
        return not (self.uncovered or self.conflicts or self.missing_modules)

    def problems(self) -> str:
        parts = []
        if self.uncovered:
            parts.append(f"no rule for {', '.join(self.uncovered)}")
        if self.conflicts:
            parts.append("conflicting rules: " + "; ".join(self.conflicts))
        if self.missing_modules:
            parts.append(f"no module at {', '.join(self.missing_modules)}")
        return " | ".join(parts)


def find_module(root: nn.Module, paths: Paths) -> tuple[str, nn.Module] | None:
    """The first of ``paths`` that names a submodule of ``root`` ("" is root itself)."""
    for path in paths:
        if path == "":
            return path, root
        try:
            return path, root.get_submodule(path)
        except AttributeError:
            continue
    return None


def tied_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, canonical name) of every parameter reachable under two names."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return [(n, canonical[id(p)]) for n, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != n]


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer: a frozen ``base_layer`` plus ``lora_A`` / ``lora_B`` factor dicts
    (duck-typed: peft is optional)."""
    return (isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def lora_specs(where: str, layer: nn.Module, rule: Rule, block: int | None,
               ) -> list[tuple[nn.Parameter, ParamSpec]]:
    """A rule naming a module that peft wrapped in a LoRA layer covers the layer: its frozen
    base as the rule says, and the factors of each adapter by the base's split (A of a
    row-parallel layer by input rows, B of a column-parallel one by output columns, like the
    base's fused parts and key/value heads; the others whole). Anything else it holds (DoRA
    magnitudes, embedding factors) stays uncovered: refused, not guessed."""
    out = [(p, ParamSpec(f"{where}.base_layer", attribute, rule.style, rule.transposed,
                         rule.fused, block, rule.kv))
           for attribute, p in layer.base_layer.named_parameters(recurse=False)]
    split = {"A": rule.style == "row", "B": rule.style == "column"}
    for factor, factors in (("A", layer.lora_A), ("B", layer.lora_B)):
        for adapter, module in factors.items():
            style = ("row" if factor == "A" else "column") if split[factor] else "replicated"
            for attribute, p in module.named_parameters(recurse=False):
                out.append((p, ParamSpec(
                    f"{where}.lora_{factor}.{adapter}", attribute, style, False,
                    rule.fused if style == "column" else (), block,
                    rule.kv and style == "column", adapter=factor)))
    return out


def resolve(model: nn.Module, layout: ModelLayout) -> ResolvedLayout:
    out = ResolvedLayout(tied=tied_parameters(model))
    canonical = {id(p): n for n, p in model.named_parameters()}

    def attach(prefix: str, root: nn.Module, rule: Rule, block: int | None) -> None:
        found = find_module(root, rule.paths)
        if found is None:
            if not rule.optional:
                out.missing_modules.append(f"{prefix}{'|'.join(rule.paths)}")
            return
        path, module = found
        where = f"{prefix}{path}".rstrip(".")
        specs = (lora_specs(where, module, rule, block) if is_lora_layer(module) else
                 [(p, ParamSpec(where, attribute, rule.style, rule.transposed, rule.fused,
                                block, rule.kv))
                  for attribute, p in module.named_parameters(recurse=False)])
        for p, spec in specs:
            name = canonical[id(p)]
            previous = out.specs.get(name)
            if previous is None:
                out.specs[name] = spec
            elif (previous.style, previous.fused) != (spec.style, spec.fused):
                out.conflicts.append(f"{name}: {previous.style} at {previous.module}, "
                                     f"{spec.style} at {where}")

    for rule in layout.outer_rules:
        attach("", model, rule, None)
    blocks = find_module(model, layout.blocks)
    if blocks is None:
        out.missing_modules.append("|".join(layout.blocks))
    else:
        path, container = blocks
        for i, block in enumerate(container):
            for rule in layout.block_rules:
                attach(f"{path}.{i}." if path else f"{i}.", block, rule, i)
    out.uncovered = [n for n in canonical.values() if n not in out.specs]
    return out
