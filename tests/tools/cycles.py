"""Import cycles between the files of ``workbench/`` and ``kernels_runtime/``, read from the AST.

Why from the AST and not from ``sys.modules``: a cycle hidden in a function body (a "lazy"
import) never shows at import time, yet it still means neither file can be read, tested or
moved without the other. So every import counts, those inside functions included.

Which edges count (the rule the layering tests rely on):
- ``import a.b`` and ``from a.b import c`` are an edge to ``a.b.c`` when that is a module,
  else to ``a.b``; relative imports are resolved against the importing file's package.
- Importing ``a.b.c`` also runs ``a/__init__.py``, but that implicit edge is not counted:
  counting it would put every package's ``__init__`` (which re-exports its submodules) on a
  cycle with each submodule, which says nothing about the code's structure.
- Imports under ``if TYPE_CHECKING:`` never run and are not counted here (annotations only;
  the layering tests still count them: a type from the layer above is still a dependency).
- Function-level imports count the same as module-level ones. A lazy import that goes *down*
  the layer map cannot close a cycle unless some edge goes up, and upward edges, lazy or not,
  already fail the layering tests (``tests/workbench/test_workbench_layering.py``,
  ``tests/runtime/test_layering.py``); so counting every edge here only adds the cycles
  *within* one layer, which are the ones a reader trips over (``planner/offload`` <->
  ``planner/setting`` was one). The brief's alternative (count a lazy import only when it goes
  up) would let such same-layer cycles through, so it was not taken.

Run it: ``python -m tests.tools.cycles`` prints every cycle, one per line, and exits 1 if any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("workbench", "kernels_runtime")


def module_name(path: Path, root: Path = REPO) -> str:
    """``workbench/ui/lab/state.py`` -> ``workbench.ui.lab.state``; a package's ``__init__`` is the
    package itself."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of the given packages under ``root``, by dotted name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def _resolve(base: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module a (possibly relative) ``from`` import names."""
    if node.level == 0:
        return node.module or ""
    parts = base.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    prefix = ".".join(parts[:max(keep, 0)])
    return f"{prefix}.{node.module}" if node.module else prefix


def _typing_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                     "typing.TYPE_CHECKING"):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imports(path: Path, name: str, known: set[str],
            typing_only: bool = True) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path`` of a module in ``known``, function-level
    imports included; ``from pkg import sub`` names the submodule when ``sub`` is one.
    ``typing_only=False`` leaves out the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    skipped = set() if typing_only else _typing_only(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node, is_package)
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            found += [(node.lineno, s) for s in subs]
            if len(subs) < len(node.names):  # some names are attributes of ``target`` itself
                found.append((node.lineno, target))
    out = []
    for line, target in found:
        while target and target not in known:  # ``import a.b.attr`` style: its module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append((line, target))
    return out


def import_graph(root: Path = REPO,
                 packages: Iterable[str] = PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}."""
    found = modules(root, packages)
    known = set(found)
    graph: dict[str, dict[str, int]] = {}
    for name, path in found.items():
        edges: dict[str, int] = {}
        for line, target in imports(path, name, known, typing_only=False):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm,
    iterative so deep graphs do not hit the recursion limit), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def describe(component: list[str], graph: dict[str, dict[str, int]],
             paths: dict[str, Path], root: Path = REPO) -> str:
    """One cycle as its edges with file:line, so the reader sees which import to cut."""
    members = set(component)
    edges = [f"{paths[a].relative_to(root)}:{line} -> {b}"
             for a in component for b, line in sorted(graph[a].items()) if b in members]
    return f"cycle of {len(component)}: " + "; ".join(edges)


def main(argv: list[str] | None = None) -> int:
    packages = tuple(argv) if argv else PACKAGES
    graph = import_graph(REPO, packages)
    paths = modules(REPO, packages)
    found = cycles(graph)
    for component in found:
        print(describe(component, graph, paths))
    print(f"{len(found)} import cycle(s) among {len(graph)} modules of {', '.join(packages)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
