"""Sharded, crash-safe checkpoints that load under any plan, and export to plain weights.

``save`` / ``load`` (model and optimizer) and ``save_model`` / ``load_model`` (parameters only,
for evaluation and inference) are collective (every rank calls them); ``export_hf`` runs in one
process. The layout is described in ``kernels_runtime.checkpoint.format``.
"""

from kernels_runtime.checkpoint.exporter import export_hf
from kernels_runtime.checkpoint.format import CheckpointError, saved_steps
from kernels_runtime.checkpoint.loader import load, load_model
from kernels_runtime.checkpoint.saver import save, save_model

__all__ = ["CheckpointError", "export_hf", "load", "load_model", "save", "save_model",
           "saved_steps"]
