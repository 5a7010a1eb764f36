"""No class body spread over files: a class's methods read only the ``self.`` attributes that
class sets (issue 28).

What is protected: a reader of a class finds every attribute its methods read in that class's
own body (assigned in a method, or a method, property or class attribute), in a base class
defined in the same file, or behind a library base (``nn.Module``, ``Exception``, ...), whose
attributes are documented elsewhere. A mixin whose methods read ``self.x`` set by the class it is
mixed into (``ChunkGrads`` reading ``ChunkGradSync``'s chunk table, ``DiskTraffic`` reading
``TierStore``'s accounts) fails: its parts become objects passed to a constructor instead.

The rules, read from the source alone (no import):
- a base not defined in the repository is opaque (any attribute allowed), except the bases in
  ``TRANSPARENT``, which set nothing a subclass reads;
- a base defined in the repository in another file adds only its declared interface: the
  methods, properties, fields and annotations of its body (an ABC's ``name: str``), never what
  its methods assign (that lives in another file: the case this check exists for); it is
  opaque when it has an opaque base itself;
- a bare annotation in the class body (``ctx: ParallelContext``) declares an attribute that a
  helper function sets, in plain sight.

``ASSERTED`` lists the folders held to it (both packages); anything else scanned is reported
(``-s`` shows it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import kernels_runtime

REPO = Path(kernels_runtime.__file__).parent.parent
SCANNED = ("kernels_runtime", "workbench")
ASSERTED = ("kernels_runtime", "workbench")
TRANSPARENT = {"object", "ABC", "Generic", "Protocol"}  # library bases that set nothing


@dataclass
class _Class:
    file: str  # relative to the repository
    node: ast.ClassDef
    imports: dict[str, str]  # the file's imported names -> their module
    classes: dict[str, ast.ClassDef]  # every class of the file, by name
    sets: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)


def _self_attrs(fn: ast.AST) -> tuple[set[str], set[str]]:
    """(set, read) attribute names of ``self`` anywhere inside a method (lambdas included)."""
    sets, reads = set(), set()
    for node in ast.walk(fn):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and not node.attr.startswith("__")):
            (reads if isinstance(node.ctx, ast.Load) else sets).add(node.attr)
    return sets, reads


def _body_names(node: ast.ClassDef) -> set[str]:
    """Methods, properties, class attributes, nested classes and declarations of a body."""
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names |= {n.id for t in item.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return names


def _scan(file: Path, root: Path) -> list[_Class]:
    tree = ast.parse(file.read_text(), filename=str(file))
    imports: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imports |= {a.asname or a.name: node.module for a in node.names}
        elif isinstance(node, ast.Import):
            imports |= {a.asname or a.name.split(".")[0]: a.name for a in node.names}
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    classes = {n.name: n for n in nodes}
    out = []
    for node in nodes:
        c = _Class(str(file.relative_to(root)), node, imports, classes, _body_names(node))
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sets, reads = _self_attrs(item)
                c.sets |= sets
                c.reads |= reads
        out.append(c)
    return out


def _base_name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Subscript):  # Generic[T]
        base = base.value
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return None


class _Index:
    """Every class of the scanned tree, to resolve bases across files."""

    def __init__(self, folders: tuple[str, ...], root: Path) -> None:
        self.all = [c for f in folders for p in sorted((root / f).rglob("*.py"))
                    for c in _scan(p, root)]
        self.by_module: dict[tuple[str, str], _Class] = {}
        for c in self.all:
            module = c.file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            self.by_module[(module, c.node.name)] = c

    def _bases(self, c: _Class) -> list[tuple[str, _Class | None]]:
        """("same" | "repo" | "transparent" | "opaque", the base's class when in the repo)."""
        out = []
        for base in c.node.bases:
            name = _base_name(base)
            if name in TRANSPARENT:
                out.append(("transparent", None))
            elif name in c.classes and c.classes[name] is not c.node:
                same = next(o for o in self.all if o.file == c.file and o.node is c.classes[name])
                out.append(("same", same))
            elif name is not None and (c.imports.get(name), name) in self.by_module:
                out.append(("repo", self.by_module[(c.imports[name], name)]))
            elif name is not None and c.imports.get(name, "").startswith(SCANNED):
                out.append(("repo", None))  # re-exported through a package: not resolved
            else:
                out.append(("opaque", None))
        return out

    def opaque(self, c: _Class) -> bool:
        """Some base, here or further up, is a library's: its attributes are not ours to see."""
        return any(kind == "opaque" or (base is not None and self.opaque(base))
                   for kind, base in self._bases(c))

    def provided(self, c: _Class) -> set[str]:
        """What the class body and its same-file bases set (transitively), and the declared
        interface of its bases in other files."""
        names = c.sets | _body_names(c.node)
        for kind, base in self._bases(c):
            if kind == "same" and base is not None:
                names |= self.provided(base)
            elif kind == "repo" and base is not None:
                names |= self.interface(base)
        return names

    def interface(self, c: _Class) -> set[str]:
        """What a class declares in its body, and its bases' declarations (transitively)."""
        names = _body_names(c.node)
        for _, base in self._bases(c):
            if base is not None:
                names |= self.interface(base)
        return names

    def unset_reads(self, c: _Class) -> set[str]:
        return set() if self.opaque(c) else c.reads - self.provided(c)


def problems(folders: tuple[str, ...] = SCANNED, root: Path = REPO) -> dict[str, list[str]]:
    """``file:Class`` -> the attributes its methods read and nothing it can see sets (``root``:
    another checkout, e.g. ``git archive`` of an older commit, to see the check fail there)."""
    index = _Index(folders, root)
    out = {}
    for c in index.all:
        missing = index.unset_reads(c)
        if missing:
            out[f"{c.file}:{c.node.name}"] = sorted(missing)
    return out


def test_no_class_reads_attributes_it_does_not_set():
    found = problems()
    for name, attrs in sorted(found.items()):  # the note's list (pytest -s)
        print(f"reads what it does not set: {name}: {', '.join(attrs)}")
    asserted = {k: v for k, v in found.items() if k.startswith(ASSERTED)}
    assert not asserted, asserted
