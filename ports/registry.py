"""The one explicit list of implementations the study compares.

Each family keeps its specs beside its port (``ports/<family>/canonical.py``); this module only
names the families, in table order: baselines first, then the ports.

>>> from ports import registry
>>> [s.name for s in registry.select(only=["torch.hf_rotate_half"])]
['torch.hf_rotate_half']
"""
from __future__ import annotations

from collections.abc import Iterable

from ports._spec import ImplSpec
from reference.case import RopeCase


def _load() -> tuple[ImplSpec, ...]:
    from ports.apex import canonical as apex
    from ports.batch_reuse import canonical as batch_reuse
    from ports.eager import canonical as eager
    from ports.kernl import canonical as kernl
    from ports.leetcuda import canonical as leetcuda
    from ports.oneflow import canonical as oneflow
    from ports.paddle import canonical as paddle
    from ports.fastrope import canonical as study
    from ports.te_triton import canonical as te_triton

    specs = (*eager.SPECS, *leetcuda.SPECS, *apex.SPECS, *paddle.SPECS, *oneflow.SPECS,
             *te_triton.SPECS, *batch_reuse.SPECS, *kernl.SPECS, *study.SPECS)
    names = [s.name for s in specs]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise RuntimeError(f"duplicate implementation names in the registry: {sorted(duplicates)}")
    return specs


REGISTRY: tuple[ImplSpec, ...] = _load()
NAMES: tuple[str, ...] = tuple(s.name for s in REGISTRY)


def get(name: str) -> ImplSpec:
    """The spec called ``name``; an unknown name raises with the list of known names."""
    for spec in REGISTRY:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown implementation {name!r}; known: {', '.join(NAMES)}")


def select(only: Iterable[str] | None = None, skip: Iterable[str] | None = None
           ) -> list[ImplSpec]:
    """Specs in registry order, filtered by exact names (``only``) and minus ``skip``.

    A name may also be a family (``leetcuda``) and selects all of its implementations.
    Ablations (kind ``ablation``) run only when named.
    """
    def expand(names):
        out = set()
        for n in names:
            family = [s.name for s in REGISTRY if s.family == n]
            out.update(family or [get(n).name])
        return out

    chosen = expand(only) if only else {s.name for s in REGISTRY if s.kind != "ablation"}
    chosen -= expand(skip or ())
    return [s for s in REGISTRY if s.name in chosen]


def baseline_for(case: RopeCase, targets: str | Iterable[str] = "cuda") -> ImplSpec | None:
    """The eager-torch baseline that supports ``case`` (speed-ups are relative to it)."""
    for spec in REGISTRY:
        if spec.baseline and spec.unsupported_reason(case, targets) is None:
            return spec
    return None
