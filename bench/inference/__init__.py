"""Inference throughput of the engine against HF ``generate``.

``python -m bench inference`` (or ``python -m bench.inference``) runs it; its parts: run (the
table), ranks (the workload and each side on the ranks).
"""

from bench.inference.run import main

__all__ = ["main"]
