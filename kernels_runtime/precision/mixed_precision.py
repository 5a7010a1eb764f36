"""Which dtype the model computes in for each plan precision.

In bf16 and fp16 the model's parameters are stored in 16 bits (2 bytes per parameter) and the
optimizer keeps an fp32 master copy (4 bytes) next to its fp32 states: the ZeRO paper's
2 + 2 + 12 bytes per parameter. In fp32 there is no master copy: the parameters are the master.
"""

from __future__ import annotations

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    try:
        return _DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision={precision!r}: choose fp32, bf16 or fp16") from None
