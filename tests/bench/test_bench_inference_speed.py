"""``python -m bench inference_speed``'s summary: every aim of the serving and inference issue
has a row, a figure that misses its aim is marked so, and a part not run says so (the parts
themselves are tested by their own benchmarks' --quick runs); the suite is a name ``python -m
bench`` accepts."""

from __future__ import annotations


def test_every_aim_has_a_row_and_a_miss_is_marked():
    from bench.inference_speed.run import AIMS, summary_rows

    figures = {"serving": {"ratio": 0.85},
               "inference": {"ratio": 5.3, "static": 1.4, "prefix_speedup": 2.2,
                             "speculation": 1.9, "acceptance": 0.8, "draft_speculation": 0.2,
                             "draft_acceptance": 0.01, "pipeline": 1.4}}
    rows = summary_rows(figures, {"serving": "1.0 1.2 1.3 -> 1.9 1.4 1.3"})
    assert len(rows) == len(AIMS)
    by_name = {row[0]: row for row in rows}
    served = by_name["served / direct throughput (default pacing)"]
    assert served[1:4] == [0.85, ">= 0.9", "NOT met"] and served[4].startswith("1.0")
    assert by_name["served / direct, streaming every step"][1] == "not run"
    assert by_name["engine / HF generate"][3] == "met"
    assert by_name["continuous / static batches"][3] == "met"
    assert by_name["draft-model acceptance rate"][3] == "-"  # printed, no aim
    assert by_name["disk-tier step / bandwidth bound"][1] == "not run"


def test_the_suite_is_a_benchmark_name(capsys):
    from bench.__main__ import main

    assert main(["--help"]) == 0
    assert "inference_speed" in capsys.readouterr().out
    assert main(["no_such_bench"]) == 2
