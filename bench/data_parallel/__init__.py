"""Data parallelism against PyTorch's own: step time and per-rank model-state memory.

``python -m bench data_parallel`` (or ``python -m bench.data_parallel``) runs it; its parts: run
(ranks, timing and table).
"""

from bench.data_parallel.run import main

__all__ = ["main"]
