"""Chat conversations as supervised fine-tuning examples: the loss only on the assistant's turns.

A chat model should learn to answer, not to predict the user's questions or the system prompt,
so every label outside an assistant turn is ``-100`` (ignored by the loss). Where an assistant
turn starts and ends is found from the tokenizer's own chat template, rendered prefix by prefix
(as TRL's and axolotl's "train on completions" do when a template has no ``{% generation %}``
markers, as SmolLM2's has none):

    prompt_i  = render(messages[:i], add_generation_prompt=True)   # ... <|im_start|>assistant\\n
    turn_i    = render(messages[:i + 1])                           # ... answer<|im_end|>\\n

The text between ``len(prompt_i)`` and ``len(turn_i)`` is the assistant's turn as the template
writes it (its content and end-of-turn marker). Each piece of the conversation is tokenized on
its own, so the prompt's tokens are exactly those generation would see and no token straddles a
boundary between a labelled and an unlabelled piece.

Labels follow transformers' convention (``kernels_runtime.data.loader``): they are the input ids
themselves where trained, and the loss shifts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

IGNORE_INDEX = -100
Message = dict[str, str]


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt)


def chat_segments(tokenizer: Any, messages: Sequence[Message]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, is_assistant_turn)`` pieces, in order.

    Raises ``ValueError`` when a message lacks ``role``/``content``, or when the template does
    not render a conversation as the concatenation of its prefixes (then assistant spans cannot
    be found from the text; pass pre-tokenized labels instead)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{type(tokenizer).__name__} has no chat template; set "
                         "tokenizer.chat_template, or use an instruct model's tokenizer")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} is {m!r}: each message must be a dict with 'role' "
                             "and 'content', e.g. {'role': 'user', 'content': 'Hi'}")
    segments: list[tuple[str, bool]] = []
    done = ""  # the text covered so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        turn = _render(tokenizer, messages[:i + 1], generation_prompt=False)
        if not prompt.startswith(done) or not turn.startswith(prompt):
            raise ValueError(
                f"the chat template does not render message {i} after the text of the "
                "messages before it, so the assistant's tokens cannot be located; its "
                "template rewrites earlier turns (e.g. drops reasoning), which this does not "
                "support")
        segments += [(prompt[len(done):], False), (turn[len(prompt):], True)]
        done = turn
    rest = _render(tokenizer, messages, generation_prompt=False)
    if not rest.startswith(done):
        raise ValueError("the chat template does not render the whole conversation after its "
                         "last assistant turn; the assistant's tokens cannot be located")
    segments.append((rest[len(done):], False))
    return [(text, assistant) for text, assistant in segments if text]


def chat_example(tokenizer: Any, messages: Sequence[Message],
                 max_length: int | None = None) -> dict[str, list[int]]:
    """One conversation as ``{"input_ids": [...], "labels": [...]}`` (equal lengths), labels
    ``-100`` everywhere except the assistant turns' tokens (module docstring).

    ``max_length`` cuts longer conversations at the end (their later turns are lost)."""
    ids: list[int] = []
    labels: list[int] = []
    for text, assistant in chat_segments(tokenizer, messages):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if assistant else [IGNORE_INDEX] * len(piece)
    if max_length is not None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "labels": labels}


def chat_examples(tokenizer: Any, rows: Iterable[dict[str, Any]], *, key: str = "messages",
                  max_length: int | None = None,
                  drop_unlabelled: bool = True) -> list[dict[str, list[int]]]:
    """``chat_example`` over rows of ``{key: [messages]}`` (an HF ``Dataset`` or a list).

    With ``drop_unlabelled`` the rows left without an assistant token (no assistant turn, or
    cut away by ``max_length``) are dropped: they would add compute and no loss."""
    out = []
    for i, row in enumerate(rows):
        if key not in row:
            raise ValueError(f"row {i} has no {key!r} field (fields: {sorted(row)}); pass "
                             "key=... naming the field that holds the messages")
        example = chat_example(tokenizer, row[key], max_length)
        if drop_unlabelled and all(t == IGNORE_INDEX for t in example["labels"]):
            continue
        out.append(example)
    return out
