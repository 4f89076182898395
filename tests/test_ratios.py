"""The time ratio to torch.compile and the same-size copy: built by hand, no GPU needed
(except the copy-timing test, marked ``gpu``)."""
from __future__ import annotations

import math

import pytest
import torch

from ports.harness import cli, metrics, report, runner, timing
from ports.harness.result import CaseReport, Result
from reference.case import RopeCase

CASE = RopeCase(1, 64, 2, 128, dtype="bf16")
COMPILE = "torch.compile(hf_rotate_half)"


def timed(name: str, us: float, graph_us: float | None = None) -> Result:
    return Result(name, "f", "port", "ok", max_abs_err=0.0, max_rel_err=0.0, err_over_tol=0.0,
                  median_us=us, graph_us=graph_us)


def with_ratios(results: list[Result], copy_same_us: float | None = None) -> list[Result]:
    metrics.derive(results, io_bytes=CASE.io_bytes(), copy_same_us=copy_same_us,
                   compiled=COMPILE)
    return results


def test_the_compile_reference_is_marked_on_its_spec():
    from ports import registry

    assert [s.name for s in registry.REGISTRY if s.compile_reference] == [COMPILE]
    assert [s.name for s in registry.REGISTRY if s.baseline] == [
        "torch.hf_rotate_half", "torch.llama_complex"]


def test_vs_compile_is_this_time_over_compiles():
    port, comp = with_ratios([timed("port", 90.0), timed(COMPILE, 100.0)])
    assert port.vs_compile == pytest.approx(0.90) and comp.vs_compile == 1.0
    assert port.graph_vs_compile is None and comp.graph_vs_compile is None  # no --graph
    assert report.result_row(port)[-1] == "0.90" and report.result_row(comp)[-1] == "1.00"
    assert port.as_dict()["vs_compile"] == pytest.approx(0.90)


def test_graph_vs_compile_only_with_graph_times():
    port, comp = with_ratios([timed("port", 90.0, graph_us=30.0), timed(COMPILE, 100.0, 40.0)])
    assert port.graph_vs_compile == pytest.approx(0.75) and comp.graph_vs_compile == 1.0
    row = report.result_row(port, graph=True)
    assert row[-2:] == ["0.90", "0.75"]
    assert len(report.result_row(port)) == len(report.RESULT_HEADERS)
    assert len(row) == len(report.RESULT_HEADERS) + 2


@pytest.mark.parametrize("comp", [
    None,                                                      # no compile row in the case
    Result(COMPILE, "f", "compiled", "unsupported", "no interleaved"),
    Result(COMPILE, "f", "compiled", "FAIL", "bad", timing_note="not timed: failed validation"),
    Result(COMPILE, "f", "compiled", "error", "RuntimeError: boom"),
    Result(COMPILE, "f", "compiled", "ok", timing_note="timing needs an NVIDIA GPU"),
])
def test_vs_compile_na_without_a_compile_time(comp):
    port = with_ratios([timed("port", 90.0, 30.0)] + ([comp] if comp else []))[0]
    assert port.vs_compile is None and port.graph_vs_compile is None
    assert report.result_row(port, graph=True)[-2:] == ["n/a", "n/a"]


def test_untimed_rows_use_their_own_missing_word():
    comp = timed(COMPILE, 100.0)
    no_gpu = Result("a", "f", "port", "ok", timing_note="timing needs an NVIDIA GPU")
    failed = Result("b", "f", "port", "FAIL", "bad", timing_note="not timed: failed validation")
    unsupported = Result("c", "f", "port", "unsupported", "no backward")
    with_ratios([comp, no_gpu, failed, unsupported])
    assert report.result_row(no_gpu, graph=True)[-3:] == ["no GPU"] * 3
    assert report.result_row(failed, graph=True)[-3:] == ["failed"] * 3
    row = report.result_row(unsupported, graph=True)
    assert row[-2:] == ["unsupported"] * 2 and len(row) == len(report.RESULT_HEADERS) + 2


