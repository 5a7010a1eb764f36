"""The values each plan field may take, and the error an impossible plan raises.

Why apart from ``plan.py``: ``Plan.validate`` calls the rules in ``validation.py``, and the
rules need this vocabulary; with it in ``plan.py`` the two modules imported each other. Both
import it from here (``plan.py`` re-exports every name, so ``kernels_runtime.mesh.plan`` stays
where users import them from). No torch import.
"""

from __future__ import annotations

TP_MODES = ("1d", "2d", "2.5d")
SP_MODES = ("none", "split_gather", "all_to_all", "ring")
PRECISIONS = ("fp32", "bf16", "fp16")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
OFFLOADS = ("none", "auto", "static")
AXES = ("dp", "pp", "sp", "tp")  # mesh axis order, outermost first
SIZE_FIELDS = ("device_mem", "host_mem")
FRACTION_FIELDS = ("offload_params", "offload_grads", "offload_optim")


class PlanError(ValueError):
    """An impossible plan: the message names the field and a way to fix it."""
