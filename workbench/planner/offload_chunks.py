"""The planner's chunks: the runtime's offload chunks rebuilt from a model's shape.

Why a model of chunks and not of fractions of Psi: the runtime places whole chunks, a unit's
parameters (a block, the embeddings, the final norm) packed into flat pieces of at most
``chunk_mb`` MiB (``chunks.py``), padded to a multiple of the data ranks N; static placement
puts the *first* chunks of each kind off the device until the fraction is reached, so a
fraction rounds up to chunk boundaries. The planner rebuilds the same chunk list from the
model's shape (``chunk_list``), one parameter group, chunks measured in fp32 bytes as the
model is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.planner.setting import Setting

CHUNK_MB = 32.0  # ParallelState.chunk_mb
BUILD_BYTES = 4  # chunks are sized in the bytes of the model as built (fp32)
KINDS = ("param", "grad", "master", "state")
CATEGORY = {"param": "params", "grad": "grads", "master": "optimizer", "state": "optimizer"}


def chunk_mb(plan_budgets: tuple[int | None, ...], default: float = CHUNK_MB) -> float:
    """``kernels_runtime.memory.offload.chunk_mb``: chunks small enough that every budget holds
    sixteen, at most ``default``."""
    given = [b for b in plan_budgets if b]
    return min(default, min(given) / 16 / 2**20) if given else default


def unit_params(st: Setting) -> tuple[list[float], list[int]]:
    """(parameters of each parameter-owning unit in registration order, the units each forward
    uses in order) on this rank: token embedding, learned positions, the blocks, the final norm,
    an untied head; a tied head uses the token embedding's unit again."""
    spec, q = st.spec, (st.grid[0] if st.grid is not None else 1)
    norm = spec.final_norm_params / q
    positions = spec.positions * spec.hidden / q
    vocab = st.embedding_params_local - norm - positions
    token = vocab if spec.tied_embeddings else vocab / 2
    owners = [token] + ([positions] if positions else []) + [st.layer_params_local] * st.layers
    owners.append(norm)
    uses = list(range(len(owners)))
    if spec.tied_embeddings:
        uses.append(0)
    else:
        owners.append(vocab / 2)
        uses.append(len(owners) - 1)
    scale = st.psi_local / sum(owners)  # a given ``params`` count scales every unit
    return [n * scale for n in owners], uses


@dataclass(frozen=True)
class Chunk:
    unit: int
    padded: float  # parameters, padded to a multiple of the data ranks


def chunk_list(st: Setting) -> list[Chunk]:
    """Each unit split into ceil(bytes / chunk) near-equal chunks (the runtime splits at
    parameter boundaries), each padded to a multiple of N."""
    n, cap = st.data_ranks, chunk_mb((st.plan.device_mem, st.plan.host_mem)) * 2**20
    out = []
    for u, numel in enumerate(unit_params(st)[0]):
        whole = round(numel)
        pieces = max(1, math.ceil(whole * BUILD_BYTES / cap))
        for k in range(pieces):  # sizes that sum to the unit's parameters
            size = whole * (k + 1) // pieces - whole * k // pieces
            out.append(Chunk(u, max(n, math.ceil(size / n) * n)))
    return out


def static_homes(sizes: list[float], fraction: float, host_left: list[float]) -> list[str]:
    """``placement.static_homes``: the first ``fraction`` of the bytes off the device, to the
    host while ``host_left[0]`` lasts (consumed), then to disk."""
    total, off, homes = sum(sizes), 0.0, []
    for size in sizes:
        if fraction <= 0 or off >= fraction * total - 1e-9:
            homes.append("device")
            continue
        off += size
        if host_left[0] >= size:
            host_left[0] -= size
            homes.append("host")
        else:
            homes.append("disk")
    return homes
