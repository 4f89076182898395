"""GPU cross-validation of every registered implementation over the named cases.

Each implementation runs on fresh random inputs with its outputs poisoned (NaN) and is compared
with the float64 oracle of what it consumed; unsupported cases must say why.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from ports import registry
from ports.harness.runner import run_case
from ports.harness.suites import crossval


def _seed(case) -> int:
    """A seed fixed by the case: crc32 of its repr (``hash`` of a str changes per process)."""
    return zlib.crc32(repr(case).encode()) % 1000


@pytest.mark.gpu
@pytest.mark.parametrize("case", crossval(), ids=lambda c: f"{c.label}: {c.describe()}")
def test_every_implementation_matches_the_oracle(case):
    report = run_case(case, registry.REGISTRY, seed=_seed(case), timing_on=False,
                      targets=frozenset({"cuda"}), device=torch.device("cuda"))
    bad = [(r.impl, r.status, r.reason) for r in report.results
           if r.status not in ("ok", "unsupported")]
    assert not bad
    assert all(r.reason for r in report.results if r.status == "unsupported")


def test_named_cases_exercise_every_implementation():
    """Each registered implementation runs on some named case, not only marked unsupported."""
    never = [s.name for s in registry.REGISTRY
             if all(s.unsupported_reason(c, s.devices) is not None for c in crossval())]
    assert not never
