"""The generic policy: any model built from ``nn.Linear`` blocks, found by structure alone.

Users bring their own models, and they should get activation checkpointing and per-block features
without writing a policy. Nearly every hand-written transformer or MLP stack keeps its layers in an
``nn.ModuleList`` or ``nn.Sequential`` of identical modules, so that is what this policy looks for.
A model without such a list still trains under pure data parallelism; it just has no per-block
features. This policy matches every model, which is why the registry always tries it last.

Its tensor-parallel layout is read off the first block's ``nn.Linear`` shapes, in registration
order, with h the model's hidden size: h -> other is column-parallel (an MLP's up projection),
other -> h row-parallel (its down projection), and in a run of h -> h layers all but the last
are column-parallel and the last row-parallel (q, k, v then the output projection; or two
square MLP layers). The sequence must pair up (every row-parallel layer after at least one
column-parallel one, none left open at the end); otherwise the layout records why it cannot be
read (``extra["unreadable"]``), and tensor parallelism asks for a policy. Every other parameter
(norms, embeddings, heads) is replicated.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from kernels_runtime.policies.base import CONFIG_KEYS, ModelConfig, Policy
from kernels_runtime.policies.specs import ModelLayout, PipelineSpec, PositionSpec, Rule


def _contains_linear(module: nn.Module) -> bool:
    # A bare Linear is not a block: a list of Linears is a set of heads or one layer's parts,
    # and checkpointing a single matmul saves nothing.
    return any(isinstance(m, nn.Linear) for m in module.modules() if m is not module)


def _is_block_list(container: nn.Module) -> bool:
    """A ModuleList/Sequential of at least two same-type children that each contain a Linear."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(container)
    return (
        len(children) >= 2
        and len({type(c) for c in children}) == 1
        and all(_contains_linear(c) for c in children)
    )


@dataclass(frozen=True)
class GenericPolicy(Policy):
    """Blocks: the longest outermost list of identical ``Linear``-holding modules.

    "Outermost" means a block list nested inside another block list's children is ignored: with
    12 layers that each hold a list of 4 identical experts, the 12 layers are the blocks, not one
    layer's 4 experts. Among the remaining lists the longest wins, the first found on a tie.
    """

    name: str = "generic"
    summary: str = "any model: blocks = longest list of identical modules holding nn.Linear"

    def matches(self, model: nn.Module) -> bool:
        return True

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        found = self._block_list(model)
        return list(found[1]) if found is not None else []

    def _block_list(self, model: nn.Module) -> tuple[str, nn.Module] | None:
        candidates = [(n, m) for n, m in model.named_modules() if _is_block_list(m)]
        names = [n for n, _ in candidates]
        outermost = [
            (n, m)
            for n, m in candidates
            if not any(other != n and (other == "" or n.startswith(other + ".")) for other in names)
        ]
        if not outermost:
            return None
        return max(outermost, key=lambda nm: len(nm[1]))  # max keeps the first of equal lists

    def model_layout(self, model: nn.Module) -> ModelLayout:
        found = self._block_list(model)
        hidden = self.model_config(model)["hidden_size"]
        block_rules: tuple[Rule, ...] = ()
        unreadable = "the model has no list of repeated blocks holding nn.Linear"
        if found is not None:
            block_rules, unreadable = _block_rules(found[1][0], hidden)
        path = found[0] if found is not None else ""
        inside = {f"{path}.{i}" if path else str(i) for i in range(len(found[1]))} \
            if found is not None else set()
        outer = tuple(
            Rule((name,), "replicated") for name, module in model.named_modules()
            if any(True for _ in module.parameters(recurse=False))
            and not any(name == b or name.startswith(b + ".") for b in inside))
        return ModelLayout(
            blocks=(path,), embedding=(), final_norm=None, head=None, attention=None,
            positions=PositionSpec("unknown"), pipeline=PipelineSpec(),
            block_rules=block_rules, outer_rules=outer,
            extra={"unreadable": unreadable} if unreadable else {})

    def model_config(self, model: nn.Module) -> ModelConfig:
        """Hidden size is the most common ``Linear.in_features``; layers the number of blocks.

        Heads, key/value heads and vocabulary cannot be read off ``Linear`` shapes reliably, so
        they stay ``None`` and ``Plan.validate`` skips the checks that need them.
        """
        out: ModelConfig = dict.fromkeys(CONFIG_KEYS)
        widths = Counter(m.in_features for m in model.modules() if isinstance(m, nn.Linear))
        if widths:
            out["hidden_size"] = widths.most_common(1)[0][0]
        blocks = self.blocks(model)
        out["num_hidden_layers"] = len(blocks) if blocks else None
        return out


def _block_rules(block: nn.Module, hidden: int | None) -> tuple[tuple[Rule, ...], str]:
    """Rules for one block's modules (module docstring); the reason it cannot be read for
    tensor parallelism, or "" when it can."""
    linears = [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    styles: list[str] = []
    for i, (_, m) in enumerate(linears):
        if m.in_features == hidden and m.out_features != hidden:
            styles.append("column")
        elif m.out_features == hidden and m.in_features != hidden:
            styles.append("row")
        elif m.in_features == m.out_features == hidden:
            square_next = i + 1 < len(linears) and (
                linears[i + 1][1].in_features == linears[i + 1][1].out_features == hidden)
            styles.append("column" if square_next else "row")
        else:
            styles.append("")
    problem, open_columns = "", 0
    for (name, m), style in zip(linears, styles):
        if not style:
            problem = f"{name} ({m.in_features} -> {m.out_features}) neither reads nor writes " \
                      f"the hidden size {hidden}"
        elif style == "row" and not open_columns:
            problem = f"{name} would be row-parallel without a column-parallel layer before it"
        open_columns = 0 if style == "row" else open_columns + (style == "column")
        if problem:
            break
    if not problem and open_columns:
        problem = f"{linears[-1][0]} leaves a column-parallel output without a row-parallel layer"
    rules = [Rule((name,), style or "replicated") for (name, _), style in zip(linears, styles)]
    rules += [Rule((name,), "replicated") for name, m in block.named_modules()
              if not isinstance(m, nn.Linear) and any(True for _ in m.parameters(recurse=False))]
    return tuple(rules), problem
