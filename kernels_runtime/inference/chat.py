"""Chat messages to a prompt: the tokenizer's own chat template where it has one, else a plain
one (``role: content`` lines, then ``assistant:``), so chat completions work for any model.

A template may refuse messages it has no place for (many raise when roles do not alternate
user/assistant, or on a role they do not know); that refusal is the request's error
(``ChatTemplateError``, naming the template's reason), not a crash of whoever renders it.
"""

from __future__ import annotations

from typing import Any


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages; the message says why."""


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if template and hasattr(tokenizer, "apply_chat_template"):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError and whatever it raised
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise ChatTemplateError(f"the model's chat template refused these messages (roles: "
                                    f"{roles}): {err}") from err
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"
