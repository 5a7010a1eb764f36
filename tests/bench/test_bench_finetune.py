"""``python -m bench finetune --quick`` runs end to end on real ranks and reports its figures
(nothing about time is asserted): LoRA on the real SmolLM2 holds, per rank, the model state
the formula says (frozen base + adapters + their grads + their AdamW states) within 5% under
every plan measured, in the runtime's own account and in the storages torch holds; the
capacity and speed parts print their ratios."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.full  # a --quick benchmark run: 1, 2 and 3 ranks, minutes


@pytest.mark.timeout(1200)  # 5-10 minutes on a shared 2-core host
def test_the_finetune_benchmark_reports_its_figures(capsys):
    pytest.importorskip("peft")
    pytest.importorskip("gguf")
    from bench.finetune.run import QUICK, main

    figures = main(["--quick"])
    printed = capsys.readouterr().out
    assert set(figures["memory"]) == set(QUICK["plans"])
    for plan, ratio in figures["memory"].items():
        assert abs(ratio - 1) <= 0.05, (plan, ratio, printed)
    capacity = figures["capacity"]
    assert capacity["ratio"] > 1 and capacity["device_peak"] > 0, capacity
    assert capacity["fits"] in (0.0, 1.0), capacity
    speed = figures["speed"]
    assert speed["vs_peft"] > 0 and speed["dp2_scaling"] > 0, speed
    for words in ("aim within 5%", "frozen .grad", "where the frozen weights are",
                  "aim >= 100x", "aim <= 1.1", "aim >= 1.6", "2 ranks x 1 thread"):
        assert words in printed, words