def test_table_headers_place_the_compile_columns():
    rep = CaseReport(CASE, with_ratios([timed("port", 90.0, 30.0), timed(COMPILE, 100.0, 40.0)]),
                     None, None)
    header = report.case_table(rep).splitlines()[2]
    assert [h.strip() for h in header.strip("|").split("|")][-2:] == ["vs eager", "÷ compile"]
    header = report.case_table(rep, graph=True).splitlines()[2]
    cells = [h.strip() for h in header.strip("|").split("|")]
    assert cells[4:6] == ["median us", "graph us"]
    assert cells[-3:] == ["vs eager", "÷ compile", "graph ÷ compile"]
    header = report.case_table(rep, graph=True, verbose=True).splitlines()[2]
    cells = [h.strip() for h in header.strip("|").split("|")]
    assert cells == report.result_headers(graph=True) and cells[6] == "graph us"


def test_title_names_the_same_size_copy_only_when_measured():
    results = [timed("port", 90.0)]
    assert "same-size copy" not in report.case_table(CaseReport(CASE, results, None, None))
    title = report.case_table(CaseReport(CASE, results, 3000.0, None, 10.0)).splitlines()[1]
    gbps = CASE.io_bytes() / (10.0e-6) / 1e9
    assert f"; same-size copy 10.0 us ({gbps:.0f} GB/s)" in title


def test_pct_size_copy_is_copy_time_over_this_time():
    fast, slow, untimed = with_ratios(
        [timed("fast", 50.0), timed("slow", 200.0), Result("u", "f", "port", "unsupported")],
        copy_same_us=40.0)
    assert fast.pct_size_copy == pytest.approx(80.0) and slow.pct_size_copy == pytest.approx(20.0)
    assert untimed.pct_size_copy is None
    (row,) = with_ratios([timed("port", 50.0)], copy_same_us=None)
    assert row.pct_size_copy is None


def test_graph_pct_size_copy_divides_graph_times():
    """The replayed copy over the replayed call; no graph time on either side: no value."""
    results = [timed("both", 50.0, graph_us=40.0), timed("event only", 50.0)]
    metrics.derive(results, io_bytes=CASE.io_bytes(), copy_same_us=45.0,
                   copy_same_graph_us=36.0)
    both, event_only = results
    assert both.graph_pct_size_copy == pytest.approx(90.0)
    assert both.pct_size_copy == pytest.approx(90.0) and event_only.graph_pct_size_copy is None
    metrics.derive(results, io_bytes=CASE.io_bytes(), copy_same_us=45.0)
    assert both.graph_pct_size_copy is None
    rep = CaseReport(CASE, results, 3000.0, None, 45.0, 36.0)
    assert "same-size copy 45.0 us" in report.case_table(rep).splitlines()[1]
    assert ", replayed 36.0 us" in report.case_table(rep).splitlines()[1]
    assert report.flat_rows([rep], {})[0]["copy_same_graph_us"] == 36.0


def test_flat_rows_carry_the_new_fields():
    rep = CaseReport(CASE, with_ratios([timed("port", 90.0), timed(COMPILE, 100.0)], 45.0),
                     3000.0, None, 45.0)
    rows = report.flat_rows([rep], {"gpu": "none"})
    assert all(r["copy_same_us"] == 45.0 for r in rows)
    assert rows[0]["vs_compile"] == pytest.approx(0.9) and rows[0]["pct_size_copy"] == 50.0
    assert "graph_vs_compile" in rows[0]
    csv_header = report.to_csv(rows).splitlines()[0].split(",")
    for key in ("copy_same_us", "vs_compile", "graph_vs_compile", "pct_size_copy"):
        assert key in csv_header
    unmeasured = CaseReport(CASE, [Result("port", "f", "port", "ok")], None, None)
    assert report.flat_rows([unmeasured], {})[0]["copy_same_us"] is None


