"""Spawning N real ranks for tests: the runtime's own launcher, re-exported for test modules."""

from kernels_runtime.launch import RanksFailedError, run_ranks

__all__ = ["RanksFailedError", "run_ranks"]
