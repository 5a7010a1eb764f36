"""What the live dashboard costs a training cell: ``%%colossal`` step time with the dashboard
shown (``--dashboard``: the figure and its curves panel redrawn while the cell trains) against
``--no-dashboard`` (aim: ratio <= 1.03).

Both cells run the same training loop on the same 2-rank pool, and each rank times its own
steps; the cell's step time is rank 0's mean step (the ranks step together: each step ends with
the gradient all-reduce), the mean rather than the median because drawing comes in bursts a
few times a second and a median would step over the steps it slows. The telemetry (counters,
the curves' rolling window) is published in both modes, since a cell without the figure keeps
its history for ``workbench.show_dashboard()``; what differs is the notebook's drawing: the
kernel process redraws the figures while the ranks train, and on a machine with as many cores
as ranks that drawing takes CPU from the ranks. Rounds interleave the two modes (alternating
which goes first), so load from elsewhere falls on both; per round the ratio on/off, and the
median and spread over rounds are printed, with what each 'on' cell drew (CPU time around
``LiveDashboard._show``, once per cell, and ``Dashboard.refresh``, each redraw; as a share of
the cell's wall time it bounds what drawing can take from the ranks, whatever the load) and
the curve points the notebook received (all steps: none lost to the redraw rate). Here the
shell is a plain IPython shell, not a kernel: the figure's updates are built and serialized as
in a kernel, but no frontend receives them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from bench.common.spread import span
from bench.common.table import print_table

SETUP = """
import statistics
import time
import torch
from kernels_runtime.api import parallelize, train_step
from kernels_runtime.mesh.context import ParallelContext

class Lm(torch.nn.Module):
    '''An embedding, two MLP blocks and a head: a few ms per step on one CPU core.'''
    def __init__(self, vocab=256, h=128):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(vocab, h), torch.nn.Linear(h, vocab)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(h), torch.nn.Linear(h, 4 * h), torch.nn.GELU(),
            torch.nn.Linear(4 * h, h)) for _ in range(2))

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)  # (b, s, h)
        for block in self.blocks:
            x = x + block(x)
        logits = self.out(x)  # (b, s, vocab)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

torch.manual_seed(0)
model = Lm()
model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                         ctx=ParallelContext.build(plan, comm), verbose=False)

def batch(step):
    g = torch.Generator().manual_seed(2 * step + rank)
    ids = torch.randint(0, 256, (8, 64), generator=g)  # (b, s)
    return [(ids, ids.roll(-1, 1))]
"""

TRAIN = """
times = []
for step in range({steps}):
    t0 = time.perf_counter()
    train_step(model, opt, batch(step))
    times.append(time.perf_counter() - t0)
step_ms = statistics.fmean(times) * 1e3
"""


class DrawClock:
    """Counts the kernel's drawing in this process while installed: ``Dashboard.refresh`` calls
    (redraws) and their CPU seconds, and the CPU seconds of ``LiveDashboard._show`` (building
    and displaying the figure once per cell), by wrapping the methods; the code is unchanged.
    CPU rather than wall seconds: under load a redraw's wall time counts the time it waited."""

    def __init__(self) -> None:
        self.calls, self.seconds, self.show_seconds = 0, 0.0, 0.0

    def __enter__(self) -> DrawClock:
        from workbench.ui.dashboard.live import LiveDashboard
        from workbench.ui.dashboard.view import Dashboard

        self._saved = [(Dashboard, "refresh", Dashboard.refresh),
                       (LiveDashboard, "_show", LiveDashboard._show)]
        for cls, name, original in self._saved:
            setattr(cls, name, self._timed(name, original))
        return self

    def _timed(self, name: str, original: Any) -> Any:
        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()  # CPU seconds: what drawing takes from the cores
            try:
                return original(obj, *args, **kwargs)
            finally:
                if name == "refresh":
                    self.calls += 1
                    self.seconds += time.thread_time() - t0
                else:
                    self.show_seconds += time.thread_time() - t0
        return timed

    def __exit__(self, *exc: Any) -> None:
        for cls, name, original in self._saved:
            setattr(cls, name, original)


def _cell(ip: Any, mode: str, steps: int) -> tuple[float, Any]:
    """One training cell with the dashboard ``mode`` ("on"/"off"): rank 0's mean step (ms)
    and the cell's ``RunHistory`` (its curves: the points the notebook received)."""
    from workbench.magics import active_magics

    flag = "--dashboard" if mode == "on" else "--no-dashboard"
    ip.run_cell_magic("colossal", f'--plan "dp=2" {flag} --pull step_ms',
                      TRAIN.format(steps=steps))
    return float(ip.user_ns["step_ms"]), active_magics(ip).last_run


def measure(ip: Any, rounds: int, steps: int) -> dict[str, Any]:
    """On a started 2-rank pool: ``rounds`` x (on, off) cells, alternating their order."""
    ip.run_cell_magic("colossal", '--plan "dp=2" --no-dashboard', SETUP)
    _cell(ip, "off", 5)  # warm-up: first steps build optimizer states, plotly imports
    _cell(ip, "on", 5)
    on, off, points, draws = [], [], [], []
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            t0 = time.perf_counter()
            with DrawClock() as clock:
                ms, history = _cell(ip, mode, steps)
            (on if mode == "on" else off).append((ms, time.perf_counter() - t0))
            if mode == "on":
                curve = history.curves.get(0)  # every step a point: none lost on the way
                points.append(len(curve.train) if curve else 0)
                draws.append((clock.calls, clock.seconds, clock.show_seconds))
    return {"on": on, "off": off, "points": points, "draws": draws}


def run(rounds: int, steps: int) -> float:
    """Start a 2-rank pool, measure, print the table; returns the median ratio on/off."""
    from IPython.core.interactiveshell import InteractiveShell

    os.environ.setdefault("WORKBENCH_RUNS_DIR", tempfile.mkdtemp(prefix="bench-runs-"))
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "workbench")
    ip.run_line_magic("colossal", "start -n 2")
    try:
        result = measure(ip, rounds, steps)
    finally:
        ip.run_line_magic("colossal", "stop")
    ratios = [a[0] / b[0] for a, b in zip(result["on"], result["off"])]
    rows = [(r + 1, on[0], off[0], ratio, on[1], off[1], pts, show_s * 1e3, n,
             draw_s * 1e3 / max(n, 1), f"{(show_s + draw_s) / on[1] * 100:.1f}%")
            for r, (on, off, ratio, pts, (n, draw_s, show_s)) in enumerate(zip(
                result["on"], result["off"], ratios, result["points"], result["draws"]))]
    print(f"\n%%colossal training cell, 2 ranks, {steps} steps per cell: step time with the "
          "dashboard shown (curves drawing) vs --no-dashboard (rank 0's mean step, ms; "
          "redraws: the kernel's figure updates in the 'on' cell)")
    print_table(("round", "on ms", "off ms", "on/off", "on cell s", "off cell s",
                 "curve points", "show CPU ms", "redraws", "CPU ms/redraw", "drawing"), rows)
    median = statistics.median(ratios)
    print(f"on/off median {median:.3f}, spread {span(ratios, 3)} over {rounds} rounds")
    shares = [(d[1] + d[2]) / on[1] for d, on in zip(result["draws"], result["on"])]
    print(f"kernel drawing (figure shown once + redraws, CPU) per second of the 'on' cell: "
          f"median {statistics.median(shares) * 100:.1f}%, spread "
          f"{span([x * 100 for x in shares], 1)}%: at most what it can take from the ranks")
    return median
