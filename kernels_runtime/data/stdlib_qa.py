"""An instruction set that needs no download: questions about standard-library functions,
answered from their docstrings.

Why it exists: fine-tuning demos need chat data a small instruct model does not already answer
the way the data does (so the held-out loss has room to fall), and CI and Binder have no dataset
hub. Every machine has the stdlib: ``What does json.dumps do?`` is answered with the first
paragraph of ``json.dumps``'s docstring, in the chat format of ``tokenizer.apply_chat_template``
(``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``).

The held-out split is by function (a function's question never appears in both files) and
deterministic: each function goes where a hash of its qualified name sends it, so adding a
module never moves an existing function to the other side. Docstrings change between Python
versions, so the rows are as stable as the interpreter that builds them. Torch-free.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

# Modules whose public functions have short, plain-English first paragraphs.
DEFAULT_MODULES: tuple[str, ...] = (
    "base64", "bisect", "colorsys", "copy", "fnmatch", "functools", "glob", "gzip", "heapq",
    "html", "itertools", "json", "keyword", "math", "operator", "os.path", "random", "re",
    "shlex", "shutil", "statistics", "string", "textwrap", "urllib.parse", "zlib",
)
MIN_ANSWER, MAX_ANSWER = 20, 320  # characters of the first paragraph kept as an answer


def question(qualname: str) -> str:
    """The user turn asking about ``qualname`` (``"json.dumps"``)."""
    return f"What does {qualname} do?"


def first_paragraph(doc: str | None, name: str) -> str | None:
    """The docstring's first paragraph on one line, or None when it makes no answer: missing,
    a bare signature (C functions' ``name(x, y) -> z`` lines), or out of the length bounds."""
    if not doc:
        return None
    paragraphs = [p for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]
    while paragraphs and re.match(rf"{re.escape(name)}\s*\(.*\)", paragraphs[0].strip()):
        lines = paragraphs[0].strip().splitlines()  # signature lines first, text may follow
        rest = [ln for ln in lines if not re.match(rf"{re.escape(name)}\s*\(", ln.strip())]
        paragraphs = ([" ".join(rest)] if rest else []) + paragraphs[1:]
    if not paragraphs:
        return None
    text = " ".join(paragraphs[0].split())
    return text if MIN_ANSWER <= len(text) <= MAX_ANSWER else None


def _functions(module_name: str) -> list[tuple[str, str]]:
    """(qualified name, answer) of the module's public functions, sorted by name."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"standard-library module {module_name!r} does not import ({err}); "
                         "leave it out of modules") from err
    found = []
    for name, obj in sorted(vars(module).items()):
        public = not name.startswith("_") and name in getattr(module, "__all__", [name])
        if public and (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            answer = first_paragraph(inspect.getdoc(obj), name)
            if answer is not None:
                found.append((f"{module_name}.{name}", answer))
    return found


def chat_row(qualname: str, answer: str) -> dict[str, list[dict[str, str]]]:
    """One chat example: the question as the user turn, the docstring as the assistant's."""
    return {"messages": [{"role": "user", "content": question(qualname)},
                         {"role": "assistant", "content": answer}]}


def _bucket(qualname: str) -> float:
    """A number in [0, 1) fixed by the name alone (not Python's salted ``hash``)."""
    digest = hashlib.sha256(qualname.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def stdlib_qa(modules: Sequence[str] = DEFAULT_MODULES, heldout: float = 0.2
              ) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), each ordered by the hash of its function's name (so the
    first n rows are a fixed, well-mixed sample). A docstring shared by two names (aliases)
    is kept once, under the first name, so no answer sits on both sides of the split."""
    if not 0 < heldout < 1:
        raise ValueError(f"heldout={heldout} must be a fraction between 0 and 1, e.g. 0.2")
    if isinstance(modules, str):
        raise TypeError(f"modules must be a list of module names, got the string {modules!r}")
    seen: set[str] = set()
    rows: list[tuple[float, str, str]] = []
    for module_name in modules:
        for qualname, answer in _functions(module_name):
            if answer not in seen:
                seen.add(answer)
                rows.append((_bucket(qualname), qualname, answer))
    if not rows:
        raise ValueError(f"no function of {list(modules)} has a usable docstring")
    rows.sort()
    train = [chat_row(q, a) for b, q, a in rows if b >= heldout]
    held = [chat_row(q, a) for b, q, a in rows if b < heldout]
    return train, held


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write one JSON object per line, atomically (ranks may build the same file at once)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)
    return path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def build_stdlib_qa(out_dir: str | os.PathLike, modules: Sequence[str] = DEFAULT_MODULES,
                    heldout: float = 0.2) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``heldout.jsonl`` under ``out_dir``; {split: path}."""
    train, held = stdlib_qa(modules, heldout)
    out = Path(out_dir)
    return {"train": write_jsonl(train, out / "train.jsonl"),
            "heldout": write_jsonl(held, out / "heldout.jsonl")}
