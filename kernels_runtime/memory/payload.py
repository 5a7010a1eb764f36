"""What the tier store moves: a ``Payload`` (one flat tensor of model state or a working
buffer) and the ``Tier`` it lives on. Its own module because both the store (``tiers.py``) and
its disk traffic (``disk_traffic.py``) read them, and neither imports the other's internals.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(eq=False)
class Payload:
    key: str
    numel: int
    dtype: torch.dtype
    handle: torch.Tensor = field(repr=False)
    tier: Tier = Tier.DEVICE
    persistent: bool = True  # model state (False: a transient working buffer)
    copy_on_disk: bool = False  # its spill file holds its current values (``disk_traffic.py``)
    viewed: bool = False  # parameters are views of it: autograd may hold its memory

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize
