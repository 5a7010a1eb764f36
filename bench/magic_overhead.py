"""Cost of the workbench's own layers on top of ipyparallel and torch.

1. Round trip of an empty ``%%colossal`` cell against ``DirectView.execute`` of the same code on
   the same engines (aim: ratio <= 1.2), on 2 and 4 ranks.
2. Time to start a pool (controller, engines, torch.distributed on every rank) against
   ``python -c "import torch.distributed"``, the floor any launcher pays per process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from bench.table import print_table


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
    args = parser.parse_args(argv)

    from IPython.core.interactiveshell import InteractiveShell

    from workbench.magics import active_pool

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "workbench")
    rows, start_rows = [], []
    baseline_s = statistics.median(_import_torch_distributed_s() for _ in range(3))
    for n in (int(x) for x in args.ranks.split(",")):
        t0 = time.perf_counter()
        ip.run_line_magic("colossal", f"start -n {n}")
        start_s = time.perf_counter() - t0
        pool = active_pool(ip)
        view = pool.view()
        try:
            magic, direct = _paired_medians_ms(
                lambda: ip.run_cell_magic("colossal", "", "pass"),
                lambda v=view: v.execute("pass", block=True),
                args.reps,
            )
        finally:
            ip.run_line_magic("colossal", "stop")
        rows.append((n, magic, direct, magic / direct))
        start_rows.append((n, start_s, baseline_s, start_s / baseline_s))
    print("empty cell round trip (median ms)")
    print_table(("ranks", "%%colossal", "DirectView.execute", "ratio"), rows)
    print("\npool start (s)")
    print_table(("ranks", "pool start", "import torch.distributed", "ratio"), start_rows)
    worst = max(r[3] for r in rows)
    print(f"\nheadline: %%colossal / DirectView.execute round trip = {worst:.2f}x "
          f"(worst over {args.ranks} ranks; aim <= 1.2)")
