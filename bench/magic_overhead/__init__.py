"""The cost of the workbench's own layers on top of ipyparallel and torch.

``python -m bench magic_overhead`` (or ``python -m bench.magic_overhead``) runs it; its parts:
run (the timing and its table).
"""

from bench.magic_overhead.run import main

__all__ = ["main"]
