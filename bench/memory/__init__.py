"""Heterogeneous memory against PyTorch's own: speed, capacity under a device budget and in a
cgroup.

``python -m bench memory`` (or ``python -m bench.memory``) runs it; its parts: run (speed and
the report), capacity (device budget), cgroup (a memory cgroup, trials in child processes).
"""

from bench.memory.run import main

__all__ = ["main"]
