"""The stdlib instruction set: chat rows answered from docstrings, split by function.

What is protected: every row is a user question about one function and the assistant's answer
is that function's own docstring paragraph; the split never puts a function (or an answer
shared by aliases) on both sides, does not depend on the order of the modules or on which other
modules are in, and the JSON-lines files read back as the rows. Bad arguments are refused with
what to pass instead. Fast (no torch).
"""

from __future__ import annotations

import inspect
import json

import pytest

from kernels_runtime.data.stdlib_qa import (
    build_stdlib_qa,
    first_paragraph,
    read_jsonl,
    stdlib_qa,
)

MODULES = ("json", "math", "textwrap", "heapq")


def _names(rows: list[dict]) -> list[str]:
    return [r["messages"][0]["content"].removeprefix("What does ").removesuffix(" do?")
            for r in rows]


def test_rows_are_questions_answered_by_the_functions_docstrings():
    import heapq
    import json as json_module

    train, held = stdlib_qa(MODULES)
    rows = train + held
    assert len(rows) >= 40
    for row in rows:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert 20 <= len(assistant["content"]) <= 320
    answers = dict(zip(_names(rows), (r["messages"][1]["content"] for r in rows)))
    assert answers["json.dumps"] == "Serialize ``obj`` to a JSON formatted ``str``."
    assert answers["heapq.heappush"] == " ".join(
        inspect.getdoc(heapq.heappush).split("\n\n")[0].split())
    assert "json.JSONDecoder" not in answers  # classes are not functions
    assert json_module.dumps.__name__ == "dumps"


def test_the_split_is_by_function_deterministic_and_independent_of_the_other_modules():
    train, held = stdlib_qa(MODULES)
    assert set(_names(train)).isdisjoint(_names(held))
    answers = [r["messages"][1]["content"] for r in train + held]
    assert len(answers) == len(set(answers))  # aliases kept once
    assert 0.1 < len(held) / (len(train) + len(held)) < 0.35
    again = stdlib_qa(tuple(reversed(MODULES)))
    assert again == (train, held)
    math_train, math_held = stdlib_qa(("math",))
    assert set(_names(math_train)) == {n for n in _names(train) if n.startswith("math.")}
    assert set(_names(math_held)) == {n for n in _names(held) if n.startswith("math.")}


def test_first_paragraph_drops_signature_lines_and_bounds_the_length():
    assert first_paragraph("f(x, y) -> int\n\nAdd two numbers together.", "f") == \
        "Add two numbers together."
    assert first_paragraph("f(x)\nReturn x,\n   unchanged.\n\nMore.", "f") == \
        "Return x, unchanged."
    assert first_paragraph("Short.", "f") is None
    assert first_paragraph("word " * 100, "f") is None
    assert first_paragraph(None, "f") is None


def test_files_hold_the_rows_one_json_object_per_line(tmp_path):
    paths = build_stdlib_qa(tmp_path / "qa", ("json", "math"))
    train, held = stdlib_qa(("json", "math"))
    assert read_jsonl(paths["train"]) == train and read_jsonl(paths["heldout"]) == held
    first = paths["train"].read_text().splitlines()[0]
    assert list(json.loads(first)) == ["messages"]
    assert not list(tmp_path.glob("qa/.*.tmp"))


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="heldout=1.5 must be a fraction"):
        stdlib_qa(MODULES, heldout=1.5)
    with pytest.raises(TypeError, match="list of module names"):
        stdlib_qa("json")
    with pytest.raises(ValueError, match="'no_such_module' does not import"):
        stdlib_qa(("no_such_module",))
