"""``python -m bench memory --quick`` runs end to end on one real rank and reports its three
ratios (nothing about time is asserted): the benchmark stays runnable."""

from __future__ import annotations


def test_the_memory_benchmark_reports_its_ratios(capsys):
    from bench.memory import main

    ratios = main(["--quick"])
    printed = capsys.readouterr().out
    assert set(ratios) == {"auto_vs_no_offload", "host_adam_speed", "host_step_speed",
                           "disk_vs_bound"}
    assert all(r > 0 for r in ratios.values()), ratios
    for words in ("disk, everything", "page cache bypassed", "aim <= 1.05", "aim >= 1.0x"):
        assert words in printed
