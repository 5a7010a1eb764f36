"""2D (SUMMA) and 2.5D (Tesseract) tensor parallelism against 1D and their formulas.

``python -m bench tensor_parallel_grid`` (or ``python -m bench.tensor_parallel_grid``) runs it;
its parts: run, formulas (per layer and rank), ranks (counting and timing on the ranks), report
(the tables).
"""

from bench.tensor_parallel_grid.run import main

__all__ = ["main"]
