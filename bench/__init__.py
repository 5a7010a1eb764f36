"""Benchmarks: each prints a table whose last line is its headline ratio against the native
PyTorch (or ipyparallel / HF) equivalent measured in the same run.

Run one with ``python -m bench NAME``, all with ``python -m bench all``. ``gpu_check`` is not
a benchmark but the one prepared check of the GPU path (it reports "skipped" without a GPU).
"""

BENCHMARKS = ("magic_overhead", "data_parallel", "planner", "tensor_parallel",
              "tensor_parallel_grid", "sequence_parallel", "pipeline", "memory", "inference",
              "serving", "loading", "finetune", "gpu_check")
