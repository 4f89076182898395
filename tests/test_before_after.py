"""tools/before_after.py pairs two runs' rows by case and implementation and prints their ratio."""
import json

from tools import before_after


def _run(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return str(path)


def test_pairs_rows_and_reports_ratios(tmp_path, capsys):
    before = _run(tmp_path, "b.json", [
        {"case": "c1", "impl": "x", "status": "ok", "graph_us": 10.0},
        {"case": "c1", "impl": "y", "status": "ok", "graph_us": 20.0},
        {"case": "c2", "impl": "x", "status": "ok", "graph_us": 5.0}])
    after = _run(tmp_path, "a.json", [
        {"case": "c1", "impl": "x", "status": "ok", "graph_us": 11.0},
        {"case": "c1", "impl": "y", "status": "FAIL", "graph_us": None}])
    assert before_after.main([before, after, "--csv", str(tmp_path / "o.csv")]) == 0
    out = capsys.readouterr().out
    assert "| c1 | x | 10.00 | 11.00 | 1.100 | ok |" in out
    assert "| c1 | y | 20.00 | - | - | ok -> FAIL |" in out
    assert "c2" not in out  # only in one run
    assert "1 pairs timed" in out and "1 pairs changed status" in out
    assert (tmp_path / "o.csv").read_text().startswith("case,impl,before,after,ratio,status")


def test_disjoint_runs_exit_2(tmp_path):
    a = _run(tmp_path, "a.json", [{"case": "c", "impl": "x", "status": "ok", "graph_us": 1.0}])
    b = _run(tmp_path, "b.json", [{"case": "d", "impl": "x", "status": "ok", "graph_us": 1.0}])
    assert before_after.main([a, b]) == 2
