"""Sequence parallelism: split-gather inside the tp group, all-to-all (Ulysses) and ring
attention over the sp axis. The seam is in place (``applier.py``, the dp x sp gradient group
``dp_sp`` of ``ParallelContext``); plans with sp > 1 are refused until the modes land."""
