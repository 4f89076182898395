"""The launch plans are the ones the planner made before it became a table (ae91f86): for every
problem of tests/fastrope_plan_cases.py (design and registry ablations), the same kernel
instantiation, grid, block, shared memory, plan fields and packed per-problem parameters, or the
same error. tests/data/fastrope_plans_from_ae91f86.py wrote the expected launches."""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest

import fastrope_plan_cases as C
from ports.fastrope import ablation, kernel, launcher, plan, run

RECORDS = json.loads(gzip.decompress(
    (pathlib.Path(__file__).parent / "data" / "fastrope_plans.json.gz").read_bytes()))
# The template was renamed; its arguments (FLAGS bits included) are unchanged.
RENAMED = ("study_rope<", "rope_rows<")


def _expected(launches):
    if isinstance(launches, str):
        return launches
    return [dict(lc, kernel=lc["kernel"].replace(*RENAMED)) for lc in launches]


def _call(name):
    def call(xs, kw):
        in_place = kw.pop("in_place")
        if name is None:
            run.DESIGN.entries.clear()
            run.rotate(*xs, in_place=in_place, **kw)
        else:
            ablation.planner(ablation.ABLATIONS[name]).entries.clear()
            fn = ablation.apply_rope_inplace if in_place else ablation.apply_rope
            if kw.pop("inverse"):
                raise AssertionError("no backward cases among the ablations")
            fn(*xs, ablation=name, **kw)
    return call


@pytest.mark.parametrize("which", sorted({r["ablation"] or "design" for r in RECORDS}))
def test_plans_are_unchanged(monkeypatch, which):
    launches = C.fake_device(monkeypatch.setattr, plan=plan, kernel=kernel, launcher=launcher)
    name = None if which == "design" else which
    call = _call(name)
    records = [r for r in RECORDS if r["ablation"] == name]
    assert records
    differ = []
    for r in records:
        xs, kw = C.arguments(r["case"])
        got = C.outcome(call, xs, dict(kw, in_place=r["case"]["in_place"]), launches)
        if got != _expected(r["launches"]):
            differ.append((r["case"], got, _expected(r["launches"])))
    assert not differ, f"{len(differ)} of {len(records)} plans differ; first: {differ[0]}"
