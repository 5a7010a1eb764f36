"""1D tensor parallelism (and Megatron sequence parallelism) against its formulas and DTensor.

``python -m bench tensor_parallel`` (or ``python -m bench.tensor_parallel``) runs it; its parts:
run (the tables), formulas (collectives and activation bytes per layer), ranks (the variants on
the ranks).
"""

from bench.tensor_parallel.run import main

__all__ = ["main"]
