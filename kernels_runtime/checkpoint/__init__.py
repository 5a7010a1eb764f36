"""Sharded, crash-safe checkpoints that load under any plan, and export to plain weights.

``save`` and ``load`` are collective (every rank calls them); ``export_hf`` runs in one process.
The layout is described in ``kernels_runtime.checkpoint.format``.
"""

from kernels_runtime.checkpoint.exporter import export_hf
from kernels_runtime.checkpoint.format import CheckpointError, saved_steps
from kernels_runtime.checkpoint.loader import load
from kernels_runtime.checkpoint.saver import save

__all__ = ["CheckpointError", "export_hf", "load", "save", "saved_steps"]
