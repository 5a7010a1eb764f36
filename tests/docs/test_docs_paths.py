"""Every file and every dotted name the prose documentation cites exists.

What is protected: the pages under docs/, README.md and CONTRIBUTING.md name code by its path
(``kernels_runtime/memory/chunks.py``, ``bench/planner/``, ``tests/helpers/hosts.py``), by a
file name inside a code span (``memory/chunk_step.py``, ``ring_comms.py``), by a path and a
name (``workbench/inference/remote_engine.py::RemoteEngine``) or by a dotted name
(``kernels_runtime.calibrate.trial.run_trial``, ``workbench.show_dashboard``, and the API
reference's ``::: workbench.planner``). When code moves or a name is renamed, the page
that cites the old one fails here, naming the page, the line and what is missing, instead of
sending a reader to nothing. The check is static and torch-free (well under a second): a dotted
name resolves when a module file defines it at its top level (a ``def``, ``class``, assignment,
import, or an entry of a ``lazy_module`` map), or a class there defines its last part; only
where the static view cannot tell (an attribute set in ``__init__``, a star import, an
attribute of an attribute) is the module imported for real. A check of the checker feeds it an
injected bad path, file name and dotted name.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels_runtime", "workbench", "bench", "tests")
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
SKIP_DIRS = {".venv", "node_modules", "__pycache__", "artifacts", ".git", "site"}
# not part of a name: a path or a dotted name starts after none of these
_BEFORE = r"(?<![\w./\-])"
_PACKAGE = "(?:" + "|".join(PACKAGES) + ")"
PATH = re.compile(_BEFORE + rf"(?P<path>{_PACKAGE}/[\w./*\-]*)(?:::(?P<attr>[\w.]+))?")
DOTTED = re.compile(_BEFORE + _PACKAGE + r"(?:\.\w+)+")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FILE_NAME = re.compile(_BEFORE + r"[\w/]*\w\.py\b")
# a dotted name ending in one of these is a file name (``workbench.json``), not a module
DYNAMIC = "<dynamic>"  # key of ``top_level``: the module may bind names no statement shows
FILE_SUFFIXES = {"json", "md", "py", "ipynb", "html", "yml", "yaml", "toml", "txt", "sh", "js",
                 "css", "png", "jsonl", "safetensors"}


@cache
def repository_files() -> tuple[str, ...]:
    """Every file's path from the repository root, build outputs and environments left out."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        rel = Path(folder).relative_to(ROOT).as_posix()
        found += [f"{rel}/{f}" if rel != "." else f for f in files]
    return tuple(found)


def module_file(parts: list[str]) -> Path | None:
    """The file (or, for a namespace package like ``tests``, the folder) of a module."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() else None


@cache
def top_level(path: Path) -> dict[str, ast.AST | str]:
    """Names a module binds at its top level: the node that binds each, or for an imported
    name the dotted name it comes from (followed by ``resolves``)."""
    if path.is_dir():
        return {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: dict[str, ast.AST | str] = {}
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    lazy_maps: list[ast.Dict] = []
    has_getattr = False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
            has_getattr |= node.name == "__getattr__"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
                        has_getattr |= name.id == "__getattr__"
            if isinstance(node.value, ast.Dict):
                lazy_maps.append(node.value)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the package this module is in
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([source] if source else [])])
            for alias in node.names:
                names[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
    if has_getattr or any(isinstance(v, str) and v.endswith(".*") for v in names.values()):
        names[DYNAMIC] = "dynamic"
    if has_getattr:  # a lazy package face: {"Name": "package.module"} maps what it serves
        for mapping in lazy_maps:
            for key, value in zip(mapping.keys, mapping.values, strict=True):
                if (isinstance(key, ast.Constant) and isinstance(key.value, str)
                        and isinstance(value, ast.Constant) and isinstance(value.value, str)):
                    names.setdefault(key.value, f"{value.value}.{key.value}")
    return names


def class_members(node: ast.ClassDef) -> set[str]:
    """Methods, class attributes and dataclass fields a class body defines."""
    out = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            out |= {t.id for target in targets for t in ast.walk(target)
                    if isinstance(t, ast.Name)}
    return out


def resolves(dotted: str, depth: int = 0) -> bool | None:
    """Whether ``dotted`` names a module of this repository or something one defines; None
    when the static view cannot tell (an attribute of a function's result, a name a star
    import or a ``__getattr__`` may provide)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(parts[:cut])
        if path is not None:
            break
    else:
        return False
    rest = parts[cut:]
    if not rest:
        return True
    names = top_level(path)
    binding = names.get(rest[0])
    if isinstance(binding, str):  # imported: look where it comes from
        if binding.endswith(".*"):
            return None
        return resolves(".".join([binding, *rest[1:]]), depth + 1) if depth < 8 else None
    if binding is None:
        return None if DYNAMIC in names else False
    if len(rest) == 1:
        return True
    if isinstance(binding, ast.ClassDef) and len(rest) == 2:
        return rest[1] in class_members(binding) or None  # set in __init__, or inherited
    return None


