"""``Engine(pack_weights=True)``: every ``nn.Linear`` weight prepacked for oneDNN on a CPU,
off by default.

Why: for a handful of rows (3 to 15: a few sequences decoding, or verifying speculative
drafts) the fp32 GEMM that ``F.linear`` reaches on a CPU takes a slow path that costs more
than 16 rows do. Measured on this project's CPU host (Xeon, one thread, SmolLM2-135M's
shapes), ms per call, ``F.linear`` / the packed weight:

    rows                    2          4          10         16         64
    lm_head 49152 x 576     8.7 / 8.7  17.6 / 9.4  36.1 / 11.7  24.9 / 14.1  40.0 / 28.8
    mlp 1536 x 576          0.15/0.20  0.25/0.22   0.54 / 0.27  0.41 / 0.32  0.84 / 0.79

A weight reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's freezing pass does for a frozen graph) has no such cliff. One or two rows stay
on ``F.linear``, which is as fast there, so a step of that size computes what it did before.

The cost is memory: the packed copy sits beside the weight (the model's weights twice in host
memory), which is why it is an option. It changes no result beyond fp32 rounding (greedy tokens
checked identical by ``tests/runtime/inference/test_packed_linear.py`` and ``bench inference``).

The layer's class is swapped for ``PackedLinear`` rather than its ``forward`` set on the
instance: a LoRA adapter's forward calls the class's ``forward`` (``adapters.py``), and the
module keeps its identity and parameters. A weight written after packing (its version or
storage changed) is repacked on the next call, so a later ``load_state_dict`` cannot leave a
stale copy in use.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 3  # below this F.linear is as fast as the packed weight (the table above)
ROWS_HINT = 16  # the batch size oneDNN picks the blocked layout for; any row count runs on it


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward uses a oneDNN-packed copy of its weight for 3+ rows
    (module docstring). Made by ``pack_linears``, never built directly."""

    _packed: tuple[int, int, Any]  # (weight version, storage pointer, packed weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if (rows < MIN_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._current(), self.bias, "none", [],
                                                  "")  # (..., out)

    def _current(self) -> Any:
        weight = self.weight
        key = (weight._version, weight.data_ptr())
        if self._packed[:2] != key:  # written since it was packed: pack it again
            self._packed = (*key, _pack(weight))
        return self._packed[2]


def _pack(weight: torch.Tensor) -> Any:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def pack_linears(model: nn.Module, plan: Any, device: torch.device) -> int:
    """Swap every plain fp32 CPU ``nn.Linear`` of ``model`` for ``PackedLinear``; the number
    swapped. A ``ValueError`` that says why where packing cannot apply: a GPU rank, no oneDNN
    in this torch build, or weights offloaded to host or disk (a packed copy would pin every
    weight in host memory, undoing the plan)."""
    if device.type != "cpu":
        raise ValueError(f"pack_weights=True is for CPU ranks (it works around a CPU GEMM's "
                         f"slow path for a few rows); these ranks run on {device.type}: leave "
                         f"it off there")
    if not torch.backends.mkldnn.is_available():
        raise ValueError("pack_weights=True needs a torch build with oneDNN (mkldnn), which "
                         "this one lacks: leave pack_weights off")
    if plan.offload != "none":
        raise ValueError(f"pack_weights=True keeps a packed copy of every weight in host "
                         f"memory, which undoes offload={plan.offload}: leave pack_weights off, "
                         f"or serve without offloading")
    swapped = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is nn.Linear and weight is not None and weight.device.type == "cpu"
                and weight.dtype == torch.float32 and not weight.is_meta):
            module.__class__ = PackedLinear
            module._packed = (weight._version, weight.data_ptr(), _pack(weight))
            swapped += 1
    return swapped


def unpack_linears(model: nn.Module) -> int:
    """Undo ``pack_linears``: plain ``nn.Linear`` again, the packed copies dropped; the number
    restored."""
    restored = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            del module._packed
            module.__class__ = nn.Linear
            restored += 1
    return restored
