"""Sequence parallelism: a sequence sp times longer under the same per-rank memory.

``python -m bench sequence_parallel`` (or ``python -m bench.sequence_parallel``) runs it; its
parts: run (ranks and table).
"""

from bench.sequence_parallel.run import main

__all__ = ["main"]
