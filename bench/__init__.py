"""Benchmarks: each prints a table whose last line is its headline ratio against the native
PyTorch (or ipyparallel / HF) equivalent measured in the same run.

Run one with ``python -m bench NAME``, all with ``python -m bench all``.
"""

BENCHMARKS = ("magic_overhead", "data_parallel", "planner")
