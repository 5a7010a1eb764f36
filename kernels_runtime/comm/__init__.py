"""Engine-side communication: device choice, process groups, counted and bounded collectives,
and the differentiable collectives of tensor and sequence parallelism (``comm.autograd``)."""

from kernels_runtime.comm.accelerator import Accelerator
from kernels_runtime.comm.collectives import Collectives
from kernels_runtime.comm.pending import CollectiveTimeoutError, PendingOp
from kernels_runtime.comm.process_group import (
    DistributedState,
    destroy_distributed,
    find_free_port,
    init_distributed,
    init_single_process,
)
from kernels_runtime.comm.stats import CommStats

__all__ = [
    "Accelerator",
    "CollectiveTimeoutError",
    "Collectives",
    "CommStats",
    "PendingOp",
    "DistributedState",
    "destroy_distributed",
    "find_free_port",
    "init_distributed",
    "init_single_process",
]
