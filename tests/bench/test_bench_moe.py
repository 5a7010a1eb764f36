"""``python -m bench moe --quick``: its byte counts equal their formulas.

What is protected (issue 29): on 2 real gloo ranks a small Mixtral under ``ep=2`` moves, per
MoE layer and summed over the ep group, exactly the formula's all-to-all bytes as the
instrumented collectives count them (rows out and back, 2 x tokens x top-k x hidden x 4 B, in
forward and in backward, plus the row counts in forward; nothing under ``dp=2``), and each
rank's model state (parameters, gradients, AdamW states) is 16 B x (dense + experts / ep);
under ``dp=2``, x (dense + experts). Timings and the imbalance are printed, not asserted.
"""

from __future__ import annotations

import pytest

from bench.moe.run import measure, parse, report


@pytest.mark.full
def test_moe_bench_bytes_equal_the_formulas(ranks, capsys):
    from helpers.distributed import process_comm

    result = measure(parse(["--quick"]), ranks(2), process_comm)
    for row in result["all_to_all"]:
        assert row["measured"] == row["formula"], row
        assert row["dp=2"] == 0, row
    for row in result["state"]:
        assert row["measured"] == row["formula"], row
    assert len(result["rounds"]["ep=2"]) == 3
    assert all(x >= 1.0 for x in result["imbalance"])
    report(result)
    assert "all-to-all bytes equal the formula: True" in capsys.readouterr().out
