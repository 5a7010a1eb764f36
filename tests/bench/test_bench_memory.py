"""``python -m bench memory --quick`` runs end to end on one real rank and reports its ratios
(nothing about time is asserted): the benchmark stays runnable, and its capacity row's device
peaks are within the budget they claim to fit."""

from __future__ import annotations

import os

import pytest


@pytest.mark.full  # a --quick benchmark run (cgroup trials)
def test_the_memory_benchmark_reports_its_ratios(capsys):
    from bench.memory.run import main

    ratios = main(["--quick"])
    printed = capsys.readouterr().out
    assert set(ratios) == {"auto_vs_no_offload", "host_adam_speed", "host_step_speed",
                           "disk_vs_bound", "device_budget_capacity", "cgroup_capacity"}
    physical = ratios.pop("cgroup_capacity")
    assert all(r > 0 for r in ratios.values()), ratios
    if os.geteuid() == 0:  # the cgroup trials ran: both sides trained inside the group
        assert physical is not None and physical > 0, printed
        assert "memory cgroup (page cache counted)" in printed and "killed" not in printed
    else:
        assert physical is None and "skipped (not root)" in printed
    for words in ("disk, everything", "page cache bypassed", "aim <= 1.05", "aim >= 1.0x",
                  "aim >= 25x", "host tier h=64 L=12", "step part (medians)",
                  "waited for a CPU s"):
        assert words in printed


def test_live_bytes_counts_a_plain_step_as_its_tensors_add_up():
    """The capacity row's counter: a steady-state AdamW step of a plain model peaks at no less
    than its parameters, gradients and two states (16 bytes per parameter), and not much more
    for a model whose activations are small."""
    from bench.memory.capacity import plain_peak

    row = plain_peak(hidden=64, layers=2, seq=8)
    assert row["textbook"] <= row["peak"] <= 1.2 * row["textbook"], row
