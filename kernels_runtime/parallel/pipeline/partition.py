"""Which blocks each virtual stage runs: contiguous ranges balanced by cost.

A stage's time is the sum of its blocks' costs, and the pipeline runs at the pace of its
slowest stage, so the split minimises the largest stage: the classic linear partition,
solved exactly by dynamic programming over prefix sums (blocks are few). The cost is each
block's parameter count, or a measured per-block time where one is given; the first and last
stages also carry the embeddings and the head, passed as ``extra`` costs so the blocks around
them shrink.
"""

from __future__ import annotations

from collections.abc import Sequence


def partition(costs: Sequence[float], stages: int,
              extra: Sequence[float] | None = None) -> list[range]:
    """``stages`` contiguous, non-empty ranges of block indices minimising the largest stage
    cost (block costs plus ``extra[stage]``); ties keep earlier stages no larger."""
    n = len(costs)
    if stages < 1 or n < stages:
        raise ValueError(f"{n} blocks cannot make {stages} pipeline stages of at least one "
                         f"block each; use at most {n} stages (pp x chunks)")
    extra = list(extra) if extra is not None else [0.0] * stages
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost of the first i blocks split into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra[s - 1])
                if cost < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]
