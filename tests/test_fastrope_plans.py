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
from ports.fastrope import ablation, kernel, launcher, plan, run, tuning

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


TUNED = json.loads((pathlib.Path(__file__).parent / "data" / "fastrope_tuned_plans.json")
                   .read_text(encoding="utf-8"))


def test_every_shipped_tuning_table_has_pinned_plans():
    assert set(TUNED) == set(tuning.tables()), (
        "tests/data/fastrope_tuned_plans.json pins other families than ports/fastrope/tuned "
        "ships: re-record with PYTHONPATH=.:tests python tests/data/record_tuned_plans.py")


@pytest.mark.parametrize("family", sorted(TUNED))
def test_tuned_plans_are_unchanged(monkeypatch, family):
    """The launches on each GPU family with a table are the ones pinned: the results/ tables
    measured on that GPU describe them. A change that moves them fails here until re-recorded
    (tests/data/record_tuned_plans.py says how, and that results/ should say which GPU's tables
    it leaves behind)."""
    table = tuning.tables()[family]
    got = C.tuned_digests(monkeypatch.setattr, table, plan=plan, kernel=kernel,
                          launcher=launcher, run=run)
    pinned = TUNED[family]
    assert len(got) == len(pinned), "the problems changed: re-record the pinned plans"
    differ = [case for case, g, p in zip(C.cases(), got, pinned) if g != p]
    assert not differ, (f"{len(differ)} of {len(got)} launches on {family} differ from the pinned "
                        f"ones (first: {differ[0]}); the GPU's measured tables predate them: "
                        "re-record with PYTHONPATH=.:tests python tests/data/record_tuned_plans.py")


def test_a_moved_launch_is_caught(monkeypatch):
    """The pin can fail: the H100's table without its choice gives other in-place launches."""
    family = next(f for f in TUNED if tuning.tables()[f]["choices"])
    table = dict(tuning.tables()[family], choices={})
    got = C.tuned_digests(monkeypatch.setattr, table, plan=plan, kernel=kernel,
                          launcher=launcher, run=run)
    assert got != TUNED[family]
