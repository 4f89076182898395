"""The package never imports the lab, and the lab uses only the package's public names (CPU).

(a) No module under ports/ or reference/ imports ``tools`` in any form: ``import tools...``,
``from tools... import``, or a ``"tools..."`` string handed to ``importlib.import_module`` /
``__import__``. (b) No file under tools/ imports an underscore-prefixed module or name of the
package (``ports._cupy``, ``from ports.x import _y``, ``ports.fastrope._z``), nor reaches one by
attribute (``_cupy._load``, ``canonical._preparer``) on a name it imported from the package.
(c) The implementations sit below the harness: no module under a family's folder (fastrope's
included) or reference/ imports ``ports.harness``; benchmarks that time a kernel live in the
harness.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ("ports", "reference")


def _files(*tops):
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def _is_tools(name: str) -> bool:
    return name == "tools" or name.startswith("tools.")


def tools_imports(tree: ast.AST) -> list[str]:
    """Where a module imports tools (line: what)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_tools(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _is_tools(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                        and _is_tools(arg.value):
                    found.append(f"{node.lineno}: {name}({arg.value!r})")
    return found


def _private_part(dotted: str) -> str | None:
    parts = dotted.split(".")
    return next((p for p in parts if p.startswith("_") and not p.startswith("__")), None)


def private_uses(tree: ast.AST) -> list[str]:
    """Where a tool imports or reaches an underscore name of the package (line: what)."""
    found, package_names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGE:
                    if _private_part(a.name):
                        found.append(f"{node.lineno}: import {a.name}")
                    package_names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in PACKAGE:
            if _private_part(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for a in node.names:
                if _private_part(a.name):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
                package_names.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private_part(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in package_names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", _files(*PACKAGE), ids=_rel)
def test_the_package_never_imports_tools(path):
    assert not tools_imports(ast.parse(path.read_text(), str(path)))


@pytest.mark.parametrize("path", _files("tools"), ids=_rel)
def test_tools_use_only_public_names(path):
    assert not private_uses(ast.parse(path.read_text(), str(path)))


@pytest.mark.parametrize("source, found", [
    ("import tools.x", ["1: import tools.x"]),
    ("from tools.seed004_pipeline import run", ["1: from tools.seed004_pipeline import ..."]),
    ("import importlib\nimportlib.import_module('tools.seed004_pipeline')",
     ["2: import_module('tools.seed004_pipeline')"]),
    ("__import__('tools')", ["1: __import__('tools')"]),
    ("import toolsmith\nfrom .tools import x", []),
])
def test_tools_imports_are_found(source, found):
    assert tools_imports(ast.parse(source)) == found


@pytest.mark.parametrize("source, found", [
    ("from ports import _cupy", ["1: from ports import _cupy"]),
    ("import ports._cupy", ["1: import ports._cupy"]),
    ("from ports.fastrope.canonical import _preparer",
     ["1: from ports.fastrope.canonical import _preparer"]),
    ("from ports import _cupy as c", ["1: from ports import _cupy"]),
    ("from ports.fastrope import run\nrun._ENTRIES.clear()", ["2: run._ENTRIES"]),
    ("from ports import registry\nregistry.get('x').__name__", []),
    ("import torch\ntorch._C._cuda_getCurrentRawStream(0)", []),
    ("from ports.fastrope import experiment\nexperiment.apply_rope", []),
])
def test_private_uses_are_found(source, found):
    assert private_uses(ast.parse(source)) == found


def harness_imports(tree: ast.AST) -> list[str]:
    """Where a module imports ports.harness (line: what)."""
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        found += [f"{node.lineno}: {n}" for n in names
                  if n == "ports.harness" or n.startswith("ports.harness.")
                  or (isinstance(node, ast.ImportFrom) and n == "ports"
                      and any(a.name == "harness" for a in node.names))]
    return found


@pytest.mark.parametrize("path", [p for p in _files(*PACKAGE)
                                  if "harness" not in p.relative_to(ROOT).parts
                                  and p.relative_to(ROOT).parts[:2] != ("ports", "registry.py")],
                         ids=_rel)
def test_the_implementations_never_import_the_harness(path):
    assert not harness_imports(ast.parse(path.read_text(), str(path)))


@pytest.mark.parametrize("source,found", [
    ("from ports.harness.timing import copy_us", ["1: ports.harness.timing"]),
    ("import ports.harness", ["1: ports.harness"]),
    ("from ports import harness", ["1: ports"]),
    ("from ports import registry", []),
])
def test_harness_imports_are_found(source, found):
    assert harness_imports(ast.parse(source)) == found
