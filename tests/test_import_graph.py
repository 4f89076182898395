"""The package's imports between files form no circle, and the package never imports ``tools/``.

Every ``import`` and ``from ... import`` of ``ports/`` and ``reference/`` is read with ``ast``
(those inside functions and under ``TYPE_CHECKING`` too: a circle through a deferred import is
still a circle for the reader) and resolved to the file it loads. A name imported from a package
resolves to its module file where there is one (``from ports.harness import env`` ->
``ports/harness/env.py``), else to the package's ``__init__.py``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ports", "reference")


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _module_file(dotted: str) -> Path | None:
    """The file a dotted module name loads from this checkout, or None (not ours)."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(path: Path) -> set[str]:
    """Dotted names of every module ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            for alias in node.names:  # ``from pkg import mod`` is pkg/mod.py where that exists,
                sub = f"{module}.{alias.name}"  # else a name defined in pkg itself
                names.add(sub if _module_file(sub) is not None else module)
    return names


def import_graph() -> dict[str, set[str]]:
    """file -> the files of this checkout it imports (paths relative to the root)."""
    graph: dict[str, set[str]] = {}
    for path in _files():
        edges = set()
        for name in _imported_modules(path):
            target = _module_file(name)
            if target is not None and target != path:
                edges.add(str(target.relative_to(ROOT)))
        graph[str(path.relative_to(ROOT))] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reader_finds_a_circle():
    """The checker itself: a two-file circle and a three-file one are found, a chain is not."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_the_harness_imports():
    """Deferred (in-function) and ``from pkg import module`` imports are edges."""
    graph = import_graph()
    assert "ports/harness/modes.py" in graph["ports/harness/cli.py"]  # imported inside main()
    assert "ports/harness/env.py" in graph["ports/harness/runner.py"]
    assert "ports/harness/result.py" in graph["ports/harness/metrics.py"]  # TYPE_CHECKING


@pytest.mark.parametrize("folder", sorted({str(p.parent.relative_to(ROOT)) for p in _files()}))
def test_no_circle_between_files(folder):
    """No file of ``folder`` sits on a circle of imports (one test per folder, so that a circle
    names where it is)."""
    mine = [c for c in circles(import_graph()) if any(Path(f).parent == Path(folder) for f in c)]
    assert not mine, mine


def test_the_package_never_imports_tools():
    offenders = {f: sorted(n for n in _imported_modules(ROOT / f)
                           if n == "tools" or n.startswith("tools."))
                 for f in import_graph()}
    offenders = {f: names for f, names in offenders.items() if names}
    assert not offenders, offenders
