"""The generic policy: any model built from ``nn.Linear`` blocks, found by structure alone.

Users bring their own models, and they should get activation checkpointing and per-block features
without writing a policy. Nearly every hand-written transformer or MLP stack keeps its layers in an
``nn.ModuleList`` or ``nn.Sequential`` of identical modules, so that is what this policy looks for.
A model without such a list still trains under pure data parallelism; it just has no per-block
features. This policy matches every model, which is why the registry always tries it last.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from kernels_runtime.policies.base import CONFIG_KEYS, ModelConfig, Policy


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
        candidates = [(n, m) for n, m in model.named_modules() if _is_block_list(m)]
        names = [n for n, _ in candidates]
        outermost = [
            m
            for n, m in candidates
            if not any(other != n and (other == "" or n.startswith(other + ".")) for other in names)
        ]
        if not outermost:
            return []
        return list(max(outermost, key=len))  # max keeps the first of equally long lists

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
