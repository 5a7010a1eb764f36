"""The text a cell shows for a rank's stream, from what ipyparallel stored (fast, no ranks)."""

from __future__ import annotations

from workbench.cells.execution import _new_text


def test_grown_text_sends_its_end_and_a_rewritten_line_comes_after_a_carriage_return():
    assert _new_text("a\n", "a\nb") == "b"
    assert _new_text("a\nprog 10%", "a\nprog 50%") == "\rprog 50%"
    assert _new_text("a\nprog 10%", "a\nprog 100%\ndone\n") == "\rprog 100%\ndone\n"
    assert _new_text("", "") == ""
