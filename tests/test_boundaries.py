"""Imports flow cli → bench → api → service → workers, one way and without cycles; the lab stands alone.

The service never pulls in the HTTP stack or torch (it runs on the head node and answers the API; the torch
import alone costs seconds); worker code (which runs on remote nodes) never imports the control plane; and
no two modules import each other, directly or through others, even from inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"api": "meridian.api", "service": "meridian.service", "workers": "meridian.workers",
           "bench": "meridian.bench", "cli": "meridian.cli", "lab": "meridian.lab"}  # fmt: skip
MAY_IMPORT = {
    "meridian.cli": {"meridian.bench", "meridian.api", "meridian.service", "meridian.workers", "meridian.lab"},
    "meridian.bench": {"meridian.api", "meridian.service", "meridian.workers", "meridian.lab"},
    "meridian.api": {"meridian.service", "meridian.workers"},
    "meridian.service": {"meridian.workers"},
    "meridian.workers": set(),
    "meridian.lab": set(),
}
"""Which top-level packages each may import (at any depth of a file): the one-way flow above."""


def _modules_after(import_line: str) -> set[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def _service_modules() -> list[str]:
    return sorted(_module_name(p) for p in (ROOT / "service").rglob("*.py"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_service_does_not_import_the_http_stack_or_torch():
    mods = _modules_after("import " + ", ".join(_service_modules()))
    assert not {m for m in mods if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}
    assert not {m for m in mods if m.startswith("meridian.api")}
    assert "torch" not in mods, "a module the service imports loads torch: keep it in workers' torch-free contracts"


def test_workers_do_not_import_service_or_api():
    workers = [_module_name(p) for p in (ROOT / "workers").rglob("*.py")]
    mods = _modules_after("import " + ", ".join(sorted(workers)))
    assert not {m for m in mods if m.startswith(("meridian.service", "meridian.api"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every meridian module ``path`` imports, at any depth of the file except ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                 for n in ast.walk(node)}  # fmt: skip
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in known}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    known = set(paths)
    graph = {}
    for name, path in paths.items():
        # importing a.b.c runs a/__init__ and a/b/__init__ too, but those are docstrings: edges only to modules
        graph[name] = {m for m in _imports(path, known) if m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def _unit(module: str) -> str:
    """The subpackage ``module`` belongs to (``meridian.service.runner``), or the module itself where it sits
    directly in a top-level package (``meridian.service.core``): the units no two of which may import each other."""
    parts = module.split(".")
    if len(parts) >= 3 and ROOT.joinpath(_folder_of(parts[1]), parts[2]).is_dir():
        return ".".join(parts[:3])
    return module


def _folder_of(package: str) -> str:
    return next(folder for folder, name in FOLDERS.items() if name == f"meridian.{package}")


def subpackage_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, deps in import_graph().items():
        graph.setdefault(_unit(a), set()).update(_unit(b) for b in deps if _unit(b) != _unit(a))
    return graph


def tangles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one unit: units that all reach each other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(n: str) -> None:  # Tarjan's algorithm
        index[n] = low[n] = len(index)
        stack.append(n)
        for m in graph.get(n, ()):
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in stack:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            group = set()
            while True:
                m = stack.pop()
                group.add(m)
                if m == n:
                    break
            if len(group) > 1:
                out.append(frozenset(group))

    for n in sorted(graph):
        if n not in index:
            visit(n)
    return out


def test_tangles_are_found():
    assert tangles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert tangles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_subpackages():
    """Modules may form no cycle (above), nor may the subpackages they live in: ``service.runner`` and
    ``service.supervision`` import one way, never both."""
    found = [sorted(t) for t in tangles(subpackage_graph())]
    assert not found, found


def test_top_level_packages_import_only_downstream():
    wrong = sorted(f"{a} imports {b}" for a, deps in import_graph().items() for b in deps
                   if _top(b) != _top(a) and _top(b) not in MAY_IMPORT[_top(a)])
    assert not wrong, wrong


def _top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_package_inits_import_nothing():
    """Package ``__init__`` files are docstrings, so importing one module never drags in its siblings (and
    torch-free contracts stay torch-free)."""
    for init in (ROOT / "workers").rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], init
