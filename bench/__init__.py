"""Benchmarks: each prints a table whose last line is its headline ratio against the native
PyTorch (or ipyparallel / HF) equivalent measured in the same run.

Run one with ``python -m bench NAME``, all with ``python -m bench all``. Each benchmark is a
package ``bench/NAME/`` (``run.py`` holds its ``main``; ``ranks``, ``formulas``, ``report``
where it has them) over ``bench/common/`` (table, spread, meters, timing), and imports no other
benchmark's private names. The GPU path's check is not a benchmark:
``python tools/gpu_check.py``.
"""

BENCHMARKS = ("magic_overhead", "data_parallel", "planner", "tensor_parallel",
              "tensor_parallel_grid", "sequence_parallel", "pipeline", "memory", "inference",
              "serving", "loading", "finetune", "moe")
# run by name only (``all`` runs their parts already): every speed figure of one issue at once
SUITES = ("inference_speed",)
