"""Plans and the parallel context built from them."""

from kernels_runtime.mesh.plan import Plan, PlanError

__all__ = ["Plan", "PlanError"]
