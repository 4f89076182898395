"""The one explicit list of implementations the study compares.

Each family keeps its specs beside its port (``ports/<package>/canonical.py``); this module only
names the packages, in table order (baselines first, then the ports), and the words a user may
select them by: an implementation's name, its family, or its backend. The specs load on first use
of :data:`REGISTRY` (``compare.py --help`` needs only the words, not torch).

>>> from ports import registry
>>> [s.name for s in registry.select(only=["torch.hf_rotate_half"])]
['torch.hf_rotate_half']
"""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ports._spec import ImplSpec
    from reference.case import RopeCase

PACKAGES = ("eager", "leetcuda", "apex", "paddle", "oneflow", "te_triton", "batch_reuse", "kernl",
            "fastrope")
# Every spec's family is one of these; fastrope-ablation's variants run only when named.
FAMILIES = ("eager", "leetcuda", "apex", "paddle", "oneflow", "te_triton", "batch_reuse", "kernl",
            "fastrope", "fastrope-ablation")
BACKENDS = ("torch", "cupy", "triton")
# Earlier names of rows, still accepted wherever a name is (results files and scripts hold them).
ALIASES = {"triton.te_seed000": "triton.te_style", "triton.batch_reuse_seed002": "triton.batch_reuse",
           "study": "fastrope", "study-ablation": "fastrope-ablation"}


def _load() -> tuple[ImplSpec, ...]:
    specs = tuple(spec for package in PACKAGES
                  for spec in importlib.import_module(f"ports.{package}.canonical").SPECS)
    names = [s.name for s in specs]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise RuntimeError(f"duplicate implementation names in the registry: {sorted(duplicates)}")
    strays = {s.name for s in specs if s.family not in FAMILIES or s.backend not in BACKENDS}
    if strays:
        raise RuntimeError(f"specs with a family or backend the registry does not name: "
                           f"{sorted(strays)}")
    return specs


def __getattr__(name: str):
    """``REGISTRY`` (every spec, in table order) and ``NAMES`` load the packages on first use."""
    if name in ("REGISTRY", "NAMES"):
        specs = _load()
        globals().update(REGISTRY=specs, NAMES=tuple(s.name for s in specs))
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _specs() -> tuple[ImplSpec, ...]:
    return globals().get("REGISTRY") or __getattr__("REGISTRY")


def unknown_name(word: str) -> str:
    """Why ``word`` selects nothing: the families, the backends and the closest names."""
    specs = _specs()
    words = [*(s.name for s in specs), *FAMILIES, *BACKENDS]
    close = difflib.get_close_matches(word, words, n=4, cutoff=0.5)
    return (f"unknown implementation {word!r}; families: {', '.join(FAMILIES)}; backends: "
            f"{', '.join(BACKENDS)}; "
            + (f"closest: {', '.join(close)}" if close else "compare.py --list names them all"))


def get(name: str) -> ImplSpec:
    """The spec called ``name``; an unknown name raises KeyError with the closest names."""
    name = ALIASES.get(name, name)
    for spec in _specs():
        if spec.name == name:
            return spec
    raise KeyError(unknown_name(name))


def select(only: Iterable[str] | None = None, skip: Iterable[str] | None = None
           ) -> list[ImplSpec]:
    """Specs in registry order: those ``only`` selects (all if not given), minus those of ``skip``.

    A word is a name, a family (``leetcuda``) or a backend (``triton``: every Triton port).
    Ablations (kind ``ablation``) run only when named or their family is.
    """
    specs = _specs()

    def expand(words: Iterable[str]) -> set[str]:
        out = set()
        for word in words:
            word = ALIASES.get(word, word)
            hits = [s.name for s in specs if word in (s.name, s.family)
                    or (word == s.backend and s.kind != "ablation")]
            if not hits:
                raise KeyError(unknown_name(word))
            out.update(hits)
        return out

    chosen = expand(only) if only else {s.name for s in specs if s.kind != "ablation"}
    chosen -= expand(skip or ())
    return [s for s in specs if s.name in chosen]


def baseline_for(case: RopeCase, targets: str | Iterable[str] = "cuda") -> ImplSpec | None:
    """The eager-torch baseline that supports ``case`` (speed-ups are relative to it)."""
    for spec in _specs():
        if spec.baseline and spec.unsupported_reason(case, targets) is None:
            return spec
    return None
