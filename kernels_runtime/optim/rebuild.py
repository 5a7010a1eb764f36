"""The user's optimizer, rebuilt over the runtime's own tensors, and what its state costs.

``parallelize`` takes an ordinary ``torch.optim`` optimizer built over the model's parameters,
but a strategy updates other tensors: flat fp32 master shards (ZeRO 1/2), whole fp32 buckets
(DDP in 16 bit), FSDP2's sharded parameters. So the optimizer is rebuilt with the same class
and per-group hyperparameters over those. Element-wise optimizers are exact on flattened,
sharded tensors; the others need whole tensors and are refused with a clear error.
"""

from __future__ import annotations

import inspect

import torch

# Optimizers whose update of each element depends only on that element's own history: exact
# on flattened, sharded parameters. Others (LAMB, Adafactor, Shampoo, Muon) need whole tensors.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "RMSprop", "Adagrad", "NAdam",
                          "RAdam", "ASGD", "Rprop")


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if name not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(
            f"{name} is not element-wise: data parallelism here runs the optimizer on flattened "
            f"parameter shards, which is exact only for {', '.join(ELEMENTWISE_OPTIMIZERS)}"
        )


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]]
) -> torch.optim.Optimizer:
    """The same optimizer class and per-group hyperparameters, over new tensors."""
    new_groups = []
    for group, tensors in zip(optimizer.param_groups, groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        new_groups.append({"params": tensors, **settings})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(new_groups, **defaults)


def tensor_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1]