def test_summary_table_formats_ratios_and_size_copy():
    rows = [{"impl": "a", "case": "c1", "status": "ok", "vs_compile": 0.9, "pct_size_copy": 80.4,
             "graph_vs_compile": 1.234},
            {"impl": COMPILE, "case": "c1", "status": "ok", "vs_compile": 1.0,
             "pct_size_copy": 70.0, "graph_vs_compile": 1.0},
            {"impl": "a", "case": "c2", "status": "FAIL", "vs_compile": None,
             "pct_size_copy": None, "graph_vs_compile": None}]
    by_case = {line.split("|")[1].strip(): line
               for line in report.summary_table(rows, "vs_compile").splitlines()}
    assert "| 0.90 " in by_case["c1"] and "| 1.00 " in by_case["c1"] and "FAIL" in by_case["c2"]
    assert "| 1.23 " in report.summary_table(rows, "graph_vs_compile")
    assert "| 80 " in report.summary_table(rows, "pct_size_copy")


@pytest.mark.parametrize("value", ["vs_compile", "graph_vs_compile", "pct_size_copy"])
def test_cli_accepts_the_new_summary_values(value):
    args = cli.build_parser().parse_args(["--summary", "r.json", "--summary-value", value])
    assert args.summary_value == value


def test_cli_summary_prints_vs_compile(capsys, tmp_path):
    import json

    path = tmp_path / "r.json"
    path.write_text(json.dumps([{"impl": "a", "case": "c1", "status": "ok", "vs_compile": 0.5}]))
    assert cli.main(["--summary", str(path), "--summary-value", "vs_compile"]) == 0
    assert "| 0.50 " in capsys.readouterr().out


def test_run_case_on_cpu_times_nothing():
    from ports import registry

    specs = [registry.get("torch.hf_rotate_half")]
    rep = runner.run_case(RopeCase(1, 4, 1, 8), specs, targets=frozenset({"cpu"}),
                         device=torch.device("cpu"))
    assert rep.copy_same_us is None and "same-size copy" not in report.case_table(rep)
    assert all(r.vs_compile is None and r.pct_size_copy is None for r in rep.results)


@pytest.mark.gpu
def test_copy_us_times_a_real_copy():
    """Event and replayed times of the same copy: finite, and longer for 64x the bytes."""
    fn = timing.copy_of(1 << 20)
    dst, src = fn.args
    dst.zero_()
    fn()
    torch.cuda.synchronize()
    assert src.float().std() > 0 and torch.equal(dst, src)  # random data, really copied
    for graph in (False, True):
        small, large = (timing.copy_us(n, graph=graph) for n in (1 << 20, 1 << 26))
        assert math.isfinite(small) and 0 < small < large   # 64x the bytes takes longer


# ---- the host-cost benchmark's statistics (ports.harness.overhead) ------------------------------
def test_host_cost_statistics_are_over_every_call_and_the_ratios_pair_like_statistics():
    """A row's median and 10th percentile are over all its calls (the rounds pooled), its range
    is the rounds' medians; each host-cost ratio compares the same statistic of two rows."""
    from ports.harness import overhead

    stats = overhead.statistics_of([[float(v) for v in range(101, 201)],
                                    [float(v) for v in range(1, 101)]])
    assert stats["median"] == pytest.approx(100.5) and stats["low"] == pytest.approx(20.9)
    assert (stats["rounds_min"], stats["rounds_max"]) == (50.5, 150.5)

    def row(median, low):
        return {"median": median, "low": low, "rounds_min": 0.0, "rounds_max": 0.0}

    rows = {overhead.DIRECT: row(10.0, 8.0), overhead.OP: row(16.0, 12.0),
            overhead.COMPILED_INPLACE: row(60.0, 50.0), overhead.COMPILED_ADD: row(40.0, 36.0),
            overhead.COMPILED: row(70.0, 55.0), overhead.COMPILED_ADD_OUT: row(45.0, 37.0),
            overhead.COMPILED_LAUNCH: row(47.0, 41.0)}
    assert overhead.ratios(rows) == [
        ("the op through the dispatcher / the direct call", "1.60x", "1.50x"),
        ("compiled apply_rope_inplace - compiled t.add_(0)", "+20.0 us", "+14.0 us"),
        ("compiled apply_rope - compiled t + 0", "+25.0 us", "+18.0 us"),
        ("floor: compiled launch-only op - compiled t.add_(0)", "+7.0 us", "+5.0 us")]
