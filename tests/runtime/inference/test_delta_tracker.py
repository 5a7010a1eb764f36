"""The serving loop's ``DeltaTracker`` (``kernels_runtime/inference/service.py``) sends a request
nothing while a step leaves it no new text to show (a byte token that is half a character, the
possible start of a stop string), then every token since its last delta with the text; a
finished request always gets its last delta, and without a tokenizer every step's tokens go."""

from __future__ import annotations

from kernels_runtime.inference.params import RequestOutput
from kernels_runtime.inference.service import DeltaTracker


def _out(tokens, text, reason=None):
    return RequestOutput("r", [1, 2], list(tokens), text, finish_reason=reason)


def test_held_back_text_sends_nothing_then_everything_since():
    tracker = DeltaTracker(lambda rid: ())
    first = tracker.delta(_out([65], "A"))
    assert first["token_ids"] == [65] and first["text"] == "A"
    assert tracker.delta(_out([65, 0xC3], "A\ufffd")) is None  # half of "é": nothing to show
    second = tracker.delta(_out([65, 0xC3, 0xA9], "A\u00e9"))
    assert second["token_ids"] == [0xC3, 0xA9] and second["text"] == "\u00e9"


def test_a_possible_stop_string_holds_text_and_a_finish_always_sends():
    tracker = DeltaTracker(lambda rid: ("END",))
    assert tracker.delta(_out([1], "a")) is None  # "a" could still be cut by a stop string
    assert tracker.delta(_out([1, 2], "ab")) is None
    mid = tracker.delta(_out([1, 2, 3], "abc"))
    assert mid["token_ids"] == [1, 2, 3] and mid["text"] == "a"
    last = tracker.delta(_out([1, 2, 3, 4], "abc", reason="stop"))
    assert last["token_ids"] == [4] and last["text"] == "bc" and last["completion_tokens"] == 4


def test_without_a_tokenizer_every_step_is_sent():
    tracker = DeltaTracker(lambda rid: ())
    assert tracker.delta(_out([5], None))["token_ids"] == [5]
    assert tracker.delta(_out([5, 6], None))["token_ids"] == [6]
