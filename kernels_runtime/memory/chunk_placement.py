"""Where a chunk table's payloads go: the order automatic placement predicts, the static homes,
and the floors below which no budget can run a step.

Why apart from ``chunk_sync.py``: these read the chunk table (``chunk_table.py``) once, at
construction or when a static placement is chosen, and decide nothing while the model runs;
the ``Placer`` (``placement.py``) they configure does that.
"""

from __future__ import annotations

from kernels_runtime.memory.chunk_table import ChunkTable
from kernels_runtime.memory.chunks import ChunkLayout, Unit
from kernels_runtime.memory.placement import Trace, static_homes
from kernels_runtime.memory.tiers import Tier


def predicted_trace(units: list[Unit], chunks: list[ChunkLayout], prefix: str = "") -> Trace:
    """The payload keys of one step in the order they are used: every unit's parameters in
    forward, parameters and gradients in backward (reversed), then each trained chunk's step
    (``prefix``: of the keys, ``ChunkTable.key``)."""
    return Trace(predicted_keys([(units, chunks, prefix)]))


def predicted_keys(tables: list[tuple[list[Unit], list[ChunkLayout], str]]) -> list[str]:
    """``predicted_trace``'s keys of one or more chunk tables over the same units (under ep:
    dense and expert chunks), unit by unit in the order their hooks run, then each table's
    step in turn."""
    keys = [f"{p}c{i}.param" for u in range(len(tables[0][0]))
            for units, _, p in tables for i in units[u].chunks]
    for u in reversed(range(len(tables[0][0]))):
        keys += [f"{p}c{i}.{k}" for units, _, p in tables for i in units[u].chunks
                 for k in ("param", "grad")]
    for _, chunks, p in tables:
        keys += [f"{p}c{c.index}.{k}" for c in chunks if not c.frozen
                 for k in ("grad", "master", "state", "param")]
    return keys


def set_floors(table: ChunkTable, training: bool, *others: ChunkTable) -> None:
    """The least device memory (one unit's parameters and gradients, gathered) and host memory
    (one chunk's step, or a frozen chunk on its way to disk) any placement needs; ``others``:
    tables over the same units sharing the placer (a unit gathers its chunks of every one)."""
    tables = [table, *others]
    size = table.dtype.itemsize
    per_param = size + (4 if training else 0)
    table.placer.floor[Tier.DEVICE] = max(
        sum(t.chunks[i].padded * (size if t.chunks[i].frozen else per_param)
            for t in tables for i in t.units[u].chunks)
        for u in range(len(table.units))) if table.units else 0  # parameters and gradients
    per_shard = 4 * 4 if training else size  # grad, master, 2 states
    table.placer.floor[Tier.HOST] = max(  # a frozen chunk is evicted through the host
        (t.param[c.index].nbytes if c.frozen else c.shard_size * per_shard
         for t in tables for c in t.chunks), default=0)


def place_static(table: ChunkTable, fractions: dict[str, float], host_budget: int | None) -> None:
    """Static placement (``placement.static_homes``): parameters, then frozen weights (the
    ``params`` share of their own bytes), then gradients, then masters and optimizer states
    take the host budget in that order. Under zero 3 in fp32 the master is the parameter
    shard: the larger of the two fractions applies."""
    t = table
    host_left = [float("inf") if host_budget is None else float(host_budget)]
    trained = [c.index for c in t.chunks if not c.frozen]
    frozen = [c.index for c in t.chunks if c.frozen]
    aliased = bool(trained) and t.param[trained[0]] is t.master[trained[0]]
    share = fractions.get("params", 0.0)
    if aliased:
        share = max(share, fractions.get("optim", 0.0))
    homes = static_homes([t.param[i].nbytes for i in trained], share, host_left)
    homes += static_homes([t.param[i].nbytes for i in frozen],
                          fractions.get("params", 0.0), host_left)
    grad_homes = static_homes([t.chunks[i].shard_size * 4 for i in trained],
                              fractions.get("grads", 0.0), host_left)
    t.grad_homes = [Tier.DEVICE] * len(t.chunks)  # frozen chunks have none
    for i, home in zip(trained, grad_homes):
        t.grad_homes[i] = home
    payloads = [t.param[i] for i in [*trained, *frozen]]
    if not aliased:
        homes += static_homes([t.master[i].nbytes for i in trained],
                              fractions.get("optim", 0.0), host_left)
        payloads += [t.master[i] for i in trained]
    t.host_left = host_left  # what the optimizer's states may still take (first step)
    for payload, home in zip(payloads, homes):
        t.placer.home[payload.key] = home
        if payload.tier != home:
            t.placer.place(payload, home)
    t.store.reset_step_counters()
