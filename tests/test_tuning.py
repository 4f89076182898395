"""Per-device tuning: a GPU's family, the shipped tables, the rules they give, and the tuning
command's decisions and arguments (CPU; the timing itself runs on the GPU stages)."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from ports.fastrope import plan, qknorm, tuning
from ports.harness import tune

H100 = tuning.family_name(9, 0, 132, 50 * 2**20, 5120)
H200 = tuning.family_name(9, 0, 132, 50 * 2**20, 6144)


def test_the_h100_and_the_h200_are_different_families():
    assert H100 != H200
    assert H100 == "sm_90, 132 SMs, 50 MiB L2, 5120-bit memory bus"
    assert tune.table_name(H200) == "sm-90-132-sms-50-mib-l2-6144-bit-memory-bus.json"


def test_every_shipped_table_is_valid_and_named_for_its_family():
    """Each table's choices name rows and alternatives plan.py has, and its file is named
    for its family (two tables for one family would be refused)."""
    shipped = tuning.tables()
    for family, table in shipped.items():
        assert table["path"] == tune.table_name(family)
        rules = plan.with_choices(table["choices"])
        assert len(rules) == len(plan.RULES)
        for row, alternative in table["choices"].items():
            assert any(r.name == f"{row}: {alternative}" for r in rules)


def test_every_shipped_tables_choices_follow_from_its_measurements():
    """The decision rule, applied to a shipped table's measurements, gives its choices (a table
    written under an older rule, or edited by hand, fails here)."""
    for family, table in tuning.tables().items():
        rows = [r for r in tune.TRIALS if any(m["row"] == r for m in table["measurements"])]
        choices, _ = tune.choose(table["measurements"], rows)
        assert choices == table["choices"], family


def test_a_choice_replaces_its_rows_settings_and_nothing_else():
    row = "16-bit past the L2: 8-byte accesses, 2 or 4 heads"
    rules = plan.with_choices({row: "16-byte accesses, 4 heads"})
    assert rules is plan.with_choices({row: "16-byte accesses, 4 heads"})  # cached
    changed = [(a, b) for a, b in zip(plan.RULES, rules) if a is not b]
    assert len(changed) == 1
    own, tuned = changed[0]
    assert own.name == row and tuned.when is own.when and tuned.section == own.section
    assert tuned.settings == {"vector": None, "unroll": 4}
    assert plan.with_choices({}) == plan.RULES


@pytest.mark.parametrize("choices, message", [
    ({"the default": "x"}, "has alternatives"),
    ({"streaming past the L2": "never"}, "choose from 'plain accesses'"),
])
def test_unknown_rows_and_alternatives_are_refused(choices, message):
    with pytest.raises(ValueError, match=message):
        plan.with_choices(choices)


def test_a_device_runs_its_familys_choices(monkeypatch, tmp_path):
    """device_rules reads the table of the device's family; another family runs RULES."""
    row = "fp32 in place past the L2: 2 heads per step"
    (tmp_path / "t.json").write_text(json.dumps({"family": H200, "choices": {row: "1 head"}}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    tuning.tables.cache_clear()
    plan.device_rules.cache_clear()
    try:
        for family, expected in ((H200, {row: "1 head"}), (H100, {})):
            monkeypatch.setattr(tuning, "device_family", lambda index, f=family: f)
            plan.device_rules.cache_clear()
            assert tuning.choices(0) == expected
            assert plan.device_rules(0) == plan.with_choices(expected)
    finally:
        tuning.tables.cache_clear()
        plan.device_rules.cache_clear()


def test_two_tables_for_one_family_are_refused(monkeypatch, tmp_path):
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps({"family": H100, "choices": {}}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    tuning.tables.cache_clear()
    try:
        with pytest.raises(ValueError, match="two tuning tables"):
            tuning.tables()
    finally:
        tuning.tables.cache_clear()


def test_every_shipped_tables_qknorm_entry_is_valid():
    """A table's fused QK-norm constants are DEVICE_TUNED names with positive ints (a switch,
    0 or 1), chosen on the table's own GPU by ``tune --qknorm`` (its run and measurements in the
    table)."""
    switches = {"TOKEN_FWD_QK_TOGETHER"}
    for family, table in tuning.tables().items():
        constants = table.get("qknorm", {})
        assert set(constants) <= set(qknorm.DEVICE_TUNED), family
        assert all(isinstance(v, int) and (v in (0, 1) if name in switches else v > 0)
                   for name, v in constants.items()), family
        run = table.get("qknorm_run")
        assert bool(constants) == bool(run), family
        if run:
            assert run["gpu"] == table["gpu"] and "--qknorm" in run["command"], family
            assert table["qknorm_measurements"], family
        # a constant set by hand names the sweep's data file, measured on the table's GPU
        root = pathlib.Path(__file__).resolve().parents[1]
        for name, source in table.get("qknorm_source", {}).items():
            assert name in constants, (family, name)
            data = json.loads((root / source).read_text(encoding="utf-8"))
            assert data["gpu"] == table["gpu"] and "qknorm_launch_sweep" in str(data["command"])


def test_a_qknorm_run_replaces_the_constants_set_by_hand():
    """``tune --qknorm`` decides every constant: the old table's ``qknorm_source`` goes, its plan
    rows stay."""
    old = dict(family="f", choices={"row": "alt"}, qknorm={"TOKEN_FWD_ELEMENTS_PER_WARP": 4096},
               qknorm_source={"TOKEN_FWD_ELEMENTS_PER_WARP": "results/data/x.json"})
    table = tune.with_qknorm(old, "f", {"TOKEN_FWD_ELEMENTS_PER_WARP": 2048}, {}, [], [])
    assert "qknorm_source" not in table and table["choices"] == {"row": "alt"}
    assert table["qknorm"] == {"TOKEN_FWD_ELEMENTS_PER_WARP": 2048} and "qknorm_source" in old


def test_qknorm_constants_come_from_forced_then_the_family_table_then_the_module(
        monkeypatch, tmp_path):
    name = "BACKWARD_PROGRAMS_PER_SM"
    (tmp_path / "t.json").write_text(json.dumps({"family": H200, "choices": {},
                                                 "qknorm": {name: 5}}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(qknorm, "FORCED", {})
    tuning.tables.cache_clear()
    gpu = torch.device("cuda", 0)
    try:
        monkeypatch.setattr(tuning, "device_family", lambda index: H200)
        assert qknorm.launch_constant(name, gpu) == 5
        assert qknorm.launch_constant(name, torch.device("cpu")) == qknorm.BACKWARD_PROGRAMS_PER_SM
        assert qknorm.launch_constant("HEAD_FWD_WARPS", gpu) == qknorm.HEAD_FWD_WARPS
        qknorm.FORCED[name] = 7
        assert qknorm.launch_constant(name, gpu) == 7
        qknorm.FORCED.clear()
        monkeypatch.setattr(tuning, "device_family", lambda index: H100)
        assert qknorm.launch_constant(name, gpu) == qknorm.BACKWARD_PROGRAMS_PER_SM
    finally:
        tuning.tables.cache_clear()


def test_every_row_with_alternatives_is_tuned_on_cases():
    assert set(tune.TRIALS) == set(plan.ALTERNATIVES)
    assert set(plan.ALTERNATIVES) <= {r.name for r in plan.RULES}
    for trials in tune.TRIALS.values():
        assert trials and len(set(trials)) == len(trials)


@pytest.mark.parametrize("ratios, chosen", [
    # the best geometric mean
    ({"a": {"x": 0.95, "y": 0.97}, "b": {"x": 0.98, "y": 0.99}}, "a"),
    # a loses one case by more than the margin
    ({"a": {"x": 0.90, "y": 1.05}, "b": {"x": 0.98, "y": 0.97}}, "b"),
    ({"a": {"x": 0.995, "y": 0.995}}, None),          # within the margin: the row's own
    ({"a": {}}, None),                                 # changed no plan
    # a gains more where it changes the plan (x), b about as much on x, y and z: b is ahead
    # over the three (a counts 1 on y and z)
    ({"a": {"x": 0.955}, "b": {"x": 0.96, "y": 0.97, "z": 0.97}}, "b"),
])
def test_an_alternative_wins_only_clearly(ratios, chosen):
    assert tune.decide(ratios)[0] == chosen


def test_choose_turns_measurements_into_choices():
    row = "fp32 out of place past the L2: heads per step from the work"
    m = [dict(row=row, alternative="2 heads", case="x", same_plan=False, ratio=0.9),
         dict(row=row, alternative="2 heads", case="y", same_plan=False, ratio=0.95),
         dict(row=row, alternative="1 head", case="x", same_plan=True)]
    choices, scores = tune.choose(m, [row])
    assert choices == {row: "2 heads"}
    by_alt = {s["alternative"]: s for s in scores}
    assert by_alt["2 heads"]["chosen"] and by_alt["2 heads"]["cases"] == 2
    assert by_alt["1 head"]["geomean"] is None and not by_alt["1 head"]["chosen"]
    assert tune.score_rows(scores)[0][-1] in ("yes", "")


@pytest.mark.parametrize("argv, message", [
    (["--rows", "no such row"], "no tunable row 'no such row'"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        tune.main([])
    assert e.value.code == 3 and "needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("heads, wide", [(64, True), (32, False)])
def test_wide_accesses_where_they_leave_fewer_idle_head_slots(monkeypatch, heads, wide):
    """The alternative takes 16-byte accesses and 4 heads for 64 + 8 heads (0 idle slots
    against 24 with 8-byte accesses and 2 heads) and leaves 32 + 8 heads (0 either way) to the
    row's own 8-byte accesses."""
    from test_fastrope import _plan

    row = "16-bit past the L2: 8-byte accesses, 2 or 4 heads"
    alternative = "16-byte accesses and 4 heads where they leave fewer idle head slots"
    kw = dict(shape=(1, 64, heads, 128), k_heads=8, l2=1 << 16, step_eligible=False)
    own = _plan(monkeypatch, **kw)
    monkeypatch.setattr(plan, "RULES", plan.with_choices({row: alternative}))
    tuned = _plan(monkeypatch, **kw)
    assert own.vector == 4 and own.unroll == (2 if heads == 64 else 4)
    assert (tuned.vector, tuned.unroll) == ((8, 4) if wide else (own.vector, own.unroll))


def test_retuning_one_row_keeps_the_other_rows_choices():
    """``--rows`` re-times its rows; the family's other rows keep their choices, scores and
    measurements, and ``runs`` says which run measured which rows."""
    streaming, step = "streaming past the L2", "several heads per step thread in place"

    def table(commit, rows, choices):
        return dict(family=H200, commit=commit, command="tune", gpu="g", date="d",
                    choices=choices,
                    scores=[dict(row=r, alternative="x") for r in rows],
                    measurements=[dict(row=r, alternative="x", case=commit) for r in rows])

    old = table("a", [streaming, step], {streaming: "plain accesses", step: "4 heads"})
    new = table("b", [streaming], {})
    merged = tune.keep_other_rows(old, new, [streaming])
    assert merged["choices"] == {step: "4 heads"}  # streaming re-timed: its old choice dropped
    assert [m["case"] for m in merged["measurements"]] == ["b", "a"]  # in TRIALS order
    assert merged["runs"] == [dict(command="tune", commit="a", gpu="g", date="d", rows=[step]),
                              dict(command="tune", commit="b", gpu="g", date="d",
                                   rows=[streaming])]
    again = tune.keep_other_rows(merged, table("c", [step], {}), [step])
    assert [r["commit"] for r in again["runs"]] == ["b", "c"] and again["choices"] == {}
    other_family = dict(old, family=H100)
    assert tune.keep_other_rows(other_family, new, [streaming]) is new
    qk = dict(qknorm={"BACKWARD_PROGRAMS_PER_SM": 4}, qknorm_run=dict(commit="q"))
    kept = tune.keep_other_rows(dict(old, **qk), new, [streaming])
    assert {k: kept[k] for k in qk} == qk  # the QK-norm's entry survives a re-tune
    # a row the plan no longer has (renamed) goes, with its run where it was the run's only row
    gone = table("g", ["an old row's name"], {})
    gone_run = dict(command="tune", commit="g", gpu="g", date="d", rows=["an old row's name"])
    renamed = tune.keep_other_rows(
        dict(old, runs=tune.runs(old) + [gone_run],
             measurements=old["measurements"] + gone["measurements"]), new, [streaming])
    assert [r["commit"] for r in renamed["runs"]] == ["a", "b"]
    assert all(m["row"] != "an old row's name" for m in renamed["measurements"])


@pytest.mark.parametrize("in_place", [False, True])
def test_plain_accesses_out_of_place_keeps_the_hints_in_place(monkeypatch, in_place):
    from test_fastrope import _flags, _plan

    from ports.fastrope import kernel

    kw = dict(shape=(1, 32768, 8, 128), in_place=in_place, l2=1 << 16)
    assert not _flags(_plan(monkeypatch, **kw)) & kernel.PLAIN_ACCESSES  # the row's own
    monkeypatch.setattr(plan, "RULES", plan.with_choices(
        {"streaming past the L2": "plain accesses out of place"}))
    plain = bool(_flags(_plan(monkeypatch, **kw)) & kernel.PLAIN_ACCESSES)
    assert plain == (not in_place)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_plain_accesses_for_fp32_out_of_place_only(monkeypatch, in_place, dtype):
    from test_fastrope import _flags, _plan

    from ports.fastrope import kernel

    kw = dict(shape=(1, 32768, 8, 128), in_place=in_place, l2=1 << 16, dtype=dtype)
    assert not _flags(_plan(monkeypatch, **kw)) & kernel.PLAIN_ACCESSES  # the row's own
    monkeypatch.setattr(plan, "RULES", plan.with_choices(
        {"streaming past the L2": "plain accesses for fp32 out of place"}))
    plain = bool(_flags(_plan(monkeypatch, **kw)) & kernel.PLAIN_ACCESSES)
    assert plain == (not in_place and dtype == torch.float32)


@pytest.mark.parametrize("heads, k_heads, vector, unroll", [
    (64, 8, 8, 4),     # 72 heads: 16-byte accesses leave 0 idle slots, 8-byte at 4 heads 56
    (32, 8, 4, 4),     # 40 heads: 0 either way
    (32, 0, 4, 4),     # 32 heads, q only: the row's own takes 2 heads per step
])
def test_four_heads_per_step_with_wide_accesses_where_they_leave_fewer_idle_slots(
        monkeypatch, heads, k_heads, vector, unroll):
    from test_fastrope import _plan

    row = "16-bit past the L2: 8-byte accesses, 2 or 4 heads"
    alternative = "4 heads, 16-byte accesses where they leave fewer idle head slots"
    kw = dict(shape=(1, 64, heads, 128), k_heads=k_heads, l2=1 << 16, step_eligible=False)
    own = _plan(monkeypatch, **kw)
    monkeypatch.setattr(plan, "RULES", plan.with_choices({row: alternative}))
    tuned = _plan(monkeypatch, **kw)
    assert (tuned.vector, tuned.unroll) == (vector, unroll)
    if k_heads == 0:
        assert (own.vector, own.unroll) == (4, 2)


@pytest.mark.parametrize("shape, k_heads, own, fixed_4, two_warps", [
    ((1, 4096, 32, 128), 8, 2, 4, 4),   # 40 heads: 4 per thread give blocks of 80 threads
    ((1, 32768, 8, 128), 0, 1, 4, 1),   # 8 heads: 4 per thread give blocks of 16, 2 of 32
])
def test_step_heads_where_the_blocks_hold_two_warps(monkeypatch, shape, k_heads, own, fixed_4,
                                                     two_warps):
    """The step kernel's heads per thread in place: the row's own (4 or 2 where the blocks fill
    whole warps, at least two), a fixed 4, and 4 or 2 where the blocks hold two warps' threads,
    whole warps or not (so a fixed 4 at 8 heads, blocks of 16 threads, is left out)."""
    from test_fastrope import _plan

    row = "several heads per step thread in place"
    kw = dict(shape=shape, k_heads=k_heads, in_place=True, step_eligible=True)

    alternatives = ("4 heads",
                    "4 or 2 heads where the blocks hold two warps' threads, whole warps or not")
    tables = {None: plan.RULES, **{a: plan.with_choices({row: a}) for a in alternatives}}

    def heads(alternative):
        monkeypatch.setattr(plan, "RULES", tables[alternative])
        p = _plan(monkeypatch, **kw)
        assert p.step
        return p.unroll

    assert heads(None) == own
    assert heads(alternatives[0]) == fixed_4
    assert heads(alternatives[1]) == two_warps


# ---- the fused QK-norm's constants (tune --qknorm) -------------------------------------------
def test_qknorm_candidates_leave_out_the_module_values():
    from ports.harness import qknorm_tune as qt

    own = qt.own_values()
    assert set(own) == set(qknorm.DEVICE_TUNED)
    rows = qt.candidates()
    assert set(rows) == {qt.FORWARD, qt.BACKWARD, qt.TOKEN_FORWARD}
    for alternatives in rows.values():
        assert alternatives and all(any(own[k] != v for k, v in c.items())
                                    for c in alternatives.values())
    assert "BACKWARD_PROGRAMS_PER_SM=4" in rows[qt.BACKWARD]
    assert f"BACKWARD_PROGRAMS_PER_SM={own['BACKWARD_PROGRAMS_PER_SM']}" not in rows[qt.BACKWARD]
    own_token = (own["TOKEN_FWD_QK_TOGETHER"], own["TOKEN_FWD_ELEMENTS_PER_WARP"])
    assert list(rows[qt.TOKEN_FORWARD]) == [
        f"TOKEN_FWD_QK_TOGETHER={t}, TOKEN_FWD_ELEMENTS_PER_WARP={e}"
        for t, e in qt.TOKEN_FORWARD_SETTINGS if (t, e) != own_token]
    assert len(rows[qt.TOKEN_FORWARD]) == len(qt.TOKEN_FORWARD_SETTINGS) - 1
    assert qt.constants_of({}) == own
    fwd = "HEAD_FWD_BLOCK_ELEMENTS=1024, HEAD_FWD_WARPS=1"
    assert qt.constants_of({qt.FORWARD: fwd}) == dict(own, HEAD_FWD_BLOCK_ELEMENTS=1024,
                                                      HEAD_FWD_WARPS=1)


def test_qknorm_forced_sets_every_constant_and_restores(monkeypatch):
    from ports.harness import qknorm_tune as qt

    monkeypatch.setattr(qknorm, "FORCED", {"HEAD_FWD_WARPS": 7})
    with qt.forced({"BACKWARD_PROGRAMS_PER_SM": 5}):
        assert qknorm.FORCED == dict(qt.own_values(), BACKWARD_PROGRAMS_PER_SM=5)
    assert qknorm.FORCED == {"HEAD_FWD_WARPS": 7}


def _qknorm_measurements(qt):
    def m(row, alt, case, ratio):
        return dict(row=row, alternative=alt, case=case, same_plan=False, own_us=10.0,
                    us=10.0 * ratio, ratio=ratio)

    fwd = "HEAD_FWD_BLOCK_ELEMENTS=1024, HEAD_FWD_WARPS=1"
    return [m(qt.FORWARD, fwd, "a", 0.90), m(qt.FORWARD, fwd, "b", 0.95),
            m(qt.BACKWARD, "BACKWARD_PROGRAMS_PER_SM=4", "a", 0.995),  # within the margin
            m(qt.BACKWARD, "BACKWARD_PROGRAMS_PER_SM=2", "a", 1.20)]


def test_tune_qknorm_writes_the_entry_and_keeps_the_plan(monkeypatch, tmp_path, capsys):
    """``--qknorm`` replaces the family table's QK-norm entry (constants, run, scores and
    measurements) and keeps its plan choices; a later plan run keeps the entry."""
    from ports.harness import env, qknorm_tune as qt

    row = "streaming past the L2"
    old = dict(family=H100, command="tune", commit="a", gpu="g", date="d",
               choices={row: "plain accesses"}, scores=[dict(row=row, alternative="x")],
               measurements=[dict(row=row, alternative="x", case="c")],
               qknorm={"BACKWARD_PROGRAMS_PER_SM": 9}, qknorm_run=dict(commit="old"))
    out = tmp_path / "t.json"
    out.write_text(json.dumps(old))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    monkeypatch.setattr(tuning, "device_family", lambda index: H100)
    monkeypatch.setattr(env, "metadata", lambda: dict(
        gpu="g", torch="t", triton="tr", cupy="c", python="p", git_sha="sha",
        timestamp="2026-11-27T00:00:00"))
    monkeypatch.setattr(env, "driver_version", lambda: "drv")
    monkeypatch.setattr(qt, "measure", lambda rounds, rep_ms, progress: _qknorm_measurements(qt))
    assert tune.main(["--qknorm", "--out", str(out), "--json", str(tmp_path / "s.json")]) == 0
    table = json.loads(out.read_text())
    assert table["choices"] == {row: "plain accesses"}
    assert table["qknorm"] == dict(qt.own_values(), HEAD_FWD_BLOCK_ELEMENTS=1024,
                                   HEAD_FWD_WARPS=1)
    assert table["qknorm_run"]["command"] == "python -m ports.harness.tune --qknorm"
    assert table["qknorm_run"]["choices"] == {qt.FORWARD: "HEAD_FWD_BLOCK_ELEMENTS=1024, "
                                                          "HEAD_FWD_WARPS=1"}
    assert len(table["qknorm_measurements"]) == 4
    assert any(s["chosen"] for s in table["qknorm_scores"])
    scores = json.loads((tmp_path / "s.json").read_text())
    assert "fused QK-norm" in scores["context"] and len(scores["rows"]) == len(
        table["qknorm_scores"])
    json_path = tmp_path / "s.json"
    assert scores["command"] == f"python -m ports.harness.tune --qknorm --json {json_path}"
    assert "qknorm:" in capsys.readouterr().out
    new = dict(family=H100, command="tune", commit="b", gpu="g", date="d", choices={},
               scores=[], measurements=[])
    kept = tune.keep_other_rows(table, new, [row])
    assert {k: kept[k] for k in table if k.startswith("qknorm")} == {
        k: table[k] for k in table if k.startswith("qknorm")}


def test_tune_qknorm_starts_a_table_for_a_new_family():
    from ports.harness import qknorm_tune as qt

    table = tune.with_qknorm(None, H200, qt.own_values(), dict(command="c"), [], [dict(x=1)])
    assert table["family"] == H200 and table["choices"] == {}
    assert table["qknorm"] == qt.own_values() and table["qknorm_measurements"] == [dict(x=1)]
    other = tune.with_qknorm(dict(family=H100, choices={"r": "a"}), H200, {}, {}, [], [])
    assert other["choices"] == {}  # another family's table is not this one's


def test_tune_qknorm_refuses_rows(capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(["--qknorm", "--rows", "streaming past the L2"])
    assert e.value.code == 2 and "leave out --rows" in capsys.readouterr().err


def test_qknorm_measure_checks_then_times_every_candidate(monkeypatch):
    """measure's plumbing on a tiny shape (CPU tensors under the interpreter without a GPU; a
    stand-in timer): a ratio per (row, alternative, case), the constants restored after, and a
    candidate whose answer differs from the module's values refused."""
    from ports.harness import qknorm_bench as bench
    from ports.harness import qknorm_tune as qt
    from ports.harness import timing

    if not torch.cuda.is_available():
        monkeypatch.setattr(bench, "inputs", lambda shape, dtype, grad, norm="head": tuple(
            t.requires_grad_(grad and i < 4)
            for i, t in enumerate(_cpu_inputs(shape, dtype, norm))))
    tiny = bench.Shape("tiny", 1, 6, 4, 2, 16)
    monkeypatch.setattr(bench, "SHAPES", [tiny])
    monkeypatch.setattr(qt, "FORWARD_SETTINGS", ((512, 1), (1024, 1)))
    monkeypatch.setattr(qt, "BACKWARD_SETTINGS", (3, 4))
    monkeypatch.setattr(qknorm, "FORCED", {})
    times = iter(range(1, 10**6))
    monkeypatch.setattr(timing, "graph_median_us", lambda fn, rep_ms: float(next(times)))
    seen = []
    ms = qt.measure(2, 1, seen.append, shapes=["tiny"])
    assert ms == seen and {m["row"] for m in ms} == {qt.FORWARD, qt.BACKWARD, qt.TOKEN_FORWARD}
    assert {m["case"] for m in ms} == {"tiny out of place", "tiny in place", "tiny"}
    assert all(m["ratio"] > 0 and not m["same_plan"] for m in ms)
    assert qknorm.FORCED == {}

    real_check = qt.check_same_answer

    def off_by_one(results, ref, weights, label):  # the first candidate's answer is moved
        off_by_one.calls += 1
        if off_by_one.calls == 1:
            results = [r + 1 for r in results]
        return real_check(results, ref, weights, label)

    off_by_one.calls = 0
    monkeypatch.setattr(qt, "check_same_answer", off_by_one)
    with pytest.raises(RuntimeError, match="another answer than the reference setting"):
        qt.measure(1, 1, shapes=["tiny"])
    assert qknorm.FORCED == {}


@pytest.mark.parametrize("row", ["fused QK-norm forward", "fused QK-norm backward",
                                 "fused QK-norm token forward"])
def test_qknorm_tuning_times_the_suites_half_width_tables(monkeypatch, row):
    """Every call ``tune --qknorm`` times and checks gets the tables the qknorm suite's fastrope
    rows get: the full-width rows' first halves, ``[L, R/2]``. With full-width rows the forward
    reads 2.5% more bytes a token, and on the H200 the token forward ranked its settings
    differently by table form (results/README.md, "the fused QK-norm's bytes")."""
    from ports.harness import qknorm_bench as bench
    from ports.harness import qknorm_tune as qt

    shape = bench.Shape("tiny", 1, 6, 4, 2, 16)
    monkeypatch.setattr(bench, "inputs", lambda shape, dtype, grad, norm="head": tuple(
        t.requires_grad_(grad and i < 4) for i, t in enumerate(_cpu_inputs(shape, dtype, norm))))
    seen = []

    def record(q, k, qw, kw, eps, *, cos, sin, **kw_):
        seen.append((cos, sin))
        return q * qw.sum(), k * kw.sum()  # every input in the graph, for the backward's grad

    monkeypatch.setattr(qknorm, "qk_norm_rope", record)
    monkeypatch.setattr(qknorm, "qk_norm_rope_inplace", record)
    _, _, _, _, cos, sin = _cpu_inputs(shape, torch.bfloat16)
    for fn, result in qt._cases(shape, row).values():
        fn()
        result()
    assert seen
    for got_cos, got_sin in seen:
        assert torch.equal(got_cos, cos[:, :8]) and torch.equal(got_sin, sin[:, :8])


def _cpu_inputs(shape, dtype, norm="head"):
    """The qknorm suite's inputs for ``shape``, built on the CPU (the interpreter's device)."""
    from reference.tables import rope_tables

    g = torch.Generator().manual_seed(0)
    q = torch.randn(shape.b, shape.s, shape.hq, shape.d, generator=g).to(dtype)
    k = torch.randn(shape.b, shape.s, shape.hk, shape.d, generator=g).to(dtype)
    qw = (torch.randn(shape.d, generator=g) * 0.1 + 1.0).to(dtype)
    kw = (torch.randn(shape.d, generator=g) * 0.1 + 1.0).to(dtype)
    if norm == "token":
        qw, kw = qw.repeat(shape.hq), kw.repeat(shape.hk)
    cos, sin = rope_tables(shape.s, shape.d, device="cpu")
    return q, k, qw, kw, cos, sin


@pytest.mark.gpu
def test_tune_qknorm_on_the_gpu(monkeypatch, tmp_path):
    """The whole --qknorm run on one small shape with two settings a direction: every
    candidate checked against the module's values, timed, and the table written."""
    from ports.harness import qknorm_tune as qt

    own = qt.own_values()
    monkeypatch.setattr(qt, "SHAPES", ("qwen3-8b prefill 1k",))
    monkeypatch.setattr(qt, "FORWARD_SETTINGS", (
        (own["HEAD_FWD_BLOCK_ELEMENTS"], own["HEAD_FWD_WARPS"]),
        (2 * own["HEAD_FWD_BLOCK_ELEMENTS"], own["HEAD_FWD_WARPS"])))
    monkeypatch.setattr(qt, "BACKWARD_SETTINGS", (own["BACKWARD_PROGRAMS_PER_SM"] + 1,))
    out = tmp_path / "t.json"
    assert tune.main(["--qknorm", "--rounds", "1", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    cases = {(m["row"], m["case"]) for m in table["qknorm_measurements"]}
    assert cases == {(qt.FORWARD, "qwen3-8b prefill 1k out of place"),
                     (qt.FORWARD, "qwen3-8b prefill 1k in place"),
                     (qt.BACKWARD, "qwen3-8b prefill 1k"),
                     (qt.TOKEN_FORWARD, "qwen3-8b prefill 1k out of place"),
                     (qt.TOKEN_FORWARD, "qwen3-8b prefill 1k in place")}
    assert all(m["us"] > 0 and m["own_us"] > 0 for m in table["qknorm_measurements"])
    assert set(table["qknorm"]) == set(qknorm.DEVICE_TUNED)
    assert qknorm.FORCED == {}

