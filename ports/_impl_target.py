"""``--impl module:function`` targets, checked without importing them (and without torch).

:mod:`ports.harness.cli` checks a target while parsing, so that a misspelt module costs one line
at once rather than after torch is imported; :func:`ports.peers.user.load` checks the same way
before it imports the module.
"""
from __future__ import annotations

import importlib.util
from pathlib import PurePath

EXAMPLE = "examples.my_rope:rope_half"


def problem(target: str) -> str | None:
    """Why ``target`` cannot name a function (what is wrong and what would be right, to follow
    ``--impl TARGET: ``), or None. The module is looked up (``importlib.util.find_spec``), not
    imported; a dotted name's parent packages are imported by that look-up."""
    module, sep, function = target.partition(":")
    module, function = module.strip(), function.strip()
    if not sep or not module or not function:
        return f"expected module:function (a colon between them), e.g. {EXAMPLE}"
    if module.endswith(".py") or "/" in module or "\\" in module:
        path = PurePath(module.replace("\\", "/"))
        dotted = ".".join(path.with_suffix("").parts if path.suffix == ".py" else path.parts)
        return (f"give the module's dotted name, not a file path: --impl {dotted}:{function}")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package missing, or a bad name
        found, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = f"no module named {module!r}"
    if found is None:
        return (f"cannot import module {module!r} ({why}); give a module on Python's path in "
                f"dotted form (e.g. {EXAMPLE}) or install its package")
    return None
