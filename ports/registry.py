"""The one explicit list of implementations the study compares.

Each family keeps its specs beside its port (``ports/<package>/canonical.py``); this module only
names the packages, in table order (baselines first, then the ports, then the production peers of
``ports/peers``), and the words a user may select them by: an implementation's name, its family,
its backend, or ``peers`` (every peer and user row). The specs load on first use of
:data:`REGISTRY` (``compare.py --help`` needs only the words, not torch). A user's own functions
join with :func:`add` (``compare.py --impl``, and the ``rope_ports.impls`` entry points).

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

PACKAGES = ("eager", "te", "leetcuda", "apex", "paddle", "oneflow", "te_triton", "batch_reuse",
            "kernl", "vllm_port", "flashinfer_port", "sglang", "fastrope", "peers")
# Every spec's family is one of these; fastrope-ablation's variants run only when named.
FAMILIES = ("eager", "leetcuda", "apex", "te", "paddle", "oneflow", "te_triton", "batch_reuse",
            "kernl", "vllm_port", "flashinfer_port", "sglang", "fastrope", "fastrope-ablation",
            "liger", "flash_attn", "flashinfer", "transformer_engine", "vllm")
USER_FAMILY = "user"  # the family of rows added by add() (compare.py --impl, entry points)
PEERS_WORD = "peers"  # selects every spec of kind "peer": the libraries and the user's rows
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
    strays = {s.name for s in specs
              if s.family not in (*FAMILIES, USER_FAMILY) or s.backend not in BACKENDS}
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


def add(specs: Iterable[ImplSpec]) -> None:
    """Append ``specs`` (a user's functions, family ``user``) to the registry, after every other
    row. A name already registered raises ValueError naming it."""
    specs = tuple(specs)
    taken = {s.name for s in _specs()}
    names = [s.name for s in specs]
    clash = sorted({n for n in names if n in taken or names.count(n) > 1})
    if clash:
        raise ValueError(f"implementation names already registered: {', '.join(clash)} (give "
                         "the function another name, or rope_impl(name=...))")
    strays = sorted(s.name for s in specs if s.backend not in BACKENDS)
    if strays:
        raise ValueError(f"specs with a backend the registry does not name: {strays}")
    total = _specs() + specs
    globals().update(REGISTRY=total, NAMES=tuple(s.name for s in total))


def add_user_impls(targets: Iterable[str] = (), entry_points: bool = True) -> list[ImplSpec]:
    """Register the ``--impl module:function`` targets and (with ``entry_points``) the installed
    ``rope_ports.impls`` entry points; returns the new specs. A bad target raises
    :class:`ports.peers.user.BadImpl` (a ValueError) with one line saying why."""
    from ports.peers import user

    new = [user.load(t) for t in targets]
    if entry_points:
        given = {s.name for s in new}
        new += [s for s in user.entry_point_specs() if s.name not in given]
    add(new)
    return new


def unknown_name(word: str) -> str:
    """Why ``word`` selects nothing: the families, the backends and the closest names."""
    specs = _specs()
    words = [*(s.name for s in specs), *FAMILIES, *BACKENDS, PEERS_WORD]
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

    A word is a name, a family (``leetcuda``), a backend (``triton``: every Triton port; peers
    are not ports) or ``peers`` (every production peer and user row).
    Ablations (kind ``ablation``) run only when named or their family is.
    """
    specs = _specs()

    def expand(words: Iterable[str]) -> set[str]:
        out = set()
        for word in words:
            word = ALIASES.get(word, word)
            hits = [s.name for s in specs if word in (s.name, s.family)
                    or (word == s.backend and s.kind not in ("ablation", "peer"))
                    or (word == PEERS_WORD and s.kind == "peer")]
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
