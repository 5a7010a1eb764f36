"""The prefix-sharing line of ``python -m bench inference``: the shared-system-prompt requests
(``ranks.shared_workload``) on a fresh engine with prefix sharing on and off, ``rounds`` times,
the two sides' order alternating, so a figure is a median with its spread rather than one run
of each taken while the machine's other load came and went.

Each side reports wall seconds and the CPU seconds of every rank (summed): on a shared machine
the wall time of one side can double from one round to the next while its CPU time does not,
so the CPU ratio says what the engine saved and the wall ratio what a user would have seen.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.common.spread import spread


def run(pool: Any, spec: dict, rounds: int) -> dict[bool, list[dict]]:
    from bench.inference.ranks import prefix_round

    out: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(rounds):
        for sharing in ((True, False) if r % 2 == 0 else (False, True)):
            out[sharing].append(pool.run(prefix_round, spec, sharing, timeout_s=900)[0])
    return out


def report(out: dict[bool, list[dict]], spec: dict) -> dict[str, float]:
    on, off = out[True], out[False]
    first = on[0]
    wall = [b["seconds"] / a["seconds"] for a, b in zip(on, off)]
    cpu = [b["cpu"] / a["cpu"] for a, b in zip(on, off)]
    print(f"prefix sharing, {spec['requests']} requests after one {spec['system_prompt']}-token "
          f"system prompt: {first['hits']} blocks taken from the index instead of computed "
          f"(prompt tokens computed {first['computed_prompt_tokens']} of "
          f"{first['prompt_tokens']}); peak blocks in use {first['peak_blocks']} vs "
          f"{off[0]['peak_blocks']} without; seconds {spread([a['seconds'] for a in on], 2)} "
          f"vs {spread([b['seconds'] for b in off], 2)} without; CPU seconds (all ranks) "
          f"{spread([a['cpu'] for a in on], 2)} vs {spread([b['cpu'] for b in off], 2)}")
    print(f"prefix sharing speed-up (without / with, {len(on)} rounds): wall "
          f"{spread(wall, 2)}x, CPU {spread(cpu, 2)}x (aim > 1)")
    return {"prefix_speedup": statistics.median(wall), "prefix_cpu_speedup": statistics.median(cpu),
            "hits": first["hits"]}
