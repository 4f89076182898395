"""GPU cross-validation of every registered implementation over the named cases.

Each implementation runs on fresh random inputs with its outputs poisoned (NaN) and is compared
with the float64 oracle of what it consumed; unsupported cases must say why.
"""
from __future__ import annotations

import pytest
import torch

from ports import registry
from ports.harness.study import run_case
from ports.harness.suites import crossval

@pytest.mark.gpu
@pytest.mark.parametrize("case", crossval(), ids=lambda c: f"{c.label}: {c.describe()}")
def test_every_implementation_matches_the_oracle(case):
    report = run_case(case, registry.REGISTRY, seed=hash(case) % 1000, timing_on=False,
                      targets=frozenset({"cuda"}), device=torch.device("cuda"))
    bad = [(r.impl, r.status, r.reason) for r in report.results
           if r.status not in ("ok", "unsupported")]
    assert not bad
    assert any(r.status == "ok" for r in report.results)
    assert all(r.reason for r in report.results if r.status == "unsupported")


@pytest.mark.parametrize("family", ["leetcuda"])
def test_named_cases_exercise_every_cupy_port(family):
    """The named cases must run each CuPy port somewhere, not only mark it unsupported."""
    specs = registry.select(only=[family])
    ran = {s.name for s in specs for c in crossval() if s.unsupported_reason(c) is None}
    assert ran == {s.name for s in specs}
