"""Mixture of experts: what expert parallelism moves, keeps and costs against data parallelism.

``python -m bench moe`` (or ``python -m bench.moe``) runs it; its parts: formulas (the bytes
expected, torch-free), ranks (what the ranks measure), run (the pool and the tables).
"""

from bench.moe.run import main

__all__ = ["main"]
