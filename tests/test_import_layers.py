"""The import structure of src/gpuwarden, read from the sources with ``ast`` (nothing is imported).

Every import counts: at module level, inside a function, and under ``if TYPE_CHECKING:``. A
module-level import is the one that can fail at import time, but the others are dependencies
just the same: a lazy import that exists to defer a cost still says "this module needs that
one", and an import circle hidden inside a function (or behind TYPE_CHECKING) is still a type or
a decision living one floor too high (docs/architecture.md). So the graph is one graph.

An edge goes to the module an import names: ``from gpuwarden.lease import acquire`` to the
package ``gpuwarden.lease`` (its ``__init__.py``), ``from gpuwarden.launch.watch import stall``
to the module ``gpuwarden.launch.watch.stall``. The parent packages that Python imports on the
way are not edges: a package's ``__init__.py`` imports nothing of its sub-modules here, or
hands names on (``gpuwarden.lease``), and is checked as a module of its own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "gpuwarden"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _target(name: str) -> str | None:
    """The module of gpuwarden that ``name`` is or lies in (``a.b.C`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> Iterator[tuple[str, int, str]]:
    """(imported module of gpuwarden, line, where: "module", "function" or "type-checking")."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(node: ast.AST, where: str) -> Iterator[tuple[str, int, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), where)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, where
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - (child.level - 1)]
                    base = ".".join([*parts, *([child.module] if child.module else [])])
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    yield (full if full in MODULES else base), child.lineno, where
            else:
                yield from walk(child, where)

    for name, line, where in walk(ast.parse(path.read_text(), str(path)), "module"):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            target = _target(name)
            if target is not None and target != module:
                yield target, line, where


# module -> imported module -> every import of it: (line, where)
GRAPH: dict[str, dict[str, list[tuple[int, str]]]] = {}
for _module in MODULES:
    GRAPH[_module] = {}
    for _to, _line, _where in imports_of(_module):
        GRAPH[_module].setdefault(_to, []).append((_line, _where))


def _first(imports: list[tuple[int, str]]) -> str:
    line, where = min(imports, key=lambda i: (("module", "function", "type-checking").index(i[1]),
                                              i[0]))
    return f"line {line}, {where} level"


def circles() -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def _loop_through(members: list[str]) -> list[str]:
    """One circle inside a strongly connected set, as the modules in import order."""
    inside = set(members)
    start = members[0]
    path = [start]
    seen = {start}
    while True:
        nxt = next(w for w in sorted(GRAPH[path[-1]]) if w in inside)
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)


def _describe(loop: list[str]) -> str:
    steps = []
    for a, b in zip(loop, loop[1:], strict=False):
        steps.append(f"{a} -> {b} ({_first(GRAPH[a][b])})")
    return "; ".join(steps)


def test_the_parser_sees_the_imports_that_matter() -> None:
    """A check of the check: the kinds of import it must see, on modules that have them."""
    supervisor = {to: {where for _line, where in imports}
                  for to, imports in GRAPH["gpuwarden.launch.supervisor"].items()}
    assert supervisor["gpuwarden.launch.outcome"] == {"module"}
    assert supervisor["gpuwarden.launch.multinode.peers"] == {"function", "type-checking"}
    assert supervisor["gpuwarden.launch.watch.flight_recorder"] == {"function"}  # from pkg import mod
    assert "module" in {w for _l, w in GRAPH["gpuwarden.lease"]["gpuwarden.lease.manager"]}


def test_no_import_circle_in_gpuwarden() -> None:
    found = circles()
    assert not found, "import circles (each shown as one loop through it):\n" + "\n".join(
        f"- {', '.join(members)}: {_describe(_loop_through(members))}" for members in found)


# Who may import whom inside launch/ (docs/architecture.md draws it): every import goes to a
# lower floor, or stays in its own room (the longest prefix below names a module's room).
# Imports from outside launch/ (the CLI, gpuwarden.distributed, gpuwarden.jobs) are not
# constrained here; those of launch/ to the rest of gpuwarden are not either.
LAUNCH_FLOORS = {
    "gpuwarden.launch": 0,  # the package: its __init__ imports nothing
    "gpuwarden.launch.config": 0,
    "gpuwarden.launch.watch": 0,
    "gpuwarden.launch.plan": 1,
    "gpuwarden.launch.outcome": 2,
    "gpuwarden.launch.restart": 3,  # the package: its __init__ imports nothing
    "gpuwarden.launch.restart.policy": 3,
    "gpuwarden.launch.multinode": 4,
    "gpuwarden.launch.ranks": 5,
    "gpuwarden.launch.preflight": 6,
    "gpuwarden.launch.supervisor": 6,
    "gpuwarden.launch.report": 6,
    "gpuwarden.launch.restart.attempts": 6,
    "gpuwarden.launch.observer": 7,
    "gpuwarden.launch.runner": 8,
}


def _room(module: str) -> str:
    return max((r for r in LAUNCH_FLOORS if module == r or module.startswith(r + ".")), key=len)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("gpuwarden.launch")))
def test_launch_imports_go_down(module: str) -> None:
    room = _room(module)
    wrong = []
    for to, imports in sorted(GRAPH[module].items()):
        if not to.startswith("gpuwarden.launch"):
            continue
        there = _room(to)
        if there != room and LAUNCH_FLOORS[there] >= LAUNCH_FLOORS[room]:
            wrong.append(f"{module} (floor {LAUNCH_FLOORS[room]}) -> {to} (floor "
                         f"{LAUNCH_FLOORS[there]}), {_first(imports)}")
    assert not wrong, "imports that do not go down:\n" + "\n".join(wrong)


def test_every_launch_module_has_a_floor() -> None:
    rooms = {_room(m) for m in MODULES if m.startswith("gpuwarden.launch")}
    assert rooms <= set(LAUNCH_FLOORS)
    top = [m for m in MODULES if m.count(".") == 2 and m.startswith("gpuwarden.launch.")
           and MODULES[m].name != "__init__.py"]
    assert len(top) <= 8, f"launch/'s top level holds {len(top)} modules: {sorted(top)}"
