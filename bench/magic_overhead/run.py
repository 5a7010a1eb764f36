"""Cost of the workbench's own layers on top of ipyparallel and torch.

1. Round trip of an empty ``%%colossal`` cell against ``DirectView.execute`` of the same code on
   the same engines (aim: ratio <= 1.2), on 2 and 4 ranks.
2. Time to start a pool (``%colossal start``: controller, engines, torch.distributed on every
   rank) against ``python -c "import torch.distributed"``, the floor any launcher pays per
   process (aim: ratio <= 3). Each start is measured beside its own baseline, rounds
   interleaved, so load from elsewhere hits both; the median and the spread are printed.
   Engines import torch while the controller starts (``workbench.pool.rank_process``), so on a
   machine with fewer cores than ranks the floor is the ranks' imports sharing those cores.
3. Step time of a training cell with the live dashboard shown against ``--no-dashboard``
   (aim: ratio <= 1.03; ``dashboard.py``), rounds interleaved, the spread printed.
``--parts`` picks which of ``roundtrip,start,dashboard`` run (2 and 3 need 1's pool starts
only for their own ranks).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from bench.common.spread import span
from bench.common.table import print_table


def _paired_medians_ms(a, b, reps: int) -> tuple[float, float]:
    """Median times of ``a`` and ``b``, alternating them so drift hits both alike."""
    a(), b()  # warm up
    ta, tb = [], []
    for _ in range(reps):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3


def _import_torch_distributed_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True)
    return time.perf_counter() - t0


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench magic_overhead")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3,
                        help="pool starts per rank count, each beside its own import baseline")
    parser.add_argument("--parts", default="roundtrip,start,dashboard",
                        help="which parts to run: roundtrip,start (one loop), dashboard")
    parser.add_argument("--dash-rounds", type=int, default=6,
                        help="dashboard on/off rounds (each one cell per mode)")
    parser.add_argument("--dash-steps", type=int, default=150, help="training steps per cell")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"roundtrip", "start", "dashboard"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from roundtrip,start,dashboard")
    dashboard_ratio = None
    if "dashboard" in parts:
        from bench.magic_overhead.dashboard import run as run_dashboard

        dashboard_ratio = run_dashboard(args.dash_rounds, args.dash_steps)
        if not parts & {"roundtrip", "start"}:
            print(f"\nheadline: %%colossal step time, dashboard on / off = {dashboard_ratio:.3f}x "
                  f"(median of {args.dash_rounds} rounds; aim <= 1.03)")
            return

    from IPython.core.interactiveshell import InteractiveShell

    from workbench.magics import active_pool

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "workbench")
    counts = [int(x) for x in args.ranks.split(",")]
    rows = []
    starts: dict[int, list[float]] = {n: [] for n in counts}
    ratios: dict[int, list[float]] = {n: [] for n in counts}
    baselines: list[float] = []
    for round_ in range(args.rounds):  # rounds interleave the baseline with every start
        for n in counts:
            baseline_s = _import_torch_distributed_s()
            baselines.append(baseline_s)
            t0 = time.perf_counter()
            ip.run_line_magic("colossal", f"start -n {n}")
            start_s = time.perf_counter() - t0
            starts[n].append(start_s)
            ratios[n].append(start_s / baseline_s)
            try:
                if round_ == 0:
                    view = active_pool(ip).view()
                    magic, direct = _paired_medians_ms(
                        lambda: ip.run_cell_magic("colossal", "", "pass"),
                        lambda v=view: v.execute("pass", block=True),
                        args.reps,
                    )
                    rows.append((n, magic, direct, magic / direct))
            finally:
                ip.run_line_magic("colossal", "stop")
    print("empty cell round trip (median ms)")
    print_table(("ranks", "%%colossal", "DirectView.execute", "ratio"), rows)
    print(f"\npool start (s; median of {args.rounds} rounds, min-max beside)")
    start_rows = [(n, statistics.median(starts[n]), span(starts[n]),
                   statistics.median(baselines), statistics.median(ratios[n]),
                   span(ratios[n])) for n in counts]
    print_table(("ranks", "pool start", "spread", "import torch.distributed", "ratio",
                 "ratio spread"), start_rows)
    worst = max(r[3] for r in rows)
    worst_start = max(r[4] for r in start_rows)
    print(f"\nheadline: %%colossal / DirectView.execute round trip = {worst:.2f}x "
          f"(worst over {args.ranks} ranks; aim <= 1.2)")
    print(f"headline: pool start / python -c 'import torch.distributed' = {worst_start:.2f}x "
          f"(worst over {args.ranks} ranks, median of {args.rounds} rounds; aim <= 3)")
    if dashboard_ratio is not None:
        print(f"headline: %%colossal step time, dashboard on / off = {dashboard_ratio:.3f}x "
              f"(median of {args.dash_rounds} rounds; aim <= 1.03)")
