"""The plan tuner's cost model against measurements on CPU ranks, and against published runs.

``python -m bench planner`` (or ``python -m bench.planner``) runs it; its parts: run (measured
against predicted), megatron (Megatron-LM's Table 1 projected), tesseract (the 2.5D paper's
speed-ups).
"""

from bench.planner.run import main

__all__ = ["main"]
