"""The layers of the code (docs/architecture.md), read from the source's import statements.

Every ``import`` and ``from ... import`` of ``rfedray/`` and ``actors/``, at module level or inside a
function, is an edge of the import graph. The rules:

* Ray only in ``actors/``: no module under ``rfedray/`` imports ``ray``;
* nothing imports the command line (``rfedray.cli``);
* each floor imports only the floors below it (the table :data:`MAY_IMPORT`);
* no circles: the graph of modules is acyclic (a lazy import inside a function counts).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rfedray", "actors")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported(path: Path, name: str) -> set[str]:
    """Every module ``path`` (module ``name``) imports, as written (``from a import b`` gives
    ``a.b`` when that is a module of the project, else ``a``)."""
    known = modules()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return out


@functools.lru_cache(maxsize=None)
def graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (a package counts as its ``__init__``)."""
    known = modules()
    edges = {}
    for name, path in known.items():
        targets = set()
        for target in imported(path, name):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def floor(module: str) -> str:
    """The floor of a project module: the first entry of :data:`FLOORS` it falls under."""
    for prefix in FLOORS:
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    raise AssertionError(f"{module} is on no floor: add it to FLOORS in tests/test_layers.py")


FLOORS = (
    "rfedray.errors", "rfedray.paths", "rfedray.progress", "rfedray.geometry", "rfedray.privacy", "rfedray.options",
    "rfedray.task", "rfedray.models", "rfedray.data", "rfedray.plugins", "rfedray.registry", "rfedray.config",
)
"""Floors, bottom first, that are checked (the others are above them)."""

MAY_IMPORT = {
    "rfedray.errors": set(),
    "rfedray.paths": set(),
    "rfedray.progress": set(),
    "rfedray.geometry": {"rfedray.errors"},
    "rfedray.privacy": {"rfedray.errors", "rfedray.geometry"},
    "rfedray.options": {"rfedray.errors"},
    "rfedray.task": set(),
    "rfedray.models": {"rfedray.errors", "rfedray.geometry", "rfedray.privacy", "rfedray.options", "rfedray.task",
                       "rfedray.spectral", "rfedray.data"},
    "rfedray.data": {"rfedray.errors", "rfedray.options", "rfedray.task", "rfedray.spectral", "rfedray.paths",
                     "rfedray.progress"},
    "rfedray.plugins": {"rfedray.errors", "rfedray.geometry"},
    "rfedray.registry": {"rfedray.errors", "rfedray.options", "rfedray.plugins"},
    "rfedray.config": {"rfedray.errors", "rfedray.options", "rfedray.registry", "rfedray.privacy", "rfedray.paths"},
}
"""What each checked floor may import besides itself (``registry`` imports models and data by
name, at run time, through ``importlib``; ``plugins`` imports the user's models and data by import
path the same way)."""


def test_no_module_under_rfedray_imports_ray():
    offenders = sorted(
        f"{name} imports {target}" for name, path in modules().items() if name.startswith("rfedray")
        for target in imported(path, name) if target == "ray" or target.startswith("ray.")
    )
    assert not offenders, "Ray belongs in actors/:\n" + "\n".join(offenders)


def test_nothing_imports_the_command_line():
    offenders = sorted(f"{a} imports rfedray.cli" for a, targets in graph().items() if "rfedray.cli" in targets)
    assert not offenders, "\n".join(offenders)


def test_actors_are_below_the_runner():
    offenders = sorted(f"{a} imports {b}" for a, targets in graph().items() if a.startswith("actors")
                       for b in targets if b in ("rfedray.runner", "rfedray.cli"))
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("lower", FLOORS)
def test_a_floor_imports_only_the_floors_below_it(lower):
    offenders = []
    for module, targets in graph().items():
        if not (module == lower or module.startswith(lower + ".")):
            continue
        for target in targets:
            mine = target == lower or target.startswith(lower + ".")
            allowed = any(target == f or target.startswith(f + ".") for f in MAY_IMPORT[lower])
            if not (mine or allowed):
                offenders.append(f"{module} imports {target}")
    assert not offenders, f"{lower} may import only {sorted(MAY_IMPORT[lower])}:\n" + "\n".join(sorted(offenders))


def find_cycle(edges: dict[str, set[str]]):
    """One cycle of the graph as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_has_no_circles():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checks_see_an_upward_import_and_a_circle():
    """The rules are not vacuous: a planted upward import and a planted circle are found."""
    edges = dict(graph())
    assert "rfedray.geometry" in edges and edges["rfedray.federated.loop"], "the graph is empty"
    assert find_cycle({**edges, "rfedray.errors": {"rfedray.cli"}, "rfedray.cli": {"rfedray.errors"}})
    assert floor("rfedray.privacy.ledger") == "rfedray.privacy"
