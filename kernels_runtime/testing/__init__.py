"""The harness that spawns local ranks for the tests and the benchmarks (not used in training).

``RankPool`` keeps N rank processes (one gloo process group on CPU by default) alive across
calls; ``run_ranks`` is the one-call form on fresh processes. It sits in ``kernels_runtime`` so
that ``bench/``, ``tests/`` and ``kernels_runtime.calibrate`` share one implementation; its
name says that it is a test harness, not a launcher for jobs (``workbench`` and ``torchrun``
launch those).
"""

from kernels_runtime.testing.rank_pool import RankPool, RanksFailedError, run_ranks

__all__ = ["RankPool", "RanksFailedError", "run_ranks"]
