"""``python -m bench serving --soak 10`` against a real ``workbench serve`` (issue 26 Must-show).

What is protected: with 64 clients sending one request after another, a tenth disconnecting
mid-stream and a tenth sending malformed bodies, every good request completes with the tokens it
asked for, every malformed body gets a 4xx, and afterwards no KV block is in use and no request
in flight (``/metrics``). RSS growth is reported, never asserted: 10 s is no soak, and RSS is a
figure of the machine, like a time.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.full, pytest.mark.engines]  # the real model on 2 ranks, ~1 min


def test_a_short_soak_loses_no_good_request_and_leaks_no_block(smollm2, capsys):
    from bench.serving.run import main

    # exits 1 on a failure, which fails the test with the report printed
    out = main(["--soak", "10", "--model", str(smollm2.folder)])
    printed = capsys.readouterr().out
    tally = out["tally"]
    assert out["ok"], printed
    assert tally.good > 0 and tally.good_ok == tally.good, printed
    assert tally.malformed > 0 and not tally.not_4xx, printed
    assert tally.disconnected > 0, printed
    assert out["metrics"]["kv_blocks_used"] == 0, printed
    assert out["metrics"]["requests_in_flight"] == 0, printed
    for words in ("good requests complete", "malformed bodies", "KV blocks in use",
                  "kernel (serving process) RSS", "(aim <= 5%)"):
        assert words in printed, words
