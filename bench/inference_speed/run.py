"""Run the serving, inference and disk-tier benchmarks in sequence and print their headline
figures against their aims in one table (see ``bench/inference_speed/__init__.py``)."""

from __future__ import annotations

import argparse
import operator
import os

from bench.common.table import print_table

# (part, figure key, what it is, aim: "<op> <bound>" or "printed") in the order the issue
# lists them; the aim's text is also its check (``_met``)
AIMS: tuple[tuple[str, str, str, str], ...] = (
    ("serving", "ratio", "served / direct throughput (default pacing)", ">= 0.9"),
    ("serving", "every_step", "served / direct, streaming every step", "printed"),
    ("inference", "ratio", "engine / HF generate", ">= 5"),
    ("inference", "static", "continuous / static batches", ">= 1.2"),
    ("inference", "prefix_speedup", "prefix sharing: without / with", "> 1"),
    ("inference", "speculation", "prompt-lookup speculation: with / without", ">= 1.5"),
    ("inference", "acceptance", "prompt-lookup acceptance rate", "printed"),
    ("inference", "draft_speculation", "draft-model speculation: with / without", "printed"),
    ("inference", "draft_acceptance", "draft-model acceptance rate", "printed"),
    ("inference", "pipeline", "pp=2 overlapped / plain", ">= 1.3"),
    ("memory", "disk_vs_bound", "disk-tier step / bandwidth bound", "<= 2.0"),
)
_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


def _met(value: float, aim: str) -> bool:
    op, bound = aim.split()
    return _COMPARE[op](value, float(bound))


def summary_rows(figures: dict[str, dict], loads: dict[str, str]) -> list[list[object]]:
    """One row per aim: the part's median figure (or "not run"), the aim, whether it is met,
    and the load average around the part."""
    rows = []
    for part, key, what, aim in AIMS:
        value = figures.get(part, {}).get(key)
        if value is None:
            rows.append([what, "not run", aim, "-", loads.get(part, "-")])
            continue
        verdict = "-" if aim == "printed" else ("met" if _met(value, aim) else "NOT met")
        rows.append([what, round(float(value), 3), aim, verdict, loads.get(part, "-")])
    return rows


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench inference_speed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", nargs="+", default=[],
                        choices=["serving", "inference", "memory"])
    args = parser.parse_args(argv)
    from bench.inference.run import main as inference
    from bench.memory.run import main as memory
    from bench.serving.run import main as serving

    parts = {"serving": lambda: serving(["--rounds", str(args.rounds)]),
             "inference": lambda: inference(["--rounds", str(args.rounds)]),
             "memory": lambda: memory(["--skip", "capacity", "cgroup",
                                       "--rounds", str(max(args.rounds, 5))])}
    figures: dict[str, dict] = {}
    loads: dict[str, str] = {}
    for name, part in parts.items():
        if name in args.skip:
            continue
        before = _load()
        print(f"== {name} (load average before: {before})", flush=True)
        figures[name] = part()
        loads[name] = f"{before} -> {_load()}"
    print("== every figure side by side (medians over rounds; spreads in each part above)")
    print_table(["figure", "median", "aim", "", "load average (1, 5, 15 min) around it"],
                summary_rows(figures, loads))
    return figures
