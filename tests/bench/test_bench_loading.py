"""``python -m bench loading --quick`` runs end to end on real ranks and reports its figures
(nothing about time is asserted): shard-wise, a host's ranks together hold about one copy of
SmolLM2's weights at their peak, less than ``from_pretrained`` on every rank."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.full]  # a --quick benchmark run: 3 and 4 ranks


def test_the_loading_benchmark_reports_its_figures(capsys):
    pytest.importorskip("gguf")
    from bench.loading.run import main

    figures = main(["--quick"])
    printed = capsys.readouterr().out
    assert set(figures) == {"tp=3", "dp=4 zero=3"}
    for plan, f in figures.items():
        assert 0.8 < f["shard-wise"] <= 1.3, (plan, f)  # about one copy, never less than most
        assert f["shard-wise"] < f["from_pretrained"], (plan, f)
        assert f["time"] > 0, (plan, f)
    for words in ("peak PSS MiB", "PSS/copy", "aim <= 1.3", "tp=3: peak/copy",
                  "dp=4 zero=3: peak/copy", "one copy of the weights ="):
        assert words in printed, words
