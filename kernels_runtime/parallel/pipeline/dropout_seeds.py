"""Dropout masks that depend on what is computed, not on the schedule that computes it.

Without care, a rank draws its dropout masks from its own random stream in the order its
schedule runs forwards, so gpipe, 1f1b, interleaved and zbv (or pp=2 and pp=4) would drop
different units and train different models from the same data. Here every block's forward of
a micro-batch seeds the random stream from (a base seed shared by the pipeline, the step, the
micro-batch, the block's index in the model): the mask a block draws is the same under every
schedule, stage count and chunk placement. Modules before the first block draw from the
micro-batch's own seed (index -1). The step's forwards run inside a fork of the random state,
so the user's stream is unchanged after ``train_step``; activation checkpointing replays the
seeded state it stashed, so recomputed masks match.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kernels_runtime.comm.accelerator import DEVICE_KINDS

_MASK = 2**63 - 1


def mix(base: int, step: int, mb: int, index: int) -> int:
    """A 63-bit seed for one (step, micro-batch, block): distinct keys give distinct seeds."""
    value = base & _MASK
    for part in (step, mb, index + 1):
        value = (value * 6364136223846793005 + part + 1442695040888963407) & _MASK
    return value


def _manual_seed(seed: int) -> None:
    """``torch.manual_seed`` for the generators this process uses: the CPU's and each started
    accelerator's. ``torch.manual_seed`` also queues a seeding for every device kind not
    started (the other accelerator kinds, all of them on a CPU run) and captures the caller's stack
    for it each time: ~1.5 ms a call deep in a forward, paid per block and micro-batch."""
    torch.default_generator.manual_seed(seed)
    for kind in DEVICE_KINDS:
        module = torch.get_device_module(kind)
        if module.is_initialized():
            module.manual_seed_all(seed)


class BlockSeeds:
    def __init__(self, base: int) -> None:
        self.base = base
        self.key: tuple[int, int] | None = None  # (step, micro-batch) of the running forward

    def seed_block(self, index: int) -> None:
        if self.key is not None:
            _manual_seed(mix(self.base, *self.key, index))

    @contextlib.contextmanager
    def forking(self, device: torch.device) -> Iterator[None]:
        """The step's random state is a fork: the caller's stream continues unchanged."""
        devices = [] if device.type == "cpu" else [device]
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            yield

    @contextlib.contextmanager
    def micro_batch(self, step: int, mb: int) -> Iterator[None]:
        self.key = (step, mb)
        self.seed_block(-1)
        try:
            yield
        finally:
            self.key = None
