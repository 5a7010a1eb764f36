"""Chat messages to a prompt: the tokenizer's own chat template where it has one, else a plain
one (``role: content`` lines, then ``assistant:``), so chat completions work for any model."""

from __future__ import annotations

from typing import Any


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if template and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"
