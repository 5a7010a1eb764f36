"""A stream's text events made from its template (``workbench/serving/sse.py``) are, byte for
byte, what encoding the whole chunk gives (``app._event``), for completions and chat, whatever
the text holds (quotes, backslashes, newlines, non-ASCII, an empty string): the template only
saves the work, never changes what a client reads."""

from __future__ import annotations

import pytest

from workbench.serving import openai_api as api
from workbench.serving.app import _event
from workbench.serving.sse import event_template

TEXTS = ["", "plain", 'say "hi"', "back\\slash", "two\nlines\r\n", "d\u00e9j\u00e0 \U0001f600",
         "\x00mark\x00", "\ufffd"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_template_events_equal_whole_chunk_events(kind, monkeypatch):
    monkeypatch.setattr(api.time, "time", lambda: 1_700_000_000.5)  # one `created` for both
    if kind == "completion":
        def chunk(t):
            return api.completion_chunk("cmpl-1", "tiny", t, None)
    else:
        def chunk(t):
            return api.chat_chunk("chatcmpl-1", "tiny", {"content": t}, None)
    event = event_template(chunk)
    for text in TEXTS:
        assert event(text) == _event(chunk(text)), text
