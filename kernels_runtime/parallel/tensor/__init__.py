"""Tensor parallelism: 1D (Megatron column/row-parallel layers) and 2D/2.5D grids.

The seam is in place (``applier.py`` runs first among the appliers, and what it decides per
parameter is a ``ParamLayout`` that data parallelism and checkpoints already honour); the
layers themselves land with the tensor-parallel issue, so plans with tp > 1 are refused with a
clear error before any rank does work.
"""
