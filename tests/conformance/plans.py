"""The plans of the conformance matrix, by rank count, and the cells that must be refused.

Every data-parallel stage, each tensor-parallel mode, each sequence mode, the pipeline, offload
to host and to disk, and the combinations the README and notebooks advertise. A cell a plan
cannot run (heads that do not divide, a sequence that does not split) is not left out: the plan
must be refused with a message naming why (``REFUSED``), by ``parallelize`` before any rank
changes the model, or by the first step for a batch it cannot split.
"""

from __future__ import annotations

OFFLOAD = "offload=static offload_params=1 offload_grads=1 offload_optim=1"

PLANS: dict[str, int] = {  # plan -> ranks
    "dp=2": 2,
    "dp=2 zero=1": 2,
    "dp=2 zero=2": 2,
    "dp=2 zero=3": 2,
    "dp=2 zero=2 ckpt": 2,
    "tp=2": 2,
    "tp=2 sp_mode=split_gather": 2,
    "sp=2 sp_mode=ring": 2,
    "sp=2 sp_mode=all_to_all": 2,
    "pp=2 mb=2": 2,
    f"dp=2 zero=3 {OFFLOAD}": 2,  # every model state on the host
    f"dp=2 zero=3 {OFFLOAD} host_mem=0": 2,  # ... and beyond a zero host budget, on disk
    "tp=3": 3,
    "tp=4 tp_mode=2d": 4,
    "dp=2 tp=2 zero=1": 4,
    "dp=2 pp=2 mb=2 zero=1": 4,
    "tp=2 pp=2 mb=2": 4,
    "dp=2 sp=2 sp_mode=ring zero=1": 4,
    "tp=8 tp_mode=2.5d tp_depth=2": 8,
    "dp=2 tp=2 pp=2 mb=2 zero=1": 8,
}

# (family, plan) -> a fragment the refusal must contain
HEADS = "attention heads"
REFUSED: dict[tuple[str, str], str] = {}


def _refuse(families: tuple[str, ...], plans: tuple[str, ...], why: str) -> None:
    for family in families:
        for plan in plans:
            REFUSED[family, plan] = why


_TP2 = ("tp=2", "tp=2 sp_mode=split_gather", "dp=2 tp=2 zero=1", "tp=2 pp=2 mb=2",
        "dp=2 tp=2 pp=2 mb=2 zero=1")
_refuse(("smollm2",), _TP2 + ("sp=2 sp_mode=all_to_all",), "heads")  # 9 heads over 3
_refuse(("smollm2",), ("tp=4 tp_mode=2d", "tp=8 tp_mode=2.5d tp_depth=2"), HEADS)
_refuse(("llama", "mistral", "qwen2", "qwen3"), ("tp=3",), HEADS)
_SP = ("sp=2 sp_mode=ring", "sp=2 sp_mode=all_to_all", "dp=2 sp=2 sp_mode=ring zero=1")
_refuse(("vit",), _SP, "pixel_values")  # its token sequence is made inside the model
_refuse(("bert", "bert-mlm"), _SP, "next-token loss")  # a loss that is not next-token


def cells() -> list[tuple[str, str, int]]:
    """Every (family, plan, ranks) of the matrix."""
    from conformance.families import FAMILIES

    return [(family, plan, world) for plan, world in PLANS.items() for family in FAMILIES]
