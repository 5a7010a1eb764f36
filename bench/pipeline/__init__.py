"""Pipeline schedules against their formulas and ``torch.distributed.pipelining``.

``python -m bench pipeline`` (or ``python -m bench.pipeline``) runs it; its parts: run (the
tables), projection (bubbles and activations from the schedules), ranks (the schedules on the
ranks).
"""

from bench.pipeline.run import main

__all__ = ["main"]