def exists(dotted: str) -> bool:
    """``resolves``, asking the imported module only where the static view cannot tell."""
    found = resolves(dotted)
    return found if found is not None else imported_for_real(dotted)


def imported_for_real(dotted: str) -> bool:
    """The slow, exact answer for what ``resolves`` cannot see (names bound at run time)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except AttributeError:
            return False
        return True
    return False


def problems_in(text: str, where: str) -> list[str]:
    """What ``text`` (a page, ``where`` its name) cites that does not exist, one line each."""
    out = []
    files = repository_files()
    for number, line in enumerate(text.splitlines(), 1):
        at = f"{where}:{number}"
        for match in PATH.finditer(line):
            path = match["path"].rstrip(".,:;-")
            if ".." in path or not path:
                continue
            if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                out.append(f"{at}: no file or folder {path}")
            elif match["attr"]:
                module = ".".join(Path(path).with_suffix("").parts)
                dotted = f"{module}.{match['attr'].rstrip('.')}"
                if not exists(dotted):
                    out.append(f"{at}: {path} defines no {match['attr']}")
        for match in DOTTED.finditer(line):
            dotted = match[0]
            if dotted.rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue
            if not exists(dotted):
                out.append(f"{at}: {dotted} is neither a module nor a name one defines")
        for span in CODE_SPAN.findall(line):
            for name in FILE_NAME.findall(span):
                if name.split("/")[0] in PACKAGES:
                    continue  # a full path: checked above
                if not any(f == name or f.endswith("/" + name) for f in files):
                    out.append(f"{at}: no file of the repository is {name} or ends in /{name}")
    return out


def test_every_path_and_dotted_name_the_docs_cite_exists():
    assert len(PAGES) >= 5, PAGES
    problems = [p for page in PAGES
                for p in problems_in(page.read_text(encoding="utf-8"),
                                     page.relative_to(ROOT).as_posix())]
    assert not problems, ("the docs cite what does not exist; fix the citation (or the code):\n"
                          + "\n".join(problems))


def test_an_injected_bad_citation_is_named_where_it_is():
    text = ("Fine: `kernels_runtime/memory/chunks.py`, `tests/conformance/test_lora*.py`, "
            "`workbench/inference/remote_engine.py::RemoteEngine`,\n"
            "`kernels_runtime.calibrate.trial.run_trial`, `workbench.RemoteEngine`, "
            "`chunk_step.py`, `colossal-workbench.json`, tests.tools.cycles.\n"
            "Bad: `kernels_runtime/parallel/pipeline/seams.py` and "
            "`kernels_runtime.parallel.state.not_available`,\n"
            "`workbench/inference/remote_engine.py::LocalEngine`, `planner/cost_modell.py`.\n")
    assert problems_in(text, "page.md") == [
        "page.md:3: no file or folder kernels_runtime/parallel/pipeline/seams.py",
        "page.md:3: kernels_runtime.parallel.state.not_available is neither a module nor a "
        "name one defines",
        "page.md:4: workbench/inference/remote_engine.py defines no LocalEngine",
        "page.md:4: no file of the repository is planner/cost_modell.py or ends in "
        "/planner/cost_modell.py",
    ]
