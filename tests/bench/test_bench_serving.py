"""``python -m bench serving --quick`` runs end to end on a real 2-rank pool: every streamed
request comes back whole (its text equal to what ``engine.generate`` produced, with the token
count it asked for), and the throughput ratio is reported (never asserted: it is a time).
The per-token split is printed, every delta's timestamps arrived well formed, and its parts
add up to the per-token latency measured end to end within 10%."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engines, pytest.mark.full]  # a --quick benchmark run


def test_the_serving_benchmark_loses_no_request(capsys):
    from bench.serving.run import main

    figures = main(["--quick"])
    printed = capsys.readouterr().out
    # one timed round at the default pacing, one streaming every step, and the profiled one
    # after them (the split's), 12 requests each
    assert figures["complete"] == figures["expected"] == 36, printed
    assert figures["ratio"] > 0 and figures["every_step"] > 0
    for words in ("concurrent streaming clients", "per output token p50", "between events p50",
                  "streamed at most every 40 ms", "streamed every step",
                  "served / direct throughput", "(aim >= 0.9)",
                  "where a streamed token's time goes", "rank: engine.step",
                  "server: SSE encode + write"):
        assert words in printed, words
    split = figures["split"]
    assert split["tokens"] > 0 and split["rejected"] == 0, split
    assert abs(split["total_ms"] - split["latency_ms"]) <= 0.1 * split["latency_ms"], split
