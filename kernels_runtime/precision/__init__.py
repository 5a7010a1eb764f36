"""Mixed precision: compute dtypes per plan precision and dynamic loss scaling for fp16."""

from kernels_runtime.precision.loss_scaler import DynamicLossScaler, NoLossScaler
from kernels_runtime.precision.mixed_precision import compute_dtype

__all__ = ["DynamicLossScaler", "NoLossScaler", "compute_dtype"]
