"""Pipeline parallelism: stages from the policy's split points, and schedules (GPipe, 1F1B,
interleaved) that ``train_step`` runs in place of the sequential one. The seam is in place
(``applier.py``; ``ParallelState.schedule``; the pp neighbours and the embedding group of
``ParallelContext``); plans with pp > 1 are refused until the schedules land."""
